"""Multi-query associative recall (MQAR).

Source: Zoology, Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models".
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import check_value
from lengthgen.data.tasks.common import chance_at, check_sample_args, masked_accuracy


class MQARTask(Task):
    """``k1 v1 ... kn vn q1 q2 ... qm`` with n = L//4 pairs and m = L - 2n queries.

    Keys are ids ``0..vocab_size//2 - 1`` (distinct within a sequence), values the rest of the
    vocabulary (uniform, may repeat). Each query is a key of the context, drawn uniformly with
    replacement; the target at a query is its value, and only query positions are scored (other
    targets are 0). ``max_length = 4 * (vocab_size // 2) + 3``. ``extra`` is empty.
    """

    name = "mqar"
    head = "lm"
    metric = "accuracy"
    higher_is_better = True
    min_length = 4

    def __init__(self, *, vocab_size: int = 256):
        self.vocab_size = check_value(f"{self.name}.vocab_size", vocab_size, int, ge=4)
        self.num_keys = vocab_size // 2
        self.max_length = 4 * self.num_keys + 3

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length)
        device = generator.device
        n = length // 4
        m = length - 2 * n
        keys = torch.rand(batch_size, self.num_keys, generator=generator, device=device).argsort(1)[:, :n]
        values = torch.randint(self.num_keys, self.vocab_size, (batch_size, n), generator=generator,
                               device=device)
        which = torch.randint(n, (batch_size, m), generator=generator, device=device)
        queries = keys.gather(1, which)
        tokens = torch.cat([torch.stack([keys, values], dim=2).flatten(1), queries], dim=1)
        targets = torch.cat([torch.zeros_like(keys.repeat(1, 2)), values.gather(1, which)], dim=1)
        loss_mask = torch.zeros_like(tokens, dtype=torch.bool)
        loss_mask[:, 2 * n:] = True
        return Batch(tokens, targets, loss_mask)

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``accuracy``: (B, L), argmax == value at query positions, NaN elsewhere."""
        return {"accuracy": masked_accuracy(output, batch.targets, batch.loss_mask)}

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """At the query positions ``[2 (L//4), L)`` the answer is uniform over the ``vocab_size - vocab_size//2``
        values whatever the position: ``accuracy`` 1 / that number, ``loss`` its log."""
        values = self.vocab_size - self.num_keys
        chance = {"accuracy": 1 / values, "loss": math.log(values)}.get(metric)
        return None if chance is None else chance_at(length, chance, slice(2 * (length // 4), None))
