"""Counting: regress the running count of a target symbol.

Source: seed 001, "Attention Normalizes the Wrong Norm" (two models that differ only in the softmax
norm, trained to count occurrences of a target token).
"""

from __future__ import annotations

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import check_value
from lengthgen.data.tasks.common import check_sample_args


class CountingTask(Task):
    """Position 0 holds the target symbol, positions 1.. are uniform over ``vocab_size`` symbols.

    The label at position t is the number of occurrences of the target symbol in positions 1..t
    (0 at position 0); every position counts in the loss. ``extra`` is empty.
    """

    name = "counting"
    head = "regress"
    metric = "abs_error"
    min_length = 1
    higher_is_better = False
    max_length = None

    def __init__(self, *, vocab_size: int = 32):
        self.vocab_size = check_value(f"{self.name}.vocab_size", vocab_size, int, ge=2)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length)
        tokens = torch.randint(self.vocab_size, (batch_size, length), generator=generator,
                               device=generator.device)
        hits = (tokens == tokens[:, :1]).float()
        hits[:, 0] = 0.0                                   # position 0 holds the target itself
        return Batch(tokens, hits.cumsum(1), torch.ones_like(tokens, dtype=torch.bool))

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``abs_error`` = |pred - count|, ``sq_error`` = (pred - count)^2 (its prefix means are seed 001's MSE)
        and ``rel_error`` = |pred - count| / max(count, 1), (B, L)."""
        error = output.float() - batch.targets
        return {"abs_error": error.abs(), "sq_error": error.square(),
                "rel_error": error.abs() / batch.targets.clamp(min=1.0)}
