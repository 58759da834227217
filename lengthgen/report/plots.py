"""Plots of a compare ``results`` dict (matplotlib, Agg backend): metric by position and diagnostics."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _x(row: dict) -> float:
    """A bucket [lo, hi) is drawn at hi: the context length its positions reach."""
    return row["hi"]


def _curve(runs: list[dict], pick) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min, max over seeds of the bucket rows ``pick(run)`` (NaN buckets dropped)."""
    per_seed = [pick(run) for run in runs]
    xs, means, lows, highs = [], [], [], []
    for i, row in enumerate(per_seed[0]):
        values = [rows[i]["mean"] for rows in per_seed if not math.isnan(rows[i]["mean"])]
        if values:
            xs.append(_x(row))
            means.append(sum(values) / len(values))
            lows.append(min(values))
            highs.append(max(values))
    return xs, means, lows, highs


def _draw(ax, xs, means, lows, highs, label, **style) -> None:
    line, = ax.plot(xs, means, marker="o", markersize=3, label=label, **style)
    if lows != highs:
        ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2)


def plot_extrapolation(results: dict, path: str | Path) -> None:
    """Headline metric by position (log-x buckets) at the longest length, one line per variant; falls back to
    metric by evaluated length for per-sequence metrics. The training length is marked."""
    metric, train_length = results["metric"], results["train_length"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, runs in results["variants"].items():
        if metric in runs[0]["evals"][-1]["buckets"]:
            _draw(ax, *_curve(runs, lambda run: run["evals"][-1]["buckets"][metric]), variant)
            ax.set_xlabel("position (power-of-2 buckets, drawn at their end)")
        else:
            lengths = results["eval_lengths"]
            values = [[run["evals"][i]["at_length"][metric] for run in runs] for i in range(len(lengths))]
            _draw(ax, lengths, [sum(v) / len(v) for v in values], [min(v) for v in values],
                  [max(v) for v in values], variant)
            ax.set_xlabel("evaluated length")
    ax.axvline(train_length, color="grey", linestyle="--", linewidth=1, label=f"training length {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_ylabel(metric)
    ax.set_title(f"{results['task']}: {metric} beyond the training length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _layer_mean(evals: dict, stat: str) -> list[dict]:
    """Bucket rows of one diagnostic averaged over layers."""
    layers = [layer[stat] for layer in evals.get("diagnostics", []) if stat in layer]
    if not layers:
        return []
    return [{"lo": rows[0]["lo"], "hi": rows[0]["hi"],
             "mean": sum(r["mean"] for r in rows) / len(rows)} for rows in zip(*layers)]


def plot_diagnostics(results: dict, path: str | Path) -> None:
    """1/w_max (effective attended tokens) and attention-output RMS before/after out-norm by position,
    averaged over layers and heads, at the longest evaluated length."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("inv_wmax", "1 / w_max (effective attended tokens)"), ("rms_pre", "attention output RMS"))
    for ax, (stat, title) in zip(axes, panels):
        for variant, runs in results["variants"].items():
            if not _layer_mean(runs[0]["evals"][-1], stat):
                continue
            _draw(ax, *_curve(runs, lambda run: _layer_mean(run["evals"][-1], stat)), variant)
            if stat == "rms_pre":
                if results.get("specs", {}).get(variant, {}).get("out_norm", "none") != "none":
                    _draw(ax, *_curve(runs, lambda run: _layer_mean(run["evals"][-1], "rms_post")),
                          f"{variant} (after out-norm)", linestyle=":")
        ax.axvline(results["train_length"], color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query position (power-of-2 buckets, drawn at their end)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
