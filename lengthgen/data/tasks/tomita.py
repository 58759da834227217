"""Tomita grammars 1-7: classify binary strings as accepted or rejected.

Source: seed 003, "Post-Norm can Resharpen Attention" (arXiv 2510.08341; formal-language suite); the grammars
are Tomita (1982), "Dynamic construction of finite automata from examples using hill-climbing".
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch

from lengthgen.config import check_value, counted
from lengthgen.data.tasks.base import Batch, Task
from lengthgen.data.tasks.common import check_sample_args

# Minimal DFAs over {0, 1}: transitions[state] = (next on 0, next on 1), start state 0.
_DFAS: dict[int, tuple[list[tuple[int, int]], list[bool]]] = {
    # 1: 1*.  0 ok, 1 dead.
    1: ([(1, 0), (1, 1)], [True, False]),
    # 2: (10)*.  0 expecting 1 (accepting), 1 expecting 0, 2 dead.
    2: ([(2, 1), (0, 2), (2, 2)], [True, False, False]),
    # 3: no odd run of 1s followed, anywhere later, by an odd run of 0s (runs maximal), as Tomita's own examples
    #    read it (0111001101 and 11011100110 are among his rejected strings).
    #    0 clean / even 1-run, 1 odd 1-run, 2 odd 0-run after an odd 1-run, 3 even 0-run or 1s after one, 4 dead.
    3: ([(0, 1), (2, 0), (3, 4), (2, 3), (4, 4)], [True, True, False, True, False]),
    # 4: no 000.  State = trailing zeros (0..2), 3 dead.
    4: ([(1, 0), (2, 0), (3, 0), (3, 3)], [True, True, True, False]),
    # 5: even #0 and even #1.  State = 2 * (#0 % 2) + (#1 % 2).
    5: ([(2, 1), (3, 0), (0, 3), (1, 2)], [True, False, False, False]),
    # 6: (#0 - #1) % 3 == 0.  State = (#0 - #1) % 3.
    6: ([(1, 2), (2, 0), (0, 1)], [True, False, False]),
    # 7: 0*1*0*1*.  State = block reached (0..3), 4 dead.
    7: ([(0, 1), (2, 1), (2, 3), (4, 3), (4, 4)], [True, True, True, True, False]),
}


_LOG_COUNTS: dict[int, torch.Tensor] = {}


def _log_counts(grammar: int, n: int) -> torch.Tensor:
    """(2, >= n+1, Q) float64, cached per grammar: log of the number of strings of length r that
    lead from each state to a rejecting (index 0) or accepting (index 1) state."""
    table = _LOG_COUNTS.get(grammar)
    if table is None or table.shape[1] <= n:
        transitions, accepting = (torch.tensor(x) for x in _DFAS[grammar])
        table = torch.empty(2, max(2 * n, 16) + 1, len(accepting), dtype=torch.float64)
        table[:, 0] = torch.stack([~accepting, accepting]).double().log()
        for r in range(1, table.shape[1]):
            previous = table[:, r - 1]
            table[:, r] = torch.logaddexp(previous[:, transitions[:, 0]], previous[:, transitions[:, 1]])
        _LOG_COUNTS[grammar] = table
    return table


def _compose(maps: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Prefix compositions of state maps by a log-depth scan. ``maps`` (R, n, Q): step i sends state
    q to ``maps[:, i, q]``. Returns ``out[:, i] = map_i o ... o map_0`` (map_0 applied first), or with
    ``reverse`` ``map_0 o ... o map_i`` (map_i applied first)."""
    out, span = maps.clone(), 1
    while span < out.shape[1]:
        earlier, later = out[:, :-span], out[:, span:]
        out[:, span:] = earlier.gather(2, later) if reverse else later.gather(2, earlier)
        span *= 2
    return out


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based ROC AUC (Mann-Whitney U) of ``scores`` for binary ``labels``; tied scores get
    their average rank. NaN when only one class is present or a score is NaN (a diverged model)."""
    scores, labels = scores.flatten().double(), labels.flatten().bool()
    if scores.isnan().any():
        return float("nan")
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class TomitaTask(Task):
    """``BOS [PAD] s1..sn`` with the string ending at the last position; label 1 = accepted.

    Token ids: 0, 1, BOS = 2, PAD = 3. n = L-1 unless no string of that length has both labels
    (e.g. grammars 2 and 5 at odd n), then n = L-2 and one PAD follows BOS, for every sequence.
    Labels are balanced in every batch: half its strings, in random order, are positives (for an odd batch one
    more or one fewer, at random), so that a batch of two or more holds both classes (its ROC AUC is defined)
    and a constant guess scores 1/2. Positives are uniform over accepted strings of length n (sampled exactly
    by counting paths in the DFA); a fraction ``near_miss`` of the negatives are a positive with one
    symbol flipped, at a position drawn uniformly among those where the flip makes the DFA reject;
    the other negatives are uniform over rejected strings (also the fallback for a positive that no
    single flip rejects). Labels are the DFA's verdict.
    ``extra`` is empty.
    """

    name = "tomita"
    head = "classify"
    num_classes = 2
    metric = "roc_auc"
    also_reported = {"accuracy": True}
    higher_is_better = True
    max_length = None
    vocab_size = 4
    bos = 2
    pad = 3

    def __init__(self, *, grammar: int = 3, near_miss: float = 0.5):
        self.grammar = check_value(f"{self.name}.grammar", grammar, Literal[tuple(_DFAS)])
        self.near_miss = check_value(f"{self.name}.near_miss", near_miss, float, ge=0, le=1)
        transitions, accepting = _DFAS[grammar]
        self.transitions = torch.tensor(transitions)                # (Q, 2)
        self.accepting = torch.tensor(accepting)                    # (Q,)
        self.min_length = 1 + next(n for n in itertools.count() if self._both_labels(n))

    def _both_labels(self, n: int) -> bool:
        return bool((_log_counts(self.grammar, n)[:, n, 0] > float("-inf")).all())

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        check_sample_args(self, batch_size, length, generator)
        device = generator.device
        n = next(n for n in range(length - 1, 0, -1) if self._both_labels(n))
        ranks = torch.rand(batch_size, generator=generator, device=device).argsort()
        offset = torch.randint(2, (1,), generator=generator, device=device)
        positive = (ranks + offset) % 2 == 0
        near = ~positive & (torch.rand(batch_size, generator=generator, device=device) < self.near_miss)
        # Rows 0..B-1 sample their own label; the extra rows are positives to perturb for `near`.
        classes = torch.cat([positive, torch.ones(int(near.sum()), dtype=torch.bool, device=device)])
        bits, states = self._sample_strings(classes.long(), n, generator)
        labels = self.accepting.to(device)[states[:, -1]]
        flip_pos, has_flip = self._rejecting_flips(bits[batch_size:], states[batch_size:], generator)
        rows = near.nonzero()[:, 0][has_flip]
        bits[rows] = bits[batch_size:][has_flip]
        bits[rows, flip_pos[has_flip]] ^= 1
        labels[rows] = False
        bits = bits[:batch_size]
        head = torch.tensor([self.bos] + [self.pad] * (length - 1 - n), device=device)
        tokens = torch.cat([head.expand(batch_size, -1), bits], dim=1)
        return Batch(tokens, labels[:batch_size].long(), torch.ones_like(tokens, dtype=torch.bool))

    def _sample_strings(self, classes: torch.Tensor, n: int, generator: torch.Generator):
        """Strings of length n uniform within each row's class; returns bits (R, n) and the DFA
        states (R, n+1) visited."""
        device = classes.device
        delta = self.transitions.to(device)
        log_counts = _log_counts(self.grammar, n)[:, :n + 1].to(device)
        # p_one[c, r, q]: probability that the next symbol is 1 with r symbols left in state q.
        p_one = torch.zeros_like(log_counts)
        p_one[:, 1:] = (log_counts[:, :-1, delta[:, 1]] - log_counts[:, 1:]).exp().nan_to_num(0.0)
        p_one = p_one.float()[classes, 1:].flip(1)                  # (R, n, Q), step i has n-i left
        uniform = torch.rand(len(classes), n, 1, generator=generator, device=device)
        # Given its uniform draw, step i maps every state to a next state: compose these maps.
        step_maps = delta[torch.arange(len(delta), device=device), (uniform < p_one).long()]
        states = torch.cat([torch.zeros_like(classes[:, None]), _compose(step_maps)[..., 0]], dim=1)
        bits = (uniform < p_one.gather(2, states[:, :-1, None]))[..., 0].long()
        return bits, states

    def _rejecting_flips(self, bits: torch.Tensor, states: torch.Tensor, generator: torch.Generator):
        """For accepted strings: a uniformly chosen position whose flip makes the DFA reject, (R,)
        long, and whether any such position exists, (R,) bool."""
        delta = self.transitions.to(bits.device)
        # after[:, i, q]: the state reached from q by reading the symbols after position i.
        suffix = _compose(delta.T[bits].flip(1), reverse=True).flip(1)
        identity = torch.arange(len(delta), device=bits.device).expand(len(bits), 1, -1)
        after = torch.cat([suffix[:, 1:], identity], dim=1)
        flipped = delta[states[:, :-1], 1 - bits]
        rejecting = ~self.accepting.to(bits.device)[after.gather(2, flipped[..., None])[..., 0]]
        keys = torch.rand(bits.shape, generator=generator, device=bits.device)
        return torch.where(rejecting, keys, -1.0).argmax(1), rejecting.any(1)

    def metrics(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Per sequence (B,): ``accuracy`` (argmax == label) and ``score`` = log P(accept) - log P(reject), the
        logit margin that ranks the sequences for the ROC AUC (P(accept) itself rounds to 1 in float32 beyond a
        margin of about 17, which would tie every confident sequence)."""
        output = output.float()
        return {"accuracy": (output.argmax(-1) == batch.targets).float(), "score": output[:, 1] - output[:, 0]}

    def batch_metrics(self, values: dict[str, torch.Tensor], batch: Batch) -> dict[str, float]:
        """``roc_auc`` of the batch's scores (`roc_auc`): the seed's metric for sequence classification."""
        return {"roc_auc": roc_auc(values["score"], batch.targets)}

    def undefined(self, metric: str, batch: Batch) -> str | None:
        """ROC AUC needs both classes: a batch of one sequence has one (balanced batches of two or more have both)."""
        rows = len(batch.targets)
        if metric != "roc_auc" or batch.targets.unique().numel() > 1:
            return None
        return f"one class at this length (a batch of {counted(rows, 'sequence')})"

    def chance(self, metric: str, length: int) -> float | None:
        """Labels are balanced (half of every batch accepted): ``accuracy`` and ``roc_auc`` 1/2
        (any score that ignores the string), ``loss`` (cross-entropy of the label) log 2."""
        return {"accuracy": 0.5, "roc_auc": 0.5, "loss": math.log(2)}.get(metric)
