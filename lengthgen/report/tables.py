"""Tables from results: a `Comparison`'s values by evaluated length with the chance level and the verdict of
`lengthgen.report.stats` (shared by the terminal and ``report.md``), and a `RunEval`'s values by position.

Two numbers per length, named the same everywhere: *at length L* is the mean over positions ``[L/2, L)`` (the
positions only that length reaches; per-sequence metrics: over the sequences), *mean over all positions* is
over ``[0, L)``."""

from __future__ import annotations

import math

from lengthgen.eval.results import Comparison, LengthEval, RunEval
from lengthgen.report.stats import Verdict, above_chance, verdict

AT_LENGTH = "at length L = mean over positions [L/2, L), the positions only that length reaches"
#: what a per-sequence value at length L is (a classifier's accuracy, Tomita's ROC AUC over the batch)
PER_SEQUENCE = "at length L = over the length-L sequences (a value per sequence or per batch, not per position)"
ALL_POSITIONS = "mean over all positions [0, L)"
#: marks a value that is not better than the chance level in every seed
AT_CHANCE = "°"


def seed_values(results: Comparison, name: str, length: int, field: str = "at_length") -> dict[str, list[float]]:
    """Variant -> the value ``name`` of each seed at ``length`` (``field``: ``at_length`` or ``mean``)."""
    return {variant: [getattr(run.at(length), field).get(name, math.nan) for run in runs]
            for variant, runs in results.variants.items()}


def chance_levels(results: Comparison, name: str, length: int) -> dict[str, float | None]:
    """Variant -> the chance level of ``name`` at ``length`` over the positions of "at length" of its runs (None:
    the source has none); variants trained on other laws of one task (other task arguments) have their own."""
    return {variant: next((run.at(length).chance[name] for run in runs if name in run.at(length).chance), None)
            for variant, runs in results.variants.items()}


def chance_level(results: Comparison, name: str, length: int) -> float | None:
    """The chance level of ``name`` at ``length`` that every variant with one shares (None: the source has none,
    or the variants' differ: `chance_levels`)."""
    levels = {level for level in chance_levels(results, name, length).values() if level is not None}
    return levels.pop() if len(levels) == 1 else None


def undefined(results: Comparison, name: str, length: int) -> str | None:
    """Why ``name`` is NaN at ``length``, as the runs that have no value there say (`LengthEval.undefined`)."""
    reasons = dict.fromkeys(run.at(length).undefined[name] for runs in results.variants.values() for run in runs
                            if name in run.at(length).undefined)
    return "; ".join(reasons) or None


def same(a: float | None, b: float | None) -> bool:
    """Whether two values are equal, NaN (undefined) equal to NaN."""
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def metric_names(results: Comparison) -> list[str]:
    """The headline metric first, then every other quantity measured at each length."""
    first = next(iter(results.variants.values()))[0].lengths[0].at_length
    return list(dict.fromkeys([results.metric, *first]))


def groups(results: Comparison) -> dict[str, list[str]]:
    """The sets of variants the rule compares: all of them (key ``""``) or, when every name is ``base/variant``
    (compare's ``bases``), each base's variants apart: each base is its own experiment (seed 000: with and
    without positions), so a variant is named best against the others of its base."""
    out: dict[str, list[str]] = {}
    for name in results.variants:
        out.setdefault(name.split("/", 1)[0] if "/" in name else "", []).append(name)
    return {"": list(results.variants)} if "" in out or len(out) == 1 else out


def verdicts(results: Comparison, names: list[str] | None = None) -> dict[int, Verdict]:
    """The rule's verdict on the headline metric at each evaluated length, among ``names`` (default: all)."""
    def among(values: dict[str, list[float]]) -> dict[str, list[float]]:
        return values if names is None else {k: v for k, v in values.items() if k in names}
    return {n: verdict(among(seed_values(results, results.metric, n)), results.higher_is_better,
                       chance_levels(results, results.metric, n)) for n in results.eval_lengths}


