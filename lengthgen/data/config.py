"""`DataConfig` (what a run trains on), its data sources, and per-step seeding.

A *data source* is anything shaped like a `lengthgen.data.tasks.Task`: ``sample(batch_size, length,
generator) -> Batch`` plus ``vocab_size``, ``head`` (lm | regress | classify), ``num_classes`` and optionally
``max_length`` and ``metrics(output, batch)``. ``data.kind`` picks the factory in `SOURCES`:

* ``task``: ``make_task(data.task, **data.task_kwargs)``, a built-in task or a researcher's own `Task` subclass
  named ``"package.module:Class"`` (`lengthgen.data.tasks.task_class`);
* ``text``: ``lengthgen.data.text.make_text_data(**data.text)`` (an ``lm`` source).

Data does not depend on history: the batch of step ``s`` is drawn from a generator seeded with
``step_seed(seed, s)``, so a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lengthgen.config import MAX_SIZE, ConfigError, check, documented, option, raised_in_user_code
from lengthgen.data.tasks import TASK_CHOICES, make_task, task_class

DataKind = Literal["task", "text"]


def _task(name: str) -> str:
    """``name`` if `task_class` resolves it (a built-in task or ``module:Class``), else its `ConfigError`."""
    task_class(name)
    return name


@documented
@dataclass
class DataConfig:
    """What the model trains on: a synthetic task or a text corpus, at a training length."""

    kind: DataKind = option("task", "task (a synthetic task) or text (a text corpus)")
    task: str = option("counting", f"the synthetic task (kind = task): {TASK_CHOICES}", parse=_task)
    task_kwargs: dict[str, Any] = option({}, "the task's arguments, e.g. {vocab_size = 8}")
    length: int = option(64, "training length (before any train.stages)", ge=1, le=MAX_SIZE)
    text: dict[str, Any] = option({}, "make_text_data's arguments (kind = text): corpus, tokenizer, split, ...")

    def __post_init__(self) -> None:
        check(self)


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A 63-bit seed for (run seed, step, stream) via numpy's SeedSequence (stream 0: training, 1: eval)."""
    return int(np.random.SeedSequence([seed, stream, step]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(seed, step, stream))


def _task_source(data: DataConfig) -> Any:
    return make_task(data.task, **data.task_kwargs)


def _text_source(data: DataConfig) -> Any:
    from lengthgen.data.text import make_text_data  # imports the tokenizers only when text is used

    return make_text_data(**data.text)


SOURCES: dict[str, Callable[[DataConfig], Any]] = {"task": _task_source, "text": _text_source}


def make_source(data: DataConfig) -> Any:
    """The data source of a `DataConfig`; a `ConfigError` naming the key (``data.task_kwargs.vocab_size``) for
    a bad argument, a file it names that is not there, or arguments of the other kind (``data.text`` of a
    task), which would be ignored."""
    key, other = ("data.task_kwargs", "text") if data.kind == "task" else ("data.text", "task_kwargs")
    if getattr(data, other):
        raise ConfigError(f"data.{other} is set, but data.kind={data.kind!r} does not read it: set data.kind="
                          f"{other.removesuffix('_kwargs')} or data.{other}={{}}", f"data.{other}")
    try:
        return SOURCES[data.kind](data)
    except ConfigError as err:
        raise err.under(key) from None
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise ConfigError(f"{key}: {err}{raised_in_user_code(err)}", key) from None


__all__ = ["DataConfig", "SOURCES", "make_source", "step_generator", "step_seed"]
