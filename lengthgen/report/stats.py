"""The one rule that names a winner among variants, used by every report and terminal table.

Each seed has its own initialization, training batches and evaluation batches, so the spread over seeds holds
both training and evaluation noise; the variants' runs of one seed see the same batches (a paired design). At
one evaluated length, given each variant's headline values (one per seed) and the task's chance level:

1. A variant is *above chance* when every seed is strictly better than the chance level (no chance level:
   always).
2. The variant with the best mean is named the *winner* only when every variant has at least two seeds and a
   value in each (NaN: the metric is undefined there, so the seeds cannot be ranked), it is above chance, it is
   *separated* -- its worst seed is better than every seed of every other variant (the min-max ranges over
   seeds do not overlap) -- and separation is significant: p <= `ALPHA` below.
3. Otherwise no winner is named, and the verdict says why: one seed, NaN seeds, at chance, not separated (means
   tied up to float rounding are named together), or too few seeds (separated, but p > `ALPHA`).

p bounds the probability of naming a winner that is not better than every other variant. Naming the best is wrong as
soon as one other variant does as well, whatever the rest do, so p is taken against each other variant j alone: if
the best b and j did not differ (their n_b + n_j runs exchangeable), the seeds of one of the two would all beat the
other's with probability 1 / C(n_b + n_j, n_b) + 1 / C(n_b + n_j, n_j) (either could be the better mean), and p is
the largest over j (an intersection-union test). It is exact with equal seed counts when one variant ties with the
best and every other is far worse, and an upper bound otherwise: several tied (3 / C(9, 3) = 0.036 < 0.1 with 3
seeds), others closer, values that can tie, or unequal counts, where the fewest seeds set p (seeds 5, 3, 3, the
first two alike and the third far worse: the first is named 1.8% of the time at p = 0.036, the second, at p = 0.1,
never). With n seeds each p = 2 / C(2n, n): 0.33 for 2 seeds, 0.1 for 3, 0.029 for 4, 0.0079 for 5, whatever the
number of variants, so a winner needs 4 seeds or more (`smallest_p`). (The probability under "no variant differs"
alone, sum_i 1 / C(N, n_i), is smaller -- 0.011 for 5 variants x 3 seeds -- but it is not the probability of a wrong
winner: with 2 of 5 variants tied and 3 far worse a winner would be named 10% of the time.) "Does as well" means
alike or better in distribution: p does not bound naming one of two variants of equal means but different spreads
(Gaussian, 4 seeds each, one sd 3x or 10x the other's: a winner 4.9% or 9.0% of the time at p = 0.029; 2^(1 - n) =
0.125 in the limit). Runs that share a seed's batches are not independent: what the batches add to every run of a
seed (x = b_seed + e) makes a separation rarer when the variants do not differ (the variant's worst seed must beat
the others' runs of a luckier seed), so p is then an upper bound. Simulated for two alike variants with Gaussian or
t(3) noise, 2-5 seeds, 2e5 trials: 0.79-0.97x p with a seed effect of 0.3 noise sd, 0.20-0.77x with 1 sd, 0.01-0.40x
with 3 sd. Each length, and each base of a comparison with bases, is a test of its own, not corrected for the
several lengths and bases of a table; a report's conclusion reads the longest length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: the largest p at which a separated variant is named the winner
ALPHA = 0.05
#: the rule in one sentence, for reports
RULE = ("a variant is named best at a length only when every variant has at least two seeds, each with a value, "
        "every seed of it is better than the chance level, and its worst seed beats every seed of every other "
        "variant (non-overlapping min-max ranges over seeds) with p <= 0.05, p being the largest over the other "
        "variants of the exact probability that, if it and the best did not differ, the seeds of one of the two "
        "would all beat the other's (1 / C(n + m, n) + 1 / C(n + m, m) for n and m seeds: 0.1 with 3 seeds each, "
        "0.029 with 4, whatever the number of variants; exact for independent runs, an upper bound where the "
        "variants' runs of one seed share its batches, which makes a separation rarer); each length and each base "
        "is tested on its own, without a correction for the others")


@dataclass
class Verdict:
    """The rule's outcome at one length. ``status``: ``separated`` (a winner is named), ``one seed``,
    ``NaN seeds``, ``at chance``, ``not separated``, ``too few seeds``, ``one variant`` or ``no value``; ``best``:
    the variant with the best mean among those finite in every seed; ``winner``: ``best`` when separated;
    ``reason``: one sentence; ``p``: the bound on naming a wrong winner (module docstring), when the seeds are
    separated; ``at_chance``: the variants whose seeds with a value are not all above chance."""
    status: str
    best: str | None
    reason: str
    p: float | None = None
    at_chance: list[str] = field(default_factory=list)

    @property
    def winner(self) -> str | None:
        return self.best if self.status == "separated" else None

    def short(self) -> str:
        """A table cell: the winner and p, the separated best and p with too few seeds, or the status."""
        if self.status == "too few seeds":
            return f"too few seeds ({self.best}, p = {self.p:.2g})"
        return f"{self.best} (p = {self.p:.2g})" if self.winner else self.status


def better(a: float, b: float, higher_is_better: bool) -> bool:
    """Whether ``a`` is strictly better than ``b`` (never when either is NaN)."""
    return a > b if higher_is_better else a < b


def above_chance(values: list[float], chance: float | None, higher_is_better: bool) -> bool:
    """Every value is finite and strictly better than ``chance`` (None: no chance level, only finiteness)."""
    finite = bool(values) and all(math.isfinite(v) for v in values)
    return finite and (chance is None or all(better(v, chance, higher_is_better) for v in values))


def pair_p(n: int, m: int) -> float:
    """The exact probability that, of two variants with ``n`` and ``m`` seeds that do not differ (n + m exchangeable
    runs), the seeds of one would all beat the other's: 1 / C(n + m, n) + 1 / C(n + m, m)."""
    return 1 / math.comb(n + m, n) + 1 / math.comb(n + m, m)


