"""The one rule that names a winner among variants, used by every report and terminal table.

Each seed of a variant has its own initialization, training batches and evaluation batches, so the spread over
seeds holds both training and evaluation noise. At one evaluated length, given each variant's headline values
(one per seed) and the task's chance level:

1. A variant is *above chance* when every seed is strictly better than the chance level (no chance level:
   always).
2. The variant with the best mean is named the *winner* only when every variant has at least two seeds, it is
   above chance, it is *separated* -- its worst seed is better than every seed of every other variant (the
   min-max ranges over seeds do not overlap) -- and separation is significant: p <= `ALPHA` below.
3. Otherwise no winner is named, and the verdict says why: one seed, at chance, not separated, or too few
   seeds (separated, but p > `ALPHA`).

p is the exact one-sided permutation test of complete separation (Mann-Whitney U = 0): if the seeds of the
winner and the runner-up (n and m seeds) were exchangeable, every one of the winner's would beat every one of
the runner-up's with probability 1 / C(n + m, n): 1/6 for 2 seeds each, 1/20 for 3, 1/70 for 4. So at least 3
seeds per variant are needed to name a winner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: the largest p at which a separated variant is named the winner
ALPHA = 0.05
#: the rule in one sentence, for reports
RULE = ("a variant is named best at a length only when every variant has at least two seeds, every seed of it "
        "is better than the chance level, and its worst seed beats every seed of every other variant "
        "(non-overlapping min-max ranges over seeds) with p = 1 / C(n + m, n) <= 0.05, the probability of such a "
        "separation between exchangeable seeds (n and m seeds of it and the runner-up: 3 seeds each give 0.05)")


@dataclass
class Verdict:
    """The rule's outcome at one length. ``status``: ``separated`` (a winner is named), ``one seed``,
    ``at chance``, ``not separated``, ``too few seeds``, ``one variant`` or ``no value``; ``best``: the variant
    with the best mean over finite seeds; ``winner``: ``best`` when separated; ``reason``: one sentence; ``p``:
    1 / C(n + m, n) against the runner-up when the seeds are separated; ``at_chance``: the variants not above
    chance."""
    status: str
    best: str | None
    reason: str
    p: float | None = None
    at_chance: list[str] = field(default_factory=list)

    @property
    def winner(self) -> str | None:
        return self.best if self.status == "separated" else None

    def short(self) -> str:
        """A table cell: the winner and p, or the status."""
        return f"{self.best} (p = {self.p:.2g})" if self.winner else self.status


def better(a: float, b: float, higher_is_better: bool) -> bool:
    """Whether ``a`` is strictly better than ``b`` (never when either is NaN)."""
    return a > b if higher_is_better else a < b


def above_chance(values: list[float], chance: float | None, higher_is_better: bool) -> bool:
    """Every value is finite and strictly better than ``chance`` (None: no chance level, only finiteness)."""
    finite = bool(values) and all(math.isfinite(v) for v in values)
    return finite and (chance is None or all(better(v, chance, higher_is_better) for v in values))


def verdict(values: dict[str, list[float]], higher_is_better: bool, chance: float | None = None) -> Verdict:
    """Apply the rule (module docstring) to ``values``: variant -> its seeds' values at one length."""
    finite = {name: v for name, v in values.items() if v and all(math.isfinite(x) for x in v)}
    means = {name: sum(v) / len(v) for name, v in finite.items()}
    at_chance = [name for name, v in values.items() if not above_chance(v, chance, higher_is_better)]
    if not means:
        return Verdict("no value", None, "no variant has a finite value in every seed", at_chance=at_chance)
    best = (max if higher_is_better else min)(means, key=means.get)
    if len(values) == 1:
        return Verdict("one variant", best, f"{best} is the only variant: nothing to compare", at_chance=at_chance)
    single = [name for name, v in values.items() if len(v) < 2]
    if single:
        who = ("every variant has" if len(single) == len(values)
               else f"{', '.join(single)} {'has' if len(single) == 1 else 'have'}")
        return Verdict("one seed", best, f"{who} a single seed, so the seed spread is unknown and no variant is "
                       "named best (run several seeds)", at_chance=at_chance)
    if best in at_chance:
        return Verdict("at chance", best, f"{best}, the best mean, is not better than the chance level "
                       f"({chance:.4g}) in every seed, so no variant is named best", at_chance=at_chance)
    worst = (min if higher_is_better else max)(values[best])
    overlapping = [name for name, v in values.items()
                   if name != best and not all(better(worst, x, higher_is_better) for x in v if not math.isnan(x))]
    if overlapping:
        return Verdict("not separated", best, f"{best} has the best mean, but its seeds overlap those of "
                       f"{', '.join(overlapping)}", at_chance=at_chance)
    others = {name: [x for x in v if not math.isnan(x)] for name, v in values.items() if name != best}
    others = {name: sum(v) / len(v) for name, v in others.items() if v}
    runner_up = (max if higher_is_better else min)(others, key=others.get, default=None)
    if runner_up is None:
        return Verdict("not separated", best, f"{best} is the only variant with a value", at_chance=at_chance)
    seeds = sum(not math.isnan(x) for x in values[runner_up])
    p = 1 / math.comb(len(values[best]) + seeds, len(values[best]))
    separated = f"every seed of {best} beats every seed of every other variant (p = {p:.2g} against the runner-up " \
                f"{runner_up}"
    if p > ALPHA:
        return Verdict("too few seeds", best, f"{separated}, above {ALPHA}: too few seeds to tell)",
                       p=p, at_chance=at_chance)
    return Verdict("separated", best, f"{separated})", p=p, at_chance=at_chance)


__all__ = ["ALPHA", "RULE", "Verdict", "above_chance", "better", "verdict"]
