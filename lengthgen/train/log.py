"""A run's log (rank 0 only): `RunLog` writes every logged step's and evaluation's *entry* to ``metrics.jsonl``
in the run folder, passes its numbers to TensorBoard and W&B (`lengthgen.train.tracking`), and tells the
console. A step is logged every ``train.log_every`` steps, and at the first and the last.

On a terminal the console shows a progress bar; otherwise (redirected to a file, or ``progress=False``) it
prints one plain line per logged step, readable line by line::

    [l2] step 100/400  loss 1.234  lr 3.0e-03  18.2k tok/s  eta 0:41
    [l2] eval step 100: length 32 loss 0.41 abs_error 0.35 | length 128 loss 2.3 abs_error 1.9
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lengthgen.train.tracking import Trackers


def step_line(entry: dict[str, Any], total: int, lr: float, eta_s: float) -> str:
    """``step 100/400  loss 1.234  lr 3.0e-03  18.2k tok/s  eta 0:41`` (a staged run's length is in the entry,
    ``metrics.jsonl``, not on the line)."""
    rate = entry["tokens_per_s"]
    speed = f"{rate / 1e6:.1f}M" if rate >= 1e6 else f"{rate / 1e3:.1f}k" if rate >= 1e3 else f"{rate:.0f}"
    minutes, seconds = divmod(round(eta_s), 60)
    eta = f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"
    return f"step {entry['step']}/{total}  loss {entry['loss']:.4g}  lr {lr:.1e}  {speed} tok/s  eta {eta}"


def eval_line(step: int, entry: dict[str, Any]) -> str:
    """``eval step 100: length 32 loss 0.41 abs_error 0.35 | length 128 ...``: each length's mean over all its
    positions [0, L) (``bema_eval`` on its own part)."""
    parts = []
    for kind, by_length in entry.items():
        label = "BEMA " if kind == "bema_eval" else ""
        parts += [f"{label}length {length} " + " ".join(f"{k} {v:.4g}" for k, v in values.items())
                  for length, values in by_length.items()]
    return f"eval step {step}: " + " | ".join(parts)


class RunLog:
    """The log of one training session of a run: `start` it with the header, log `step` and `evaluation`
    entries, `close` it at the end. Does nothing when not ``enabled`` (DDP ranks other than 0)."""

    def __init__(self, run_dir: Path, *, total: int, start: int, lr: float, enabled: bool = True,
                 progress: bool = True, name: str | None = None) -> None:
        self.run_dir, self.total, self.first, self.lr, self.enabled = Path(run_dir), total, start, lr, enabled
        self.path = self.run_dir / "metrics.jsonl"
        self.name = name or self.run_dir.name
        self.trackers: Trackers | None = None
        self.bar = None
        if enabled and progress and sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc=self.name, file=sys.stdout, dynamic_ncols=True)

    def start(self, header: str, trackers: Trackers) -> None:
        """Print the run's header; numbers go to ``trackers`` from now on."""
        self.trackers = trackers
        self.print(header)

    def print(self, line: str) -> None:
        """A line on the console (above the progress bar when there is one), flushed at once."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def step(self, entry: dict[str, Any], every: int, last: int) -> None:
        """After each step: advance the bar; every ``every`` steps (and the first and ``last``) write the
        entry and print its line when there is no bar."""
        if not self.enabled:
            return
        step = entry["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{entry['loss']:.4g}", tok_s=f"{entry['tokens_per_s']:.3g}")
        if step % every and step not in (self.first + 1, last):
            return
        self._write(entry)
        if self.bar is None:
            done = step - self.first
            eta = entry["time"] / max(done, 1) * (self.total - step)
            self.print(f"[{self.name}] " + step_line(entry, self.total, self.lr * entry["lr_mult"], eta))

    def evaluation(self, step: int, entry: dict[str, Any]) -> None:
        """An evaluation's entry (``eval``, ``bema_eval``: length -> metric -> mean) at ``step``."""
        if self.enabled and entry:
            self._write({"step": step, **entry})
            self.print(f"[{self.name}] " + eval_line(step, entry))

    def record(self, entry: dict[str, Any]) -> None:
        """An entry of its own in ``metrics.jsonl`` (e.g. a resume that extends ``train.steps``)."""
        if self.enabled:
            self._write(entry)

    def _write(self, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.trackers is not None:
            numbers = {k: v for k, v in _flatten(entry).items() if k != "step" and isinstance(v, (int, float))}
            self.trackers.log(numbers, entry["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.trackers is not None:
            self.trackers.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


__all__ = ["RunLog", "eval_line", "step_line"]
