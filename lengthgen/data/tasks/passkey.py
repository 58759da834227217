"""Passkey retrieval: find a digit string hidden at a random depth in filler.

Source: Mohtashami & Jaggi 2023, "Landmark Attention: Random-Access Infinite Context Length for
Transformers" (passkey retrieval).
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import chance_at, check_needle, check_sample_args, masked_accuracy


class PasskeyTask(Task):
    """``filler.. NEEDLE d1..dk filler.. QUERY d1..d(k-1)``: the answer digits are the targets of the
    last k positions (QUERY predicts d1, d1 predicts d2, ...), the only scored positions.

    Token ids: digits ``0..9``, NEEDLE = 10, QUERY = 11, filler ``12..12+num_filler-1`` (uniform).
    The needle block (k+1 tokens) starts uniformly at random in the first L-k positions, anywhere it
    fits. Other targets are 0 (never scored). ``min_length = 2k + 1``.

    ``extra["needle_pos"]``: (B,) long, the position of NEEDLE. `at_depth` places it at a given depth;
    ``answer_tokens`` = k tokens make one answer.
    """

    name = "passkey"
    head = "lm"
    metric = "accuracy"
    higher_is_better = True
    max_length = None
    needle = 10
    query = 11

    def __init__(self, *, num_digits: int = 5, num_filler: int = 16):
        self.num_digits = check_value(f"{self.name}.num_digits", num_digits, int, ge=1, le=MAX_SIZE)
        self.num_filler = check_value(f"{self.name}.num_filler", num_filler, int, ge=1, le=MAX_SIZE)
        self.vocab_size = 12 + num_filler
        self.min_length = 2 * num_digits + 1
        self.answer_tokens = num_digits

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        tokens, digits = self._draw(batch_size, length, generator)
        needle_pos = torch.randint(length - 2 * self.num_digits, (batch_size,), generator=generator,
                                   device=generator.device)
        return self._place(tokens, digits, needle_pos)

    def at_depth(self, batch_size: int, length: int, depth: float, generator: torch.Generator,
                 needles: int = 1) -> Batch:
        """`sample`'s format with the needle at ``depth`` (retrieval maps): NEEDLE is preceded by exactly
        ``round(depth * F)`` (Python's round) of the F = L - 2k - 1 filler tokens, so depth 0 puts it first and
        depth 1 right before QUERY. The same generator draws the same filler and digits at every depth.
        ``extra["answer"]``: (B, L) long, 0 at the k answer positions (one answer), -1 elsewhere. One needle only:
        the query names no key, so several needles would be indistinguishable."""
        check_sample_args(self, batch_size, length, generator)
        check_needle(self, depth, needles, most=1)
        tokens, digits = self._draw(batch_size, length, generator)
        position = round(depth * (length - 2 * self.num_digits - 1))
        batch = self._place(tokens, digits, torch.full((batch_size,), position, device=generator.device))
        batch.extra["answer"] = torch.where(batch.loss_mask, 0, -1)
        return batch

    def _draw(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform filler (B, L) and answer digits (B, k)."""
        device = generator.device
        tokens = 12 + torch.randint(self.num_filler, (batch_size, length), generator=generator, device=device)
        return tokens, torch.randint(10, (batch_size, self.num_digits), generator=generator, device=device)

    def _place(self, tokens: torch.Tensor, digits: torch.Tensor, needle_pos: torch.Tensor) -> Batch:
        """Write NEEDLE + digits at ``needle_pos`` and QUERY + the first k-1 digits at the end."""
        batch_size, length = tokens.shape
        k = self.num_digits
        haystack = length - k
        marker = torch.full((batch_size, 1), self.needle, dtype=torch.long, device=tokens.device)
        tokens.scatter_(1, needle_pos[:, None] + torch.arange(k + 1, device=tokens.device),
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
