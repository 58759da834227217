"""Counting: regress the running count of a target symbol.

Source: seed 001, "Attention Normalizes the Wrong Norm" (two models that differ only in the softmax
norm, trained to count occurrences of a target token).
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import check_sample_args


class CountingTask(Task):
    """Position 0 holds the target symbol, positions 1.. are uniform over ``vocab_size`` symbols.

    The label at position t is the number of occurrences of the target symbol in positions 1..t
    (0 at position 0); every position counts in the loss. ``extra`` is empty.
    """

    name = "counting"
    head = "regress"
    metric = "abs_error"
    also_reported = {"sq_error": False, "rel_error": False}
    min_length = 1
    higher_is_better = False
    max_length = None

    def __init__(self, *, vocab_size: int = 32):
        self.vocab_size = check_value(f"{self.name}.vocab_size", vocab_size, int, ge=2, le=MAX_SIZE)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
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

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """The count at position t is Binomial(t, q), q = 1/V. ``abs_error`` (and ``loss``, the same L1 error): the
        best guess from the position alone is its median, with expected error E|X - median X|; ``sq_error``: its
        mean tq, with expected error the variance t q (1 - q)."""
        q = 1 / self.vocab_size
        if metric == "sq_error":
            return torch.arange(length, dtype=torch.float64) * q * (1 - q)
        return binomial_median_error(length, q) if metric in ("abs_error", "loss") else None


def binomial_median_error(length: int, q: float) -> torch.Tensor:
    """(length,) float64: E|X_n - median X_n| for X_n ~ Binomial(n, q), n = 0..length-1 (0 < q < 1).

    A median is floor(nq) or ceil(nq) (Kaas and Buhrman 1980) and minimizes E|X - c|, which between the
    integers f = floor(nq) and f + 1 is linear in c with slope 2F - 1, F = P(X <= f). So the error is the mean
    absolute deviation E|X - nq| = 2 (1 - q) (f + 1) P(X = f + 1) (de Moivre) plus the smaller of
    (c - nq)(2F - 1) for c = f, f + 1; F follows n by P(X_{n+1} <= f) = P(X_n <= f) - q P(X_n = f), plus
    P(X_{n+1} = f + 1) when floor(nq) moves up."""
    n = torch.arange(length + 1, dtype=torch.float64)
    f = torch.floor(n * q)

    def pmf(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        log = (torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma((n - k).clamp(min=0) + 1)
               + k * math.log(q) + (n - k) * math.log1p(-q))
        return torch.where(k <= n, log.exp(), 0.0)

    step = -q * pmf(n[:-1], f[:-1]) + (f[1:] - f[:-1]) * pmf(n[1:], f[1:])
    cdf = torch.cat([torch.ones(1, dtype=torch.float64), 1 + step.cumsum(0)])[:-1]   # P(X_n <= f_n)
    n, f = n[:-1], f[:-1]
    slope, mean = 2 * cdf - 1, n * q
    deviation = 2 * (1 - q) * (f + 1) * pmf(n, f + 1)
    return deviation + torch.minimum((f - mean) * slope, (f + 1 - mean) * slope)
