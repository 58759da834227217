"""Retrieval maps from results: heatmaps of exact match by needle depth and context length, one panel per variant
on one colour scale with the chance level and the training length marked (`plot_needle`), and markdown
(`needle_markdown` for ``lengthgen needle``, `needle_section` for a comparison's ``report.md``)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from lengthgen.atomic import atomic_write_text
from lengthgen.config import counted
from lengthgen.eval.results import Comparison, NeedleMap
from lengthgen.report.plots import save_figure
from lengthgen.report.tables import length_label, mean, table, times

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

#: the heatmap beside ``needle.md`` or a comparison's ``report.md``
NEEDLE_PLOT = "needle.png"
DEPTH = ("depth = the fraction of the filler before the needle (0: at the start, 1: right before the query); "
         "exact match = the greedy answer is right, every token (teacher-forced: the argmax at each answer token)")
TRAIN_LINE = {"color": "black", "linestyle": "--", "linewidth": 2.0}
#: variants' panels to a row
PER_ROW = 4


def variant_maps(results: Comparison) -> dict[str, list[NeedleMap]]:
    """Variant -> its runs' maps (one per seed), for the variants whose every run has one."""
    return {name: [run.needle for run in runs] for name, runs in results.variants.items()
            if runs and all(run.needle is not None for run in runs)}


def mean_grid(maps: list[NeedleMap], value: str = "exact_match") -> list[list[float]]:
    """``value`` by depth (rows) and length (columns) of the first map, the mean over the maps holding the cell."""
    cells = [{(c.depth, c.length): getattr(c, value) for c in m.cells} for m in maps]
    return [[mean([at.get((depth, length), math.nan) for at in cells]) for length in maps[0].lengths]
            for depth in maps[0].depths]


def _chance(nmap: NeedleMap, value: str = "exact_match") -> float | None:
    return next((c.chance[value] for c in nmap.cells if value in c.chance), None)


def _length_labels(nmap: NeedleMap) -> list[str]:
    train = nmap.train_length
    return [f"{n}" + (f"\n{times(n, train)}" if train else "") for n in nmap.lengths]


