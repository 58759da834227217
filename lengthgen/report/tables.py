"""Text and markdown tables from results: a `Comparison`'s metric at each evaluated length (and its ratio to
the training-length value), and a `RunEval`'s values by position."""

from __future__ import annotations

import math
import statistics

from lengthgen.eval.results import Comparison, LengthEval, RunEval


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(results: Comparison) -> list[dict]:
    """One row per variant: for each evaluated length, every measured quantity (mean, std over seeds) and the
    headline metric's ratio to its value at the training length."""
    metric, train_length = results.metric, results.train_length
    rows = []
    for variant, runs in results.variants.items():
        row = {"variant": variant, "seeds": len(runs), "lengths": {}}
        for length in results.eval_lengths:
            row["lengths"][length] = {name: _mean_std([run.at(length).at_length.get(name, math.nan) for run in runs])
                                      for name in metric_names(results)}
        base = row["lengths"].get(train_length, {}).get(metric, (math.nan, 0))[0]
        for length, cell in row["lengths"].items():
            cell["ratio"] = cell[metric][0] / base if base and not math.isnan(base) else math.nan
        rows.append(row)
    return rows


def metric_names(results: Comparison) -> list[str]:
    """The headline metric first, then every other quantity measured at each length."""
    first = next(iter(results.variants.values()))[0].lengths[0].at_length
    return list(dict.fromkeys([results.metric, *first]))


def _fmt(mean: float, std: float, seeds: int) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4g} ± {std:.2g}" if seeds > 1 else f"{mean:.4g}"


def _label(length: int, train_length: int) -> str:
    multiple = length / train_length
    return f"{length} ({multiple:g}x)"


def best_variant(results: Comparison, rows: list[dict] | None = None) -> tuple[str, float] | None:
    """The variant with the best headline metric at the longest evaluated length, and that value."""
    rows = rows or summarize(results)
    longest = results.eval_lengths[-1]
    scored = [(row["lengths"][longest][results.metric][0], row["variant"]) for row in rows]
    scored = [(v, name) for v, name in scored if not math.isnan(v)]
    if not scored:
        return None
    value, name = (max if results.higher_is_better else min)(scored)
    return name, value


def conclusion(results: Comparison, rows: list[dict]) -> str:
    """One sentence saying which variant generalized best (or that none could be scored)."""
    best = best_variant(results, rows)
    if best is None:
        return "No variant produced a finite metric at the longest length."
    name, value = best
    longest, metric = results.eval_lengths[-1], results.metric
    row = next(r for r in rows if r["variant"] == name)
    ratio = row["lengths"][longest]["ratio"]
    others = sorted((r["lengths"][longest][metric][0], r["variant"]) for r in rows if r["variant"] != name)
    others_text = ", ".join(f"{v} {m:.4g}" for m, v in others if not math.isnan(m))
    direction = "highest" if results.higher_is_better else "lowest"
    return (f"At {longest} tokens ({longest / results.train_length:g}x the training length) **{name}** has the "
            f"{direction} {metric} ({value:.4g}, {ratio:.3g}x its training-length value)"
            + (f"; the others: {others_text}." if others_text else "."))


def markdown_report(results: Comparison) -> str:
    """The report: title, description, conclusion, the headline metric and every other quantity by length,
    and the runs' timings."""
    rows = summarize(results)
    metric, train_length, lengths = results.metric, results.train_length, results.eval_lengths
    arrow = "higher is better" if results.higher_is_better else "lower is better"
    lines = [f"# {results.title}", ""] + ([results.description, ""] if results.description else [])
    lines += [f"Trained at length {train_length}; evaluated at {', '.join(map(str, lengths))}. Headline metric "
              f"`{metric}` ({arrow}), measured at each length over positions [L/2, L) (the positions only that "
              "length reaches). Ratio: value / value at the training length. Mean ± std over seeds where several.",
              "", conclusion(results, rows), "", f"## {metric} by evaluation length", "",
              "| variant | " + " | ".join(_label(n, train_length) for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for row in rows:
        cells = [_fmt(*row["lengths"][n][metric], row["seeds"]) + f" ({row['lengths'][n]['ratio']:.3g}x)"
                 for n in lengths]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    for name in metric_names(results)[1:]:
        lines += ["", f"## {name} by evaluation length", "",
                  "| variant | " + " | ".join(_label(n, train_length) for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for row in rows:
            lines.append(f"| {row['variant']} | " + " | ".join(_fmt(*row["lengths"][n][name], row["seeds"])
                                                            for n in lengths) + " |")
    lines += ["", "## Runs", "", "| variant | seed | final train loss | train s | eval s |", "|---|---|---|---|---|"]
    for variant, runs in results.variants.items():
        for run in runs:
            cells = [_or_na(run.final_train_loss, ".4g"), _or_na(run.train_seconds), _or_na(run.eval_seconds)]
            lines.append(f"| {variant} | {_or_na(run.seed)} | " + " | ".join(cells) + " |")
    lines += ["", "Plots: `extrapolation.png` (metric by position, training length marked), `diagnostics.png` "
              "(1/w_max and attention-output RMS by position). Raw numbers: `results.json`.", ""]
    return "\n".join(lines)


def terminal_table(results: Comparison) -> str:
    """A plain aligned table of the headline metric by length, and the conclusion."""
    rows = summarize(results)
    metric, lengths = results.metric, results.eval_lengths
    header = ["variant", *(_label(n, results.train_length) for n in lengths)]
    body = [[row["variant"], *(_fmt(*row["lengths"][n][metric], row["seeds"]) for n in lengths)] for row in rows]
    text = [f"{metric} by evaluation length (training length {results.train_length})", *_aligned([header, *body])]
    return "\n".join(text + [conclusion(results, rows).replace("**", "")])


def _or_na(value, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)


def _aligned(lines: list[list[str]], right: bool = False) -> list[str]:
    """Columns padded to their widest cell; ``right``: all but the first column right-aligned."""
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
    return ["  ".join(cell.rjust(w) if right and c else cell.ljust(w) for c, (cell, w) in enumerate(zip(line, widths)))
            .rstrip() for line in lines]


def position_table(rows: list[LengthEval], metric: str = "loss", *, train_length: int | None = None) -> str:
    """``metric`` by position bucket (rows) and evaluated length (columns), then its value at each length;
    ``*`` marks buckets beyond the training length."""
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
            value = own[i].mean if i < len(own) and own[i].hi == bucket.hi else math.nan
            cells.append("" if math.isnan(value) else f"{value:.4f}")
        body.append([label, *cells])
    body.append([f"at length ({metric})", *(f"{r.at_length.get(metric, math.nan):.4f}" for r in rows)])
    title = (f"{metric} by position (columns: eval length)"
             + (f"; * = positions beyond the training length {train_length}" if train_length else ""))
    header = ["positions", *(str(r.length) for r in rows)]
    return "\n".join([title, *_aligned([header, *body], right=True),
                      *(f"  length {r.length}: {r.batch}" for r in rows)])


def run_summary(run: RunEval, metric: str = "loss", *, train_length: int | None = None) -> str:
    """Every value at each evaluated length, then `position_table` of the loss (and of ``metric`` when it is
    another per-position quantity)."""
    lines = [f"length {r.length}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.at_length.items()) for r in run.lengths]
    lines.append(position_table(run.lengths, "loss", train_length=train_length))
    if metric != "loss" and any(r.buckets.get(metric) != r.buckets.get("loss") for r in run.lengths):
        lines.append(position_table(run.lengths, metric, train_length=train_length))
    return "\n".join(line for line in lines if line)
