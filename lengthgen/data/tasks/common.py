"""Helpers shared by the synthetic tasks: sample-argument checks (also of a needle's depth and count), masked
per-position accuracy and chance levels at the scored positions."""

from __future__ import annotations

import math

import torch

from lengthgen.config import ConfigError, check_value
from lengthgen.data.tasks.base import Task, check_generator


def check_sample_args(task: Task, batch_size: int, length: int, generator: torch.Generator) -> None:
    """Raise a ValueError naming the task, the bad value and the limit for a request outside
    ``task.min_length..task.max_length``, a non-positive batch size or a generator that is not one."""
    check_value(f"{task.name}.batch_size", batch_size, int, ge=1)
    check_generator(f"{task.name}.generator", generator)
    check_value(f"{task.name}.length", length, int)
    if length < task.min_length:
        raise ValueError(f"task {task.name!r}: length {length} is below the minimum length {task.min_length}")
    if task.max_length is not None and length > task.max_length:
        raise ValueError(f"task {task.name!r}: length {length} exceeds the maximum length {task.max_length}")


def check_needle(task: Task, depth: float, needles: int, most: int) -> None:
    """Raise a ValueError naming the task and the bad value for a depth outside [0, 1], and a `ConfigError` keyed
    ``needles`` for a needle count outside 1..``most`` (a request, not a length, is at fault)."""
    check_value(f"{task.name}.depth", depth, float, ge=0, le=1)
    check_value(f"{task.name}.needles", needles, int, ge=1)
    if needles > most:
        raise ConfigError(f"needles={needles} is not valid; task {task.name!r} holds at most {most}"
                          + (" (its query names no key)" if most == 1 else ""), "needles")


def masked_accuracy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L) float: 1.0 where argmax(logits) == targets, 0.0 where not, NaN outside ``mask``."""
    correct = (logits.argmax(-1) == targets).float()
    return torch.where(mask, correct, torch.full_like(correct, float("nan")))


def chance_at(length: int, value: float, scored: slice = slice(None)) -> torch.Tensor:
    """(length,) float64 chance levels: ``value`` at the ``scored`` positions, NaN elsewhere."""
    out = torch.full((length,), math.nan, dtype=torch.float64)
    out[scored] = value
    return out
