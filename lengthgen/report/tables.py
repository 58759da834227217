"""Summary tables of a compare ``results`` dict: metric at the training length and at each multiple of it."""

from __future__ import annotations

import math
import statistics


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(results: dict) -> list[dict]:
    """One row per variant: for each evaluated length, every measured quantity (mean, std over seeds) and the
    headline metric's ratio to its value at the training length."""
    metric, train_length = results["metric"], results["train_length"]
    rows = []
    for variant, runs in results["variants"].items():
        row = {"variant": variant, "seeds": len(runs), "lengths": {}}
        for i, length in enumerate(results["eval_lengths"]):
            cell = {}
            for name in metric_names(results):
                cell[name] = _mean_std([run["evals"][i]["at_length"].get(name, math.nan) for run in runs])
            row["lengths"][length] = cell
        base = row["lengths"].get(train_length, {}).get(metric, (math.nan, 0))[0]
        for length, cell in row["lengths"].items():
            cell["ratio"] = cell[metric][0] / base if base and not math.isnan(base) else math.nan
        rows.append(row)
    return rows


def metric_names(results: dict) -> list[str]:
    """The headline metric first, then every other quantity measured at each length."""
    first = next(iter(results["variants"].values()))[0]["evals"][0]["at_length"]
    return list(dict.fromkeys([results["metric"], *first]))


def _fmt(mean: float, std: float, seeds: int) -> str:
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4g} ± {std:.2g}" if seeds > 1 else f"{mean:.4g}"


def _label(length: int, train_length: int) -> str:
    multiple = length / train_length
    return f"{length} ({multiple:g}x)"


def best_variant(results: dict, rows: list[dict] | None = None) -> tuple[str, float] | None:
    """The variant with the best headline metric at the longest evaluated length, and that value."""
    rows = rows or summarize(results)
    longest = results["eval_lengths"][-1]
    scored = [(row["lengths"][longest][results["metric"]][0], row["variant"]) for row in rows]
    scored = [(v, name) for v, name in scored if not math.isnan(v)]
    if not scored:
        return None
    value, name = (max if results["higher_is_better"] else min)(scored)
    return name, value


def conclusion(results: dict, rows: list[dict]) -> str:
    """One sentence saying which variant generalized best (or that none could be scored)."""
    best = best_variant(results, rows)
    if best is None:
        return "No variant produced a finite metric at the longest length."
    name, value = best
    longest, metric = results["eval_lengths"][-1], results["metric"]
    row = next(r for r in rows if r["variant"] == name)
    ratio = row["lengths"][longest]["ratio"]
    others = sorted((r["lengths"][longest][metric][0], r["variant"]) for r in rows if r["variant"] != name)
    others_text = ", ".join(f"{v} {m:.4g}" for m, v in others if not math.isnan(m))
    direction = "highest" if results["higher_is_better"] else "lowest"
    return (f"At {longest} tokens ({longest / results['train_length']:g}x the training length) **{name}** has the "
            f"{direction} {metric} ({value:.4g}, {ratio:.3g}x its training-length value)"
            + (f"; the others: {others_text}." if others_text else "."))


def markdown_report(results: dict) -> str:
    rows = summarize(results)
    metric, train_length, lengths = results["metric"], results["train_length"], results["eval_lengths"]
    arrow = "higher is better" if results["higher_is_better"] else "lower is better"
    lines = [f"# lengthgen compare: {results['task']}", "",
             f"Trained at length {train_length}; evaluated at {', '.join(map(str, lengths))}. Headline metric "
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
    for variant, runs in results["variants"].items():
        for run in runs:
            loss = run.get("final_train_loss")
            lines.append(f"| {variant} | {run['seed']} | {'n/a' if loss is None else f'{loss:.4g}'} | "
                         f"{run.get('train_seconds', 'n/a')} | {run.get('eval_seconds', 'n/a')} |")
    lines += ["", "Plots: `extrapolation.png` (metric by position, training length marked), `diagnostics.png` "
              "(1/w_max and attention-output RMS by position). Raw numbers: `results.json`.", ""]
    return "\n".join(lines)


def terminal_table(results: dict) -> str:
    """A plain aligned table of the headline metric by length, and the conclusion."""
    rows = summarize(results)
    metric, lengths = results["metric"], results["eval_lengths"]
    header = ["variant", *(_label(n, results["train_length"]) for n in lengths)]
    body = [[row["variant"], *(_fmt(*row["lengths"][n][metric], row["seeds"]) for n in lengths)] for row in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    text = [f"{metric} by evaluation length (training length {results['train_length']})"]
    text += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header, *body]]
    return "\n".join(text + [conclusion(results, rows).replace("**", "")])