def smallest_p(seeds: int) -> float | None:
    """The smallest p the rule can give with ``seeds`` seeds per variant (None: one seed, no p at all)."""
    return pair_p(seeds, seeds) if seeds >= 2 else None


def verdict(values: dict[str, list[float]], higher_is_better: bool,
            chance: float | dict[str, float | None] | None = None) -> Verdict:
    """Apply the rule (module docstring) to ``values``: variant -> its seeds' values at one length; ``chance``:
    the chance level of every variant, or variant -> its own (variants trained on other laws of one task). Seeds
    may be any numbers (NumPy arrays, tensors); other ``values``, or a ``higher_is_better`` that is no bool (the
    string 'False' is true), are a TypeError."""
    if not isinstance(higher_is_better, bool):
        raise TypeError(f"verdict: higher_is_better must be True or False, got {higher_is_better!r}")
    try:
        values = {name: [float(x) for x in seeds] for name, seeds in values.items()}
    except (TypeError, ValueError, AttributeError):
        raise TypeError("verdict: values must map each variant to a list of its seeds' values (numbers), got "
                        f"{type(values).__name__} {values!r:.80}") from None
    levels = chance if isinstance(chance, dict) else dict.fromkeys(values, chance)
    finite = {name: v for name, v in values.items() if v and all(math.isfinite(x) for x in v)}
    means = {name: sum(v) / len(v) for name, v in finite.items()}
    known = {name: [x for x in v if not math.isnan(x)] for name, v in values.items()}   # NaN: undefined there
    at_chance = [name for name, v in known.items() if v and not above_chance(v, levels.get(name), higher_is_better)]
    if not means:
        return Verdict("no value", None, "no variant has a finite value in every seed", at_chance=at_chance)
    best = (max if higher_is_better else min)(means, key=means.get)
    if len(values) == 1:
        return Verdict("one variant", best, f"{best} is the only variant: nothing to compare", at_chance=at_chance)
    single = [name for name, v in values.items() if len(v) < 2]
    if single:
        who = ("every variant has" if len(single) == len(values)
               else f"{', '.join(single)} {'has' if len(single) == 1 else 'have'}")
        few = "a single seed" if all(values[name] for name in single) else "fewer than two seeds"
        return Verdict("one seed", best, f"{who} {few}, so the seed spread is unknown and no variant is "
                       "named best (run several seeds)", at_chance=at_chance)
    undefined = [name for name, v in values.items() if any(math.isnan(x) for x in v)]
    if undefined:
        who = f"{', '.join(undefined)} {'has' if len(undefined) == 1 else 'have'}"
        return Verdict("NaN seeds", best, f"{who} seeds without a value (NaN: the metric is undefined there), so the "
                       "seeds cannot be ranked and no variant is named best", at_chance=at_chance)
    tied = [name for name in means if math.isclose(means[name], means[best], rel_tol=1e-9, abs_tol=1e-12)]
    top = " and ".join([", ".join(tied[:-1]), tied[-1]] if len(tied) > 1 else tied)
    if all(name in at_chance for name in tied):     # a tie with a variant above chance is no verdict of chance
        lead = f"{best}, the best mean, is" if len(tied) == 1 else f"{top}, tied for the best mean, are"
        return Verdict("at chance", best, f"{lead} not better than the chance level ({levels[best]:.4g}) in every "
                       "seed, so no variant is named best", at_chance=at_chance)
    worst = (min if higher_is_better else max)(values[best])
    overlapping = [name for name, v in values.items()
                   if name != best and not all(better(worst, x, higher_is_better) for x in v)]
    if len(tied) > 1:       # equal means always overlap: name them together, not the first as the best
        others = [name for name in overlapping if name not in tied]
        return Verdict("not separated", best, f"{top} share the best mean ({means[best]:.4g})"
                       + (f"; the seeds of {best} also overlap those of {', '.join(others)}" if others else ""),
                       at_chance=at_chance)
    if overlapping:
        return Verdict("not separated", best, f"{best} has the best mean, but its seeds overlap those of "
                       f"{', '.join(overlapping)}", at_chance=at_chance)
    p = max(pair_p(len(values[best]), len(v)) for name, v in values.items() if name != best)
    separated = (f"every seed of {best} beats every seed of every other variant (p = {p:.2g}, the largest over them "
                 f"of the probability that, were {best} and that variant alike, the seeds of one of the two would all "
                 "beat the other's")
    if p > ALPHA:
        return Verdict("too few seeds", best, f"{separated}; above {ALPHA}: too few seeds to tell)",
                       p=p, at_chance=at_chance)
    return Verdict("separated", best, f"{separated})", p=p, at_chance=at_chance)


__all__ = ["ALPHA", "RULE", "Verdict", "above_chance", "better", "pair_p", "smallest_p", "verdict"]
