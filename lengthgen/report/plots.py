"""Plots of a `Comparison` (matplotlib, Agg backend): metric by position and attention diagnostics."""

from __future__ import annotations

import math
from pathlib import Path

from lengthgen.eval.results import Bucket, Comparison, LengthEval, RunEval

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _curve(runs: list[RunEval], pick) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min, max over seeds of the buckets ``pick(run)`` (NaN buckets dropped). A bucket [lo, hi) is
    drawn at hi: the context length its positions reach."""
    per_seed = [pick(run) for run in runs]
    xs, means, lows, highs = [], [], [], []
    for i, bucket in enumerate(per_seed[0]):
        values = [rows[i].mean for rows in per_seed if not math.isnan(rows[i].mean)]
        if values:
            xs.append(bucket.hi)
            means.append(sum(values) / len(values))
            lows.append(min(values))
            highs.append(max(values))
    return xs, means, lows, highs


def _draw(ax, xs, means, lows, highs, label, **style) -> None:
    line, = ax.plot(xs, means, marker="o", markersize=3, label=label, **style)
    if lows != highs:
        ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2)


def plot_extrapolation(results: Comparison, path: str | Path) -> None:
    """Headline metric by position (log-x buckets) at the longest length, one line per variant; falls back to
    metric by evaluated length for per-sequence metrics. The training length is marked."""
    metric, train_length, longest = results.metric, results.train_length, results.eval_lengths[-1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, runs in results.variants.items():
        if metric in runs[0].at(longest).buckets:
            _draw(ax, *_curve(runs, lambda run: run.at(longest).buckets[metric]), variant)
            ax.set_xlabel("position (power-of-2 buckets, drawn at their end)")
        else:
            lengths = results.eval_lengths
            values = [[run.at(n).at_length[metric] for run in runs] for n in lengths]
            _draw(ax, lengths, [sum(v) / len(v) for v in values], [min(v) for v in values],
                  [max(v) for v in values], variant)
            ax.set_xlabel("evaluated length")
    ax.axvline(train_length, color="grey", linestyle="--", linewidth=1, label=f"training length {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_ylabel(metric)
    ax.set_title(f"{results.source}: {metric} beyond the training length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _layer_mean(row: LengthEval, stat: str) -> list[Bucket]:
    """Buckets of one diagnostic averaged over layers."""
    layers = [layer[stat] for layer in row.diagnostics if stat in layer]
    if not layers:
        return []
    return [Bucket(rows[0].lo, rows[0].hi, sum(r.mean for r in rows) / len(rows), rows[0].count)
            for rows in zip(*layers)]


def plot_diagnostics(results: Comparison, path: str | Path) -> None:
    """1/w_max (effective attended tokens) and attention-output RMS before/after out-norm by position,
    averaged over layers and heads, at the longest evaluated length."""
    longest = results.eval_lengths[-1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("inv_wmax", "1 / w_max (effective attended tokens)"), ("rms_pre", "attention output RMS"))
    for ax, (stat, title) in zip(axes, panels):
        for variant, runs in results.variants.items():
            if not _layer_mean(runs[0].at(longest), stat):
                continue
            _draw(ax, *_curve(runs, lambda run: _layer_mean(run.at(longest), stat)), variant)
            if stat == "rms_pre" and results.specs.get(variant, {}).get("out_norm", "none") != "none":
                _draw(ax, *_curve(runs, lambda run: _layer_mean(run.at(longest), "rms_post")),
                      f"{variant} (after out-norm)", linestyle=":")
        ax.axvline(results.train_length, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query position (power-of-2 buckets, drawn at their end)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
