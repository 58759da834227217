"""Max retrieval: output the value paired with the largest key.

Source: seed 003, "Post-Norm can Resharpen Attention" (arXiv 2510.08341; formal-language / retrieval suite).
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import chance_at, check_sample_args, masked_accuracy


class MaxRetrievalTask(Task):
    """``[PAD] k1 v1 k2 v2 ... kn vn QUERY`` with n = (L-1)//2 pairs; PAD only when L is even.

    Keys are distinct, drawn from ``0..num_keys-1``; values are uniform over ``num_values`` tokens
    (ids ``num_keys..num_keys+num_values-1``); QUERY and PAD follow. The only scored position is the
    last (QUERY), whose target is the value of the largest key; other targets are 0 (never scored).
    ``max_length = 2 * num_keys + 2``. ``extra`` is empty.
    """

    name = "max_retrieval"
    head = "lm"
    metric = "accuracy"
    higher_is_better = True
    min_length = 3

    def __init__(self, *, num_keys: int = 512, num_values: int = 16):
        self.num_keys = check_value(f"{self.name}.num_keys", num_keys, int, ge=1, le=MAX_SIZE)
        self.num_values = check_value(f"{self.name}.num_values", num_values, int, ge=2, le=MAX_SIZE)
        self.query = num_keys + num_values
        self.pad = self.query + 1
        self.vocab_size = self.pad + 1
        self.max_length = 2 * num_keys + 2

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        device = generator.device
        n = (length - 1) // 2
        keys = torch.rand(batch_size, self.num_keys, generator=generator, device=device).argsort(1)[:, :n]
        values = self.num_keys + torch.randint(self.num_values, (batch_size, n), generator=generator,
                                               device=device)
        answer = values.gather(1, keys.argmax(1, keepdim=True))[:, 0]
        pad = torch.full((batch_size, length - 1 - 2 * n), self.pad, dtype=torch.long, device=device)
        query = torch.full((batch_size, 1), self.query, dtype=torch.long, device=device)
        tokens = torch.cat([pad, torch.stack([keys, values], dim=2).flatten(1), query], dim=1)
        targets = torch.zeros_like(tokens)
        targets[:, -1] = answer
        loss_mask = torch.zeros_like(tokens, dtype=torch.bool)
        loss_mask[:, -1] = True
        return Batch(tokens, targets, loss_mask)

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``accuracy``: (B, L), argmax == answer at the query position, NaN elsewhere."""
        return {"accuracy": masked_accuracy(output, batch.targets, batch.loss_mask)}

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """At the query (last) position the answer is uniform over ``num_values`` values: ``accuracy``
        1 / num_values, ``loss`` log(num_values)."""
        chance = {"accuracy": 1 / self.num_values, "loss": math.log(self.num_values)}.get(metric)
        return None if chance is None else chance_at(length, chance, slice(length - 1, None))
