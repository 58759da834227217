"""Timing for the benchmarks: the compared calls in interleaved rounds, one call of each per round, so that a busy
moment of the device slows all of them alike; each figure keeps its rounds, hence its spread, and a ratio is taken
round by round.

One call is timed with CUDA events on GPU and ``time.perf_counter`` on CPU. `torch.utils.benchmark.Timer` cannot
time one call: its ``timeit`` makes two warm-up calls first (tripling a 64K-token case) and runs with one CPU
thread unless told otherwise."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one call in each round."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    def quartiles(self) -> tuple[float, float]:
        """(25th, 75th) percentile over the rounds (both the one value with a single round)."""
        if len(self.rounds) < 2:
            return self.rounds[0], self.rounds[0]
        q = statistics.quantiles(self.rounds, n=4, method="inclusive")
        return q[0], q[2]

    def __truediv__(self, other: "Timing") -> "Timing":
        """The per-round ratio to ``other`` (timed in the same rounds)."""
        return Timing(tuple(a / b for a, b in zip(self.rounds, other.rounds, strict=True)))

    def __sub__(self, other: "Timing") -> "Timing":
        return Timing(tuple(a - b for a, b in zip(self.rounds, other.rounds, strict=True)))


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call: between CUDA events on GPU (synchronized after), by the clock on CPU."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end)
        return cuda_time

    def cpu_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return cpu_time


def measure_interleaved(fns: dict[str, Callable[[], Any]], device: torch.device, warmup: int, reps: int
                        ) -> dict[str, Timing]:
    """Each of ``fns`` timed in ``reps`` interleaved rounds (one call of each per round, after ``warmup`` calls
    of each)."""
    timer = _timer(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, reps)):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: Timing(tuple(t)) for name, t in times.items()}


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> Timing:
    """``fn`` alone (`measure_interleaved` of one call)."""
    return measure_interleaved({"fn": fn}, device, warmup, reps)["fn"]


__all__ = ["Timing", "measure", "measure_interleaved"]
