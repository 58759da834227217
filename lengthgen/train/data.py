"""Training data sources and per-step seeding.

A *data source* is anything shaped like a `lengthgen.data.tasks.Task`: ``sample(batch_size, length,
generator) -> Batch`` plus ``vocab_size``, ``head`` (lm | regress | classify), ``num_classes`` and optionally
``max_length`` and ``metrics(output, batch)``. ``data.kind`` picks the factory in `SOURCES`:

* ``task``: ``lengthgen.data.tasks.make_task(data.task, **data.task_kwargs)``;
* ``text``: the text-corpus module's ``lengthgen.data.text.make_source(**data.text)``, which must return such
  an object (an ``lm`` source). This is the hook for the text module; it is not implemented here.

Data does not depend on history: the batch of step ``s`` is drawn from a generator seeded with
``step_seed(seed, s)``, so a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lengthgen.data.tasks.base import Batch


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A 63-bit seed for (run seed, step, stream) via numpy's SeedSequence (stream 0: training, 1: eval)."""
    return int(np.random.SeedSequence([seed, stream, step]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(seed, step, stream))


def _task_source(data) -> Any:
    from lengthgen.data.tasks import make_task

    return make_task(data.task, **data.task_kwargs)


def _text_source(data) -> Any:
    try:
        from lengthgen.data import text
    except ImportError as err:
        raise ValueError(f"data.kind='text' needs the text data module lengthgen.data.text ({err})") from None
    return text.make_text_data(**data.text)


SOURCES: dict[str, Callable[[Any], Any]] = {"task": _task_source, "text": _text_source}


def make_source(data) -> Any:
    """The data source of a `DataConfig` (ValueError naming the key for a bad task name or kwarg)."""
    from lengthgen.config import ConfigError

    try:
        return SOURCES[data.kind](data)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        key = "data.task" if data.kind == "task" else "data.text"
        raise ConfigError(f"{key}: {err}") from None


def split_batch(batch: Batch, parts: int) -> list[tuple[Batch, float]]:
    """Split along the batch axis into ``parts`` micro-batches, each with its share of the sequences."""
    total = batch.tokens.shape[0]
    parts = max(1, min(parts, total))
    out = []
    for idx in torch.arange(total).tensor_split(parts):
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        out.append((batch.rows(lo, hi), (hi - lo) / total))
    return out