def needle_figure(maps: dict[str, list[NeedleMap]]):
    """Exact match by depth (rows) and length (columns) per variant, mean over its seeds, on one colour scale
    [0, 1], each panel titled by its variant (wrapped to the panel's width), `PER_ROW` panels to a row; a dashed
    line after the last length within the training length; the chance level on the colour bar."""
    first = next(iter(maps.values()))[0]
    depths, lengths = first.depths, first.lengths
    panel = 0.8 + 0.75 * len(lengths)                # inches per panel
    cols = min(PER_ROW, len(maps))
    rows = -(-len(maps) // cols)
    height = max(2.6, 1.2 + 0.35 * len(depths))      # inches per row
    fig, axes = plt.subplots(rows, cols, squeeze=False, sharey=True, layout="constrained",
                             figsize=(2.4 + cols * panel, 1.0 + rows * height))
    for ax in axes.flat[len(maps):]:                 # the last row's empty slots
        ax.set_visible(False)
    for ax, (name, runs) in zip(axes.flat, maps.items()):
        grid = mean_grid(runs)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, "n/a" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if 0.2 <= value <= 0.8 else "white")
        ax.set_xticks(range(len(lengths)), _length_labels(first), fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
        ax.set_xlabel("context length L (tokens)")
        seeds = [f"(mean of {len(runs)} seeds)"] if len(runs) > 1 else []
        ax.set_title("\n".join(textwrap.wrap(name, int(panel * 13)) + seeds), fontsize=10)   # within its panel
        if first.train_length:
            ax.axvline(sum(n <= first.train_length for n in lengths) - 0.5, **TRAIN_LINE)
    for row in axes:
        row[0].set_ylabel("needle depth\n(0: start, 1: before the query)")        # two lines: fits 3 depths
    bar = fig.colorbar(image, ax=axes.flat[:len(maps)], fraction=0.05, pad=0.02)
    chance = _chance(first)
    if chance is not None:
        bar.ax.axhline(chance, color="black", linewidth=2)
    bar.set_label("exact match" + (f" (black line: chance {chance:.2g})" if chance is not None else ""))
    trained = f"; dashed line: training length {first.train_length}" if first.train_length else ""
    fig.suptitle(f"{first.source}: needle retrieval by depth and context length\n{counted(first.needles, 'needle')} "
                 f"per context, {counted(first.cells[0].samples, 'sequence')} per cell{trained}", fontsize=10)
    return fig


def plot_needle(maps: dict[str, list[NeedleMap]], path: str | Path) -> None:
    """`needle_figure` as a PNG."""
    save_figure(needle_figure(maps), path, dpi=110)


def _header(nmap: NeedleMap, first: str) -> list[str]:
    train = nmap.train_length
    return [first, *(length_label(n, train) if train else str(n) for n in nmap.lengths)]


def grid_rows(maps: list[NeedleMap], value: str, spec: str = ".2f") -> list[list[str]]:
    """A table of ``value`` by depth and length (mean over the maps), with the mean over depths last."""
    grid = mean_grid(maps, value)
    rows = [[f"{d:g}", *(format(v, spec) for v in row)] for d, row in zip(maps[0].depths, grid)]
    return [_header(maps[0], "depth"), *rows, ["mean", *(format(mean(column), spec) for column in zip(*grid))]]


def needle_markdown(nmap: NeedleMap) -> str:
    """``needle.md`` of ``lengthgen needle``: what was measured, the exact-match and answer-loss tables, the map."""
    model = nmap.run_dir or nmap.config.get("hf_model", "the model")
    lines = [f"# Retrieval map: {nmap.source}", "",
             f"- **Model**: `{model}`" + (", its BEMA weights" if nmap.bema else "")
             + (f", training length {nmap.train_length}" if nmap.train_length else ""),
             f"- **Needles**: {nmap.needles} per context, {counted(nmap.cells[0].samples, 'sequence')} per cell, "
             f"evaluation seed {nmap.eval_seed} (every depth of one length sees the same haystacks; only the needles "
             "move)",
             f"- **Compute**: {nmap.provenance.device}, {nmap.eval_seconds} s; lengthgen {nmap.provenance.lengthgen}, "
             f"torch {nmap.provenance.torch}, {nmap.provenance.date}", "", f"{DEPTH}.", ""]
    for value, title, spec in (("exact_match", "Exact match", ".2f"),
                               ("answer_loss", "Answer loss (mean cross-entropy of the answer tokens, nats)", ".3f")):
        chance = _chance(nmap, value)
        lines += [f"## {title}", "", *([f"Chance: {chance:.3g}.", ""] if chance is not None else []),
                  *table(grid_rows([nmap], value, spec)), ""]
    lines += [f"![retrieval map]({NEEDLE_PLOT})", "", "Every cell: `needle.json`.", ""]
    return "\n".join(lines)


def write_needle(nmap: NeedleMap, out: str | Path) -> list[Path]:
    """Write ``needle.json``, ``needle.md`` and `NEEDLE_PLOT` of a standalone map into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [nmap.save(out / "needle.json"), out / "needle.md", out / NEEDLE_PLOT]
    atomic_write_text(paths[1], needle_markdown(nmap))
    plot_needle({Path(nmap.run_dir or nmap.config.get("hf_model", nmap.source)).name: [nmap]}, paths[2])
    return paths


def needle_section(results: Comparison) -> list[str]:
    """``report.md``'s retrieval maps: the heatmap, then exact match by variant and length: the mean over depths
    and seeds, [min, max] over seeds of each seed's mean over depths when there are several, and the worst depth
    (of the mean over seeds); nothing when the runs have no maps."""
    maps = variant_maps(results)
    if not maps:
        return []
    first = next(iter(maps.values()))[0]
    chance = _chance(first)
    rows = [_header(first, "variant")]
    for name, runs in maps.items():
        columns = zip(*mean_grid(runs))
        per_seed = list(zip(*([mean(column) for column in zip(*mean_grid([run]))] for run in runs)))
        rows.append([name, *(f"{mean(column):.2f}" + (f" [{min(seeds):.2f}, {max(seeds):.2f}]" if len(seeds) > 1
                                                     else "") + f", worst depth {min(column):.2f}"
                             for column, seeds in zip(columns, per_seed))])
    return ["## Retrieval maps", "", f"![exact match by needle depth and context length]({NEEDLE_PLOT})", "",
            f"`{NEEDLE_PLOT}`: exact match of {counted(first.needles, 'needle')} per context at depths "
            f"{', '.join(f'{d:g}' for d in first.depths)}, {counted(first.cells[0].samples, 'sequence')} per cell, "
            f"mean over seeds; {DEPTH}" + (f"; chance {chance:.3g}" if chance is not None else "") + ".", "",
            "Cells: mean over depths and seeds, [min, max] over seeds (of each seed's mean over depths) when "
            "several, and the worst depth's mean over seeds.", "", *table(rows), ""]


__all__ = ["NEEDLE_PLOT", "grid_rows", "mean_grid", "needle_figure", "needle_markdown", "needle_section",
           "plot_needle", "variant_maps", "write_needle"]
