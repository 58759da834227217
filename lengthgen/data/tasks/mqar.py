"""Multi-query associative recall (MQAR).

Source: Zoology, Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models".
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import chance_at, check_needle, check_sample_args, masked_accuracy


class MQARTask(Task):
    """``k1 v1 ... kn vn q1 q2 ... qm`` with n = L//4 pairs and m = L - 2n queries.

    Keys are ids ``0..vocab_size//2 - 1`` (distinct within a sequence), values the rest of the
    vocabulary (uniform, may repeat). Each query is a key of the context, drawn uniformly with
    replacement; the target at a query is its value, and only query positions are scored (other
    targets are 0). ``max_length = 4 * (vocab_size // 2) + 3``. ``extra`` is empty. `at_depth` asks only about
    pairs placed at a given depth (retrieval maps); an answer is ``answer_tokens`` = 1 token.
    """

    name = "mqar"
    head = "lm"
    metric = "accuracy"
    higher_is_better = True
    min_length = 4

    def __init__(self, *, vocab_size: int = 256):
        self.vocab_size = check_value(f"{self.name}.vocab_size", vocab_size, int, ge=4, le=MAX_SIZE)
        self.num_keys = vocab_size // 2
        self.max_length = 4 * self.num_keys + 3
        self.answer_tokens = 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        keys, values = self._pairs(batch_size, length, generator)
        which = torch.randint(length // 4, (batch_size, length - 2 * (length // 4)), generator=generator,
                              device=generator.device)
        return self._queries(keys, values, which)

    def at_depth(self, batch_size: int, length: int, depth: float, generator: torch.Generator,
                 needles: int = 1) -> Batch:
        """`sample`'s format with the queries asking only about ``needles`` = K pairs that sit together at
        ``depth`` (retrieval maps): they fill pair slots p..p+K-1 with p = ``round(depth * (n - K))`` (Python's
        round), i.e. the first needle key is preceded by exactly p of the n - K other pairs (token 2p); query j
        asks needle j mod K. The same generator draws the same pairs at every depth. ``extra["needle_pos"]``:
        (B,) the first needle key's position; ``extra["answer"]``: (B, L) long, j at query j (each query is one
        answer), -1 elsewhere."""
        check_sample_args(self, batch_size, length, generator)
        n = length // 4
        check_needle(self, depth, needles, most=n)
        keys, values = self._pairs(batch_size, length, generator)
        p = round(depth * (n - needles))
        order = torch.cat([torch.arange(needles, needles + p), torch.arange(needles), torch.arange(needles + p, n)])
        queries = p + torch.arange(length - 2 * n) % needles
        batch = self._queries(keys[:, order], values[:, order], queries.expand(batch_size, -1).to(keys.device))
        answer = torch.arange(length, device=keys.device) - 2 * n
        batch.extra["answer"] = torch.where(batch.loss_mask, answer, -1)
        batch.extra["needle_pos"] = torch.full((batch_size,), 2 * p, device=keys.device)
        return batch

    def _pairs(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n = L//4 distinct keys and their values, (B, n) each."""
        device, n = generator.device, length // 4
        keys = torch.rand(batch_size, self.num_keys, generator=generator, device=device).argsort(1)[:, :n]
        values = torch.randint(self.num_keys, self.vocab_size, (batch_size, n), generator=generator, device=device)
        return keys, values

    def _queries(self, keys: torch.Tensor, values: torch.Tensor, which: torch.Tensor) -> Batch:
        """The pairs, then queries of the pairs ``which`` (B, m); only queries are scored."""
        n = keys.shape[1]
        tokens = torch.cat([torch.stack([keys, values], dim=2).flatten(1), keys.gather(1, which)], dim=1)
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