def digits(results: Comparison, name: str | None = None) -> dict[int, int]:
    """Significant digits of ``name`` (default: the headline metric) at length L at each length: 4, or as many more
    as it takes for the numbers to show what the words say: the headline's separated best (a named winner, or one
    with too few seeds) with its mean and worst seed apart from each other variant's mean and best seed, and the
    worst seed of each variant better than the chance level in every seed (no `AT_CHANCE` mark) apart from that
    level, for every metric whose direction the comparison records."""
    name = name or results.metric
    higher = results.higher_is_better_for(name)
    out = dict.fromkeys(results.eval_lengths, 4)
    if higher is None:
        return out
    best, worst = (max, min) if higher else (min, max)
    for names in groups(results).values():
        found = verdicts(results, names) if name == results.metric else {}
        for n in results.eval_lengths:
            values, levels = seed_values(results, name, n), chance_levels(results, name, n)
            pairs = []
            if n in found and found[n].p is not None:        # separated
                top, floor = found[n].best, worst(values[found[n].best])
                pairs += [pair for other in names if other != top
                          for pair in ((mean(values[top]), mean(values[other])), (floor, best(values[other])))]
            for variant in names:
                known = [v for v in values[variant] if not math.isnan(v)]
                if levels[variant] is not None and above_chance(known, levels[variant], higher):
                    pairs.append((worst(known), levels[variant]))
            out[n] = max(out[n], next((d for d in range(4, 18)
                                       if all(f"{a:.{d}g}" != f"{b:.{d}g}" for a, b in pairs)), 17))
    return out


def verdict_rows(results: Comparison, label: str = "verdict") -> list[list[str]]:
    """One row of the rule's short verdicts by length per group of variants (`groups`)."""
    return [[f"{label} ({group})" if group else label,
             *(found.short() for found in verdicts(results, names).values())]
            for group, names in groups(results).items()]


def mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def cell(values: list[float], chance: float | None = None, higher_is_better: bool = True, digits: int = 4,
         why: str | None = None) -> str:
    """``mean`` (one seed) or ``mean [min, max]`` over seeds to ``digits`` significant digits, and how many seeds
    have a value when some are NaN; ``°`` when not above chance in every seed with a value; ``undefined: why``
    (else ``n/a``) when no seed has a value."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return f"undefined: {why}" if why else "n/a"
    text = f"{mean(finite):.{digits}g}" + (f" [{min(finite):.{digits}g}, {max(finite):.{digits}g}]"
                                           if len(finite) > 1 else "")
    text += _seeds_with_value(values)
    return text + (AT_CHANCE if chance is not None and not above_chance(finite, chance, higher_is_better) else "")


def _seeds_with_value(values: list[float]) -> str:
    """`` (k of n seeds)`` when only k of the n seeds have a value (not NaN), else nothing."""
    k = sum(not math.isnan(v) for v in values)
    return f" ({k} of {len(values)} seeds)" if k < len(values) else ""


def table(rows: list[list[str]]) -> list[str]:
    """Markdown lines of a table: a header row, then the others."""
    return ["| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|",
            *("| " + " | ".join(row) + " |" for row in rows[1:])]


def times(length: int, train_length: int) -> str:
    """``length / train_length`` as ``2x``, ``0.03125x`` (exact where six digits write it) or ``1.67x`` (3
    significant digits, more for the integer part: ``21845x``)."""
    ratio = length / train_length
    exact = f"{ratio:g}"
    return (exact if float(exact) == ratio else f"{ratio:.{max(3, len(str(round(ratio))))}g}") + "x"


def length_label(length: int, train_length: int) -> str:
    return f"{length} ({times(length, train_length)})"


def value_rows(results: Comparison, name: str, field: str = "at_length", ratio: bool = False) -> list[list[str]]:
    """Header, one row per variant and the chance row of ``name`` by length; values not above chance are marked
    where the comparison records ``name``'s direction; ``ratio``: each mean's ratio to the variant's mean at the
    training length, where both are finite. Values at length L have the `digits` that show what the marks and the
    verdict say."""
    lengths, train_length = results.eval_lengths, results.train_length
    chance = {n: chance_levels(results, name, n) if field == "at_length" else {} for n in lengths}
    places = digits(results, name) if field == "at_length" else dict.fromkeys(lengths, 4)
    rows = [["variant", *(length_label(n, train_length) for n in lengths)]]
    by_length = {n: seed_values(results, name, n, field) for n in lengths}
    higher = results.higher_is_better_for(name)
    for variant in results.variants:
        base = mean(by_length[train_length][variant]) if train_length in by_length else math.nan
        cells = []
        for n in lengths:
            text = cell(by_length[n][variant], chance[n].get(variant) if higher is not None else None, bool(higher),
                        places[n], undefined(results, name, n))
            if ratio and base and math.isfinite(base) and math.isfinite(mean(by_length[n][variant])):
                text += f" ({mean(by_length[n][variant]) / base:.3g}x)"
            cells.append(text)
        rows.append([variant, *cells])
    level = lambda c, n: "n/a" if c is None else f"{c:.{places[n]}g}"  # noqa: E731
    if any(len(set(chance[n].values())) > 1 for n in lengths):     # variants of other laws: a row each
        rows += [[f"chance ({variant})", *(level(chance[n][variant], n) for n in lengths)]
                 for variant in results.variants]
    elif any(c is not None for n in lengths for c in chance[n].values()):
        rows.append(["chance", *(level(next(iter(chance[n].values()), None), n) for n in lengths)])
    return rows


def conclusion(results: Comparison) -> str:
    """What the rule concludes at the longest length, with every variant's mean there; per base when the
    variants have bases (`groups`)."""
    return " ".join([*(_conclusion(results, names, f"Among the {group}/ variants, at" if group else "At")
                       for group, names in groups(results).items()), *diverged(results)])


def diverged(results: Comparison) -> list[str]:
    """A sentence naming the runs whose training diverged and why (`RunEval.diverged`), if any."""
    runs = [f"{name} seed {run.seed} ({run.diverged})" for name, variant_runs in results.variants.items()
            for run in variant_runs if run.diverged]
    return [f"Diverged in training, so counted as the worst value (+-inf) at every length: {', '.join(runs)}."
            ] if runs else []


def _conclusion(results: Comparison, names: list[str], prefix: str) -> str:
    longest, metric = results.eval_lengths[-1], results.metric
    found = verdicts(results, names)[longest]
    where = f"{prefix} {longest} tokens ({times(longest, results.train_length)} the training length)"
    values = {name: v for name, v in seed_values(results, metric, longest).items() if name in names}
    means = {name: mean(v) for name, v in values.items()}
    order = sorted((name for name in means if not math.isnan(means[name])), key=means.get,
                   reverse=results.higher_is_better)
    places = digits(results)[longest]
    listed = ", ".join(f"{name} {means[name]:.{places}g}" + _seeds_with_value(values[name]) for name in order)
    direction = "highest" if results.higher_is_better else "lowest"
    if found.winner:
        text = f"{where} **{found.winner}** has the {direction} {metric}: {found.reason}."
    else:
        why = undefined(results, metric, longest)
        text = (f"{where} no variant is named best ({found.status}): {found.reason}"
                + (f"; {metric} is undefined there: {why}." if why else "."))
    levels = {level for level in chance_levels(results, metric, longest).values() if level is not None}
    if found.at_chance and levels:
        level = f"chance ({next(iter(levels)):.{places}g})" if len(levels) == 1 else "their own chance levels"
        text += f" Not better than {level} in every seed: {', '.join(found.at_chance)}."
    return text + (f" Means: {listed}." if listed else "")


def per_position(results: Comparison, name: str) -> bool:
    """Whether ``name`` is measured by position (its value at length L a mean over positions [L/2, L)), not per
    sequence or per batch."""
    return bool(next(iter(results.variants.values()))[0].at(results.eval_lengths[-1]).buckets.get(name))


def at_length(results: Comparison, name: str) -> str:
    """What ``name`` at length L means: `AT_LENGTH` or `PER_SEQUENCE`."""
    return AT_LENGTH if per_position(results, name) else PER_SEQUENCE


def averaged_over(results: Comparison, name: str) -> str:
    """`at_length` in a few words, for titles and axis labels."""
    return "mean over positions [L/2, L)" if per_position(results, name) else "over the length-L sequences"


def terminal_table(results: Comparison) -> str:
    """The headline metric at each length (mean [min, max] over seeds), the chance level, the rule's verdict
    per length and the conclusion."""
    rows = value_rows(results, results.metric) + verdict_rows(results)
    title = (f"{results.metric} at length L ({averaged_over(results, results.metric)}; training length "
             f"{results.train_length})")
    notes = [f"{AT_CHANCE} = not better than the chance level in every seed"] if any(
        AT_CHANCE in c for row in rows[1:] for c in row[1:]) else []
    return "\n".join([title, *aligned(rows), *notes, conclusion(results).replace("**", "")])


def aligned(lines: list[list[str]], right: bool = False) -> list[str]:
    """Columns padded to their widest cell; ``right``: all but the first column right-aligned."""
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
    return ["  ".join(cell.rjust(w) if right and c else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths)))
            .rstrip() for line in lines]


def position_table(rows: list[LengthEval], metric: str = "loss", *, train_length: int | None = None) -> str:
    """``metric`` by position bucket (rows: the longest length's buckets; a shorter length's last bucket, cut at
    that length, in the row where it starts) and evaluated length (columns), then its value at each length; ``*``
    marks buckets that reach beyond the training length."""
    rows = [r for r in rows if metric in r.buckets]
    if not rows:
        return ""
    longest = max(rows, key=lambda r: r.length)
    body = []
    for i, bucket in enumerate(longest.buckets[metric]):
        label = f"[{bucket.lo}, {bucket.hi})" + (" *" if train_length is not None and bucket.hi > train_length
                                                else "")
        cells = []
        for r in rows:
            own = r.buckets[metric]
            value = own[i].mean if i < len(own) and own[i].lo == bucket.lo else math.nan
            cells.append("" if math.isnan(value) else f"{value:.4f}")
        body.append([label, *cells])
    fixed = lambda v: "n/a" if math.isnan(v) else f"{v:.4f}"  # noqa: E731
    body.append([f"at length L ({metric})", *(fixed(r.at_length.get(metric, math.nan)) for r in rows)])
    body.append([f"all positions ({metric})", *(fixed(r.mean.get(metric, math.nan)) for r in rows)])
    title = (f"{metric} by position (columns: eval length)"
             + (f"; * = the bucket reaches beyond the training length {train_length}" if train_length else ""))
    header = ["positions", *(str(r.length) for r in rows)]
    return "\n".join([title, *aligned([header, *body], right=True),
                      *(f"  length {r.length}: {r.batch}" for r in rows)])


def _summary_value(r: LengthEval, name: str) -> str:
    """``name 0.5 (0.4)``: at length L and, where it prints differently, over all positions; ``name undefined: why``
    for NaN."""
    shown = r.value_text(name)
    overall = f"{r.mean[name]:.4g}" if name in r.mean and not math.isnan(r.at_length[name]) else shown
    return f"{name} {shown}" + (f" ({overall})" if overall != shown else "")


def run_summary(run: RunEval, metric: str = "loss", *, train_length: int | None = None) -> str:
    """Every value at each evaluated length (at length L and over all positions, each defined), then
    `position_table` of the loss (and of ``metric`` when it is another per-position quantity)."""
    lines = [f"values {AT_LENGTH}; in parentheses, where it differs: {ALL_POSITIONS}"]
    for r in run.lengths:
        values = ", ".join(_summary_value(r, k) + (f" [chance {r.chance[k]:.4g}]" if k in r.chance else "")
                           for k in r.at_length)
        lines.append(f"length {r.length}: {values}")
    lines.append(position_table(run.lengths, "loss", train_length=train_length))
    if metric != "loss" and any(r.buckets.get(metric) != r.buckets.get("loss") for r in run.lengths):
        lines.append(position_table(run.lengths, metric, train_length=train_length))
    return "\n".join(line for line in lines if line)
