"""Bounded-depth Dyck: next-token prediction on random legal bracket prefixes.

Source: seed 003, "Post-Norm can Resharpen Attention" (arXiv 2510.08341; formal-language suite).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lengthgen.data.tasks.base import Batch, Task
from lengthgen.config import MAX_SIZE, check_value
from lengthgen.data.tasks.common import check_sample_args


class DyckTask(Task):
    """``BOS`` followed by a random legal Dyck-(k, m) prefix of any length.

    Token ids: openers ``0..k-1``, closers ``k..2k-1`` (closer ``k+i`` matches opener ``i``), BOS =
    ``2k``. The depth performs a random walk on [0, m]: it opens or closes with probability 1/2 and is
    forced to open at 0 and to close at m (sampled exactly, without a loop, by folding a free +-1
    walk with period 2m); opener types are uniform and closers match the top of the stack. Targets
    are the next token at every position.

    ``extra["legal"]``: (B, L, vocab_size) bool, the legal next tokens after each prefix: every
    opener if depth < m, the closer matching the top of the stack if depth > 0. With these the law
    of the next token is known exactly (`next_token_law`), and the headline metric is the total
    variation distance of the model's prediction to it, seed 003's metric of distribution quality.
    """

    name = "dyck"
    head = "lm"
    metric = "tvd"
    also_reported = {"legal_accuracy": True}
    min_length = 1
    higher_is_better = False
    max_length = None

    def __init__(self, *, num_types: int = 2, max_depth: int = 8):
        self.num_types = check_value(f"{self.name}.num_types", num_types, int, ge=1, le=MAX_SIZE)
        self.max_depth = check_value(f"{self.name}.max_depth", max_depth, int, ge=1, le=MAX_SIZE)
        self.bos = 2 * num_types
        self.vocab_size = 2 * num_types + 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        device = generator.device
        k, m = self.num_types, self.max_depth
        # Index j = number of brackets read (0..length); bracket j is read between states j-1 and j.
        steps = torch.randint(2, (batch_size, length), generator=generator, device=device) * 2 - 1
        walk = torch.cat([torch.zeros_like(steps[:, :1]), steps.cumsum(1)], dim=1) % (2 * m)
        depth = torch.where(walk <= m, walk, 2 * m - walk)                          # (B, L+1)
        opens = torch.zeros_like(depth, dtype=torch.bool)
        opens[:, 1:] = depth[:, 1:] > depth[:, :-1]
        types = torch.randint(k, depth.shape, generator=generator, device=device)
        # The top of the stack after j brackets is the last opener at level depth[j] up to j.
        index = torch.arange(length + 1, device=device).expand_as(depth)
        top_index = torch.zeros_like(depth)
        for level in range(1, min(m, length) + 1):      # a prefix of L brackets is at most L deep
            last_open = torch.where(opens & (depth == level), index, -1).cummax(1).values
            top_index = torch.where(depth == level, last_open, top_index)
        top_type = types.gather(1, top_index)                        # meaningless where depth == 0
        brackets = torch.where(opens, types, k + top_type.roll(1, dims=1))[:, 1:]   # (B, L)
        bos = torch.full((batch_size, 1), self.bos, dtype=torch.long, device=device)
        tokens = torch.cat([bos, brackets[:, :-1]], dim=1)
        state_depth, state_top = depth[:, :-1], top_type[:, :-1]
        vocab = torch.arange(self.vocab_size, device=device)
        legal = (((vocab < k) & (state_depth[..., None] < m))
                 | ((vocab == k + state_top[..., None]) & (state_depth[..., None] > 0)))
        return Batch(tokens, brackets, torch.ones_like(tokens, dtype=torch.bool),
                     extra={"legal": legal}, position_extras=("legal",))

    def next_token_law(self, legal: torch.Tensor) -> torch.Tensor:
        """(..., vocab_size) float: the sampler's law of the next token given its legal set (``legal``, the
        ``extra["legal"]`` mask): at depth 0 each opener 1/k, at depth m the matching closer 1, in between the
        matching closer 1/2 and each opener 1/(2k)."""
        legal = legal.float()
        k = self.num_types
        openers, closer = legal[..., :k].sum(-1, keepdim=True), legal[..., k:].sum(-1, keepdim=True)
        p_close = torch.where(openers == 0, 1.0, closer / 2)
        is_opener = torch.arange(legal.shape[-1], device=legal.device) < k
        return legal * torch.where(is_opener, (1 - p_close) / openers.clamp(min=1), p_close)

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Per position (B, L): ``tvd``, the total variation distance between the softmax over the whole
        vocabulary and the next token's law (`next_token_law`; mass on BOS, or on ids beyond the task's of a model
        with a larger vocabulary, counts as error); ``legal_accuracy``, whether the argmax prediction is a legal
        next token."""
        legal = F.pad(batch.extra["legal"], (0, output.shape[-1] - self.vocab_size))   # extra ids: never legal
        probs = output.float().softmax(-1)
        tvd = 0.5 * (probs - self.next_token_law(legal)).abs().sum(-1)
        return {"tvd": tvd, "legal_accuracy": legal.gather(-1, output.argmax(-1, keepdim=True))[..., 0].float()}

    def chance(self, metric: str, length: int) -> torch.Tensor | None:
        """From the law of the depth d at each position (`depth_law`; opener types and the stack top are
        uniform over the k types, independent of d):

        - ``legal_accuracy`` of the best fixed guess is max(P(d < m), P(d > 0) / k) (always an opener, or
          always one closer);
        - ``loss`` is the entropy of the next bracket, H(P(open)) + log k with P(open) = P(d = 0) + P(0 < d <
          m) / 2;
        - ``tvd`` of the best fixed distribution: by symmetry and convexity one that puts a / k on each opener
          and (1 - a) / k on each closer, whose expected tvd (1 - sum of min(p, q)) is P(d = 0) (1 - a) +
          P(d = m) (1 - (1 - a) / k) + P(0 < d < m) (1 - min(1/2, a) - min(1/2, (1 - a) / k)); it is
          piecewise linear in a, so its minimum is at a break point: a in {0, 1/2, 1, 1 - k/2}.
        """
        if metric not in ("legal_accuracy", "loss", "tvd"):
            return None
        law = self.depth_law(length)
        empty = law[:, 0]
        full = law[:, -1] if law.shape[1] == self.max_depth + 1 else torch.zeros_like(empty)   # m never reached
        middle, k = 1 - empty - full, self.num_types
        if metric == "legal_accuracy":
            return torch.maximum(1 - full, (1 - empty) / k)
        if metric == "tvd":
            a = torch.tensor([0.0, 0.5, 1.0, 1 - k / 2], dtype=torch.float64).clamp(0, 1)[:, None]
            half = torch.tensor(0.5, dtype=torch.float64)
            tvd = (empty * (1 - a) + full * (1 - (1 - a) / k)
                   + middle * (1 - torch.minimum(half, a) - torch.minimum(half, (1 - a) / k)))
            return tvd.min(0).values
        opens = empty + middle / 2
        return torch.special.entr(opens) + torch.special.entr(1 - opens) + math.log(k)

    def depth_law(self, length: int) -> torch.Tensor:
        """(length, min(m, length) + 1) float64: P(depth = d) at each position (after that many brackets), for d
        up to m, or up to the length when m is larger (fewer than L brackets are never L deep, so the bound then
        changes nothing). The sampler's free +-1 walk modulo 2m is propagated exactly, then folded; once it
        repeats with period 2 (the walk is periodic) to 1e-16 the rest is filled in by that period."""
        m = min(self.max_depth, length)
        walk = torch.zeros(2 * m, dtype=torch.float64)
        walk[0] = 1.0
        rows: list[torch.Tensor] = []
        while len(rows) < length:
            if len(rows) >= 2 and (walk - rows[-2]).abs().max() < 1e-16:
                rows += [rows[-2], rows[-1]] * ((length - len(rows)) // 2 + 1)
                break
            rows.append(walk)
            walk = (walk.roll(1) + walk.roll(-1)) / 2
        residue = torch.arange(2 * m)
        fold = torch.where(residue <= m, residue, 2 * m - residue)
        return torch.zeros(length, m + 1, dtype=torch.float64).index_add_(1, fold, torch.stack(rows[:length]))
