"""Set complement: predict the uniform distribution over the tokens not seen yet.

Source: seed 003, "Post-Norm can Resharpen Attention" (arXiv 2510.08341; Set Complement Task).
"""

from __future__ import annotations

import math

import torch

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import check_sample_args


class SetComplementTask(Task):
    """BOS followed by distinct tokens (a prefix of a random permutation of ``num_tokens`` tokens).

    Token ids: ``0..num_tokens-1``, BOS = ``num_tokens``; ``vocab_size = num_tokens + 1``. The target
    at every position is the next token of the permutation, so the true next-token distribution is
    uniform over the tokens not in the input so far. A length-L sequence holds BOS and L-1 tokens,
    hence ``max_length = num_tokens``.

    ``extra["first_pos"]``: (B, num_tokens) long, the position at which each token enters the input
    (>= L for tokens that never do); token x is unseen at position t iff ``first_pos[x] > t``.
    """

    name = "set_complement"
    head = "lm"
    metric = "tvd"
    min_length = 1
    higher_is_better = False

    def __init__(self, *, num_tokens: int = 64):
        self.num_tokens = check_value(f"{self.name}.num_tokens", num_tokens, int, ge=2, le=MAX_SIZE)
        self.bos = num_tokens
        self.vocab_size = num_tokens + 1
        self.max_length = num_tokens

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        device = generator.device
        perm = torch.rand(batch_size, self.num_tokens, generator=generator, device=device).argsort(1)
        bos = torch.full((batch_size, 1), self.bos, dtype=torch.long, device=device)
        tokens = torch.cat([bos, perm[:, :length - 1]], dim=1)
        positions = torch.arange(1, self.num_tokens + 1, device=device).expand(batch_size, -1)
        first_pos = torch.empty_like(perm).scatter_(1, perm, positions)
        return Batch(tokens, perm[:, :length].clone(), torch.ones_like(tokens, dtype=torch.bool),
                     extra={"first_pos": first_pos})

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """``tvd``: (B, L) total variation distance between softmax over the whole vocabulary (mass
        on BOS counts as error) and the uniform distribution over unseen tokens; NaN where none is
        left."""
        probs = output.float().softmax(-1)
        positions = batch.start + torch.arange(output.shape[1], device=output.device)
        unseen = batch.extra["first_pos"][:, None, :] > positions[None, :, None]      # (B, L, v)
        n_unseen = unseen.sum(-1, keepdim=True)
        uniform = unseen.float() / n_unseen.clamp(min=1)
        tvd = 0.5 * ((probs[..., :self.num_tokens] - uniform).abs().sum(-1)
                     + probs[..., self.num_tokens:].sum(-1))
        return {"tvd": torch.where(n_unseen[..., 0] > 0, tvd, torch.full_like(tvd, float("nan")))}

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """Position p has seen p of the N tokens. The best guess that ignores which: uniform over the N
        tokens (symmetric, and mass on BOS only adds error), whose ``tvd`` to uniform over the N - p unseen
        is p / N exactly; the next token is uniform over all N tokens, so ``loss`` is log N."""
        positions = torch.arange(length, dtype=torch.float64)
        if metric == "tvd":
            return positions / self.num_tokens
        return torch.full_like(positions, math.log(self.num_tokens)) if metric == "loss" else None
