"""Passkey retrieval: find a digit string hidden at a random depth in filler.

Source: Mohtashami & Jaggi 2023, "Landmark Attention: Random-Access Infinite Context Length for
Transformers" (passkey retrieval).
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import check_value
from lengthgen.data.tasks.common import chance_at, check_sample_args, masked_accuracy


class PasskeyTask(Task):
    """``filler.. NEEDLE d1..dk filler.. QUERY d1..d(k-1)``: the answer digits are the targets of the
    last k positions (QUERY predicts d1, d1 predicts d2, ...), the only scored positions.

    Token ids: digits ``0..9``, NEEDLE = 10, QUERY = 11, filler ``12..12+num_filler-1`` (uniform).
    The needle block (k+1 tokens) starts uniformly at random in the first L-k positions, anywhere it
    fits. Other targets are 0 (never scored). ``min_length = 2k + 1``.

    ``extra["needle_pos"]``: (B,) long, the position of NEEDLE (for accuracy-versus-depth plots).
    """

    name = "passkey"
    head = "lm"
    metric = "accuracy"
    higher_is_better = True
    max_length = None
    needle = 10
    query = 11

    def __init__(self, *, num_digits: int = 5, num_filler: int = 16):
        self.num_digits = check_value(f"{self.name}.num_digits", num_digits, int, ge=1)
        self.num_filler = check_value(f"{self.name}.num_filler", num_filler, int, ge=1)
        self.vocab_size = 12 + num_filler
        self.min_length = 2 * num_digits + 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length)
        device = generator.device
        k = self.num_digits
        haystack = length - k
        tokens = 12 + torch.randint(self.num_filler, (batch_size, length), generator=generator,
                                    device=device)
        digits = torch.randint(10, (batch_size, k), generator=generator, device=device)
        needle_pos = torch.randint(haystack - k, (batch_size,), generator=generator, device=device)
        marker = torch.full((batch_size, 1), self.needle, dtype=torch.long, device=device)
        tokens.scatter_(1, needle_pos[:, None] + torch.arange(k + 1, device=device),
                        torch.cat([marker, digits], dim=1))
        tokens[:, haystack] = self.query
        tokens[:, haystack + 1:] = digits[:, :-1]
        targets = torch.zeros_like(tokens)
        targets[:, haystack:] = digits
        loss_mask = torch.zeros_like(tokens, dtype=torch.bool)
        loss_mask[:, haystack:] = True
        return Batch(tokens, targets, loss_mask, extra={"needle_pos": needle_pos})

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``accuracy``: (B, L), argmax == answer digit at the last k positions, NaN elsewhere."""
        return {"accuracy": masked_accuracy(output, batch.targets, batch.loss_mask)}

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """At the last k positions the answer digit is uniform over 10 whatever the position: ``accuracy``
        1/10, ``loss`` log 10."""
        chance = {"accuracy": 0.1, "loss": math.log(10)}.get(metric)
        return None if chance is None else chance_at(length, chance, slice(length - self.num_digits, None))
