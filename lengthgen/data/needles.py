"""Needle sources for retrieval maps: a data source with its needle(s) at one depth of the context.

`needle_source(source, depth, needles)` wraps a retrieval task (one with ``at_depth``: passkey, mqar) as a
`TaskNeedles`, or text data as `lengthgen.data.text.needle.TextNeedles`. Either samples batches whose
``loss_mask`` marks the answer tokens and whose ``extra["answer"]`` (B, L) numbers each answer within its row (-1
at other positions), so a scorer can tell answers apart; every row holds the same number of answers.
"""

from __future__ import annotations

from typing import Any

import torch

from lengthgen.config import ConfigError
from lengthgen.data.tasks.base import Batch, Task

#: a map's values (see `lengthgen.eval.needle.answer_scores`)
VALUES = ("exact_match", "token_accuracy", "answer_loss")


class TaskNeedles:
    """``task.at_depth(count, length, depth, generator, needles)`` as a source for the evaluator.

    Chance levels (`chance`) come from the task's own (`lengthgen.data.tasks.Task.chance`) at its scored
    positions: ``token_accuracy`` is the task metric's, ``answer_loss`` the loss's and ``exact_match`` the token
    accuracy's power ``task.answer_tokens`` (the answer tokens of passkey and MQAR are independent and uniform).
    """

    def __init__(self, task: Task, depth: float, needles: int = 1) -> None:
        self.task, self.depth, self.needles = task, depth, needles
        for name in ("name", "head", "vocab_size", "max_length", "min_length"):
            setattr(self, name, getattr(task, name))

    def sample(self, count: int, length: int, generator: torch.Generator) -> Batch:
        return self.task.at_depth(count, length, self.depth, generator, needles=self.needles)

    def chance(self, metric: str, length: int) -> float | None:
        name = {"exact_match": self.task.metric, "token_accuracy": self.task.metric, "answer_loss": "loss"}.get(metric)
        level = None if name is None else self.task.chance(name, length)
        if level is None:
            return None
        level = float(torch.as_tensor(level).nanmean())
        return level ** self.task.answer_tokens if metric == "exact_match" else level


def needle_source(source: Any, depth: float, needles: int = 1) -> Any:
    """``source`` (a task or text data) with ``needles`` needle(s) at ``depth``; a `ConfigError` for a source
    without needles."""
    from lengthgen.data.text.needle import TextNeedles
    from lengthgen.data.text.packing import TextData

    if hasattr(source, "at_depth"):
        return TaskNeedles(source, depth, needles)
    if isinstance(source, TextData):
        return TextNeedles(source, depth, needles)
    raise ConfigError(f"{getattr(source, 'name', source)!r} has no needles to retrieve; retrieval maps need a "
                      "retrieval task (passkey, mqar) or text data")


__all__ = ["TaskNeedles", "VALUES", "needle_source"]
