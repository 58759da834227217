"""Plots of a `Comparison` (matplotlib, Agg backend): the headline metric by evaluated length and by position
(`plot_extrapolation`), and attention diagnostics by position (`plot_diagnostics`).

Every figure of a report draws a variant in one style (`variant_styles`: colour and hollow marker; earlier
variants are drawn wider, so that a curve covered by a later one still shows on both sides), the spread over
seeds as a min-max band when there are several, the chance level as a dashed black line, the training length
as a dotted grey line, a seed's infinite value as a cross at the edge and an off-scale one (`OFF_SCALE`) as a
triangle, and one legend outside the axes. With bases (``base/variant`` runs, `tables.groups`)
each base has its own panels, on shared y axes, and a variant has the same style in every base."""

from __future__ import annotations

import math
from pathlib import Path

from lengthgen.atomic import atomic_write_figure
from lengthgen.eval.results import Bucket, Comparison, LengthEval
from lengthgen.report.tables import averaged_over, chance_level, groups, times

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

MARKERS = "osD^vP*Xh<>p"
#: variant colours in order: matplotlib's ten (C0-C9, tab20's dark half), then tab20's light half, so that up to 20
#: variants each have a colour of their own
COLORS = [matplotlib.colors.to_hex(c) for c in (*matplotlib.colormaps["tab20"].colors[::2],
                                                 *matplotlib.colormaps["tab20"].colors[1::2])]
CHANCE_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.2}
TRAIN_STYLE = {"color": "grey", "linestyle": ":", "linewidth": 1.5}
#: where a seed's value is infinite: a cross at the top edge of the panel (-inf: the bottom), in the variant's color;
#: each further variant infinite at that length `INF_STEP` (a fraction of the panel's height) further in
INF_STYLE = {"marker": "x", "linestyle": "none", "markersize": 8, "markeredgewidth": 2, "gid": "infinite"}
INF_STEP = 0.05
#: a finite value of a lower-is-better headline above OFF_SCALE x the largest chance level of its figure (a blow-up,
#: e.g. a loss of 1e9, whose linear y axis flattened every other curve) is off the scale: a triangle at the top edge
#: (stacked with the crosses), with a legend entry; the tables keep its number
OFF_SCALE = 100
OFF_STYLE = {**INF_STYLE, "marker": "^", "markeredgewidth": 1.5, "gid": "off-scale"}
EDGE_GIDS = (INF_STYLE["gid"], OFF_STYLE["gid"])


def variant_styles(variants) -> dict[str, dict]:
    """Variant -> matplotlib style, by order: a colour (`COLORS`) and a marker of its own, and a line width and
    marker size falling from the first variant (drawn first, widest) to the last."""
    names = list(variants)
    wide = [1 - i / max(1, len(names) - 1) for i in range(len(names))]         # 1 for the first, 0 for the last
    return {name: {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)], "markerfacecolor": "none",
                   "linewidth": 1.2 + 2.4 * wide[i], "markersize": 4 + 5 * wide[i], "markeredgewidth": 1.2}
            for i, name in enumerate(names)}


def _draw(ax, xs: list[float], per_x: list[list[float]], style: dict, top: float | None = None, **extra) -> None:
    """Mean over seeds at each x, and the min-max band when there are several seeds (NaN values dropped); where a
    seed's value is infinite (a model whose output was not finite), no mean but a cross at the top edge (at the
    bottom edge for -inf, a higher-is-better metric's worst; `INF_STYLE`), and where it is finite but above ``top``
    (off the scale, `OFF_SCALE`) a triangle there, inside the marks that variants drawn before have there
    (`INF_STEP`), rather than over them; the line and band break where there is no mean, rather than join its
    neighbours across it (a mean between two breaks has its band as a bar); ``extra``: more line properties
    (``gid`` names the curve)."""
    points = [(x, [v for v in vs if not math.isnan(v)]) for x, vs in zip(xs, per_x)]
    edge = {x: INF_STYLE if any(math.isinf(v) for v in vs) else OFF_STYLE for x, vs in points
            if any(math.isinf(v) or (top is not None and v > top) for v in vs)}
    for marker in (INF_STYLE, OFF_STYLE):
        at = [x for x, m in edge.items() if m is marker]
        if not at:
            continue
        bottom = [min(vs) == -math.inf for x, vs in points if x in at]    # -inf: a higher-is-better metric's worst
        drawn = [(x, y < 0.5) for line in ax.get_lines() if line.get_gid() in EDGE_GIDS
                 for x, y in zip(*line.get_data())]          # the marks of the variants drawn before: stack on them
        ax.plot(at, [INF_STEP * drawn.count((x, b)) if b else 1 - INF_STEP * drawn.count((x, b))
                     for x, b in zip(at, bottom)],
                **{**marker, "color": style["color"]}, transform=ax.get_xaxis_transform(), clip_on=False)
    shown = [vs if x not in edge else [] for x, vs in points]
    if not any(shown):
        return
    x = [p[0] for p in points]
    ax.plot(x, [sum(vs) / len(vs) if vs else math.nan for vs in shown], **{**style, **extra})
    if any(len(vs) > 1 for vs in shown):
        ax.fill_between(x, [min(vs) if vs else math.nan for vs in shown],
                        [max(vs) if vs else math.nan for vs in shown], color=style["color"], alpha=0.15, linewidth=0)
        alone = [i for i, vs in enumerate(shown) if min(vs, default=0) < max(vs, default=0) and not any(
            0 <= j < len(shown) and shown[j] for j in (i - 1, i + 1))]      # no band to either side: a bar
        if alone:
            ax.vlines([x[i] for i in alone], [min(shown[i]) for i in alone], [max(shown[i]) for i in alone],
                      color=style["color"], alpha=0.3, linewidth=6)


def _by_bucket(rows: list[list[Bucket]]) -> tuple[list[int], list[list[float]]]:
    """Bucket ends (x) and each bucket's value per seed, from one bucket list per seed."""
    return [b.hi for b in rows[0]], [[seed[i].mean for seed in rows] for i in range(len(rows[0]))]


def _styles(results: Comparison) -> tuple[dict[str, list[str]], dict[str, dict], dict[str, dict]]:
    """(groups of variants, style of each variant, style of each legend entry): with bases, a variant's style
    and legend entry are those of its name without the base (``x`` for ``a/x`` and ``b/x``)."""
    grouped, short = groups(results), _legend_names(results)
    legend = variant_styles(dict.fromkeys(short.values()))
    return grouped, {name: legend[short[name]] for name in results.variants}, legend


def _legend_names(results: Comparison) -> dict[str, str]:
    """Variant -> its legend entry: its name without the base with several bases (``x`` for ``a/x`` and ``b/x``)."""
    several = len(groups(results)) > 1
    return {name: name.split("/", 1)[1] if several else name for name in results.variants}


def _titled(group: str, title: str) -> str:
    return f"{group}: {title}" if group else title


def _suptitle(fig, text: str) -> None:
    """The figure's title 0.1 inch below its top edge, whatever its height (tight_layout keeps the axes below)."""
    fig.suptitle(text, y=1 - 0.1 / fig.get_figheight())


def _legend(fig, results: Comparison, styles: dict[str, dict], extra: list) -> None:
    """The figure's legend outside its axes: each variant (``not drawn: no finite value`` when no panel shows it,
    e.g. a diverged run's NaN diagnostics), ``extra``, the infinite and off-scale values' marks and the seed band
    when used."""
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    short = _legend_names(results)      # a curve's gid is its variant's name
    shown = {short[line.get_gid()] for line in lines if line.get_gid() in short} | {
        line.get_color() for line in lines if line.get_gid() in EDGE_GIDS}
    handles = [Line2D([], [], **style, label=name if {name, style["color"]} & shown
                      else f"{name} (not drawn: no finite value)") for name, style in styles.items()] + extra
    marks = {line.get_gid() for line in lines}
    if INF_STYLE["gid"] in marks:
        handles.append(Line2D([], [], **{**INF_STYLE, "color": "black"}, label="a seed's value is infinite"))
    if OFF_STYLE["gid"] in marks:
        handles.append(Line2D([], [], **{**OFF_STYLE, "color": "black"},
                              label=f"a seed's value is off the scale (> {OFF_SCALE} x chance; see the tables)"))
    seeds = max(len(runs) for runs in results.variants.values())
    if seeds > 1:
        handles.append(Patch(color="grey", alpha=0.3, label=f"min-max over seeds (up to {seeds})"))
    fig.tight_layout()
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def _log2_axis(ax, train_length: int, label: str) -> None:
    ax.axvline(train_length, **TRAIN_STYLE)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)


def _dense(results: Comparison, metric: str, length: int) -> bool:
    """Whether ``metric`` is measured at most positions (in at least half of the buckets) at ``length``: then
    it is worth plotting by position; per-sequence or per-query metrics are plotted by length only."""
    row = next(iter(results.variants.values()))[0].at(length)
    buckets = row.buckets.get(metric, [])
    return bool(buckets) and 2 * sum(b.count > 0 for b in buckets) >= len(buckets)


def plot_extrapolation(results: Comparison, path: str | Path) -> None:
    """`extrapolation_figure` as a PNG."""
    save_figure(extrapolation_figure(results), path)


def plot_diagnostics(results: Comparison, path: str | Path) -> None:
    """`diagnostics_figure` as a PNG."""
    save_figure(diagnostics_figure(results), path)


def extrapolation_figure(results: Comparison):
    """The headline metric at each evaluated length (mean over positions [L/2, L)) and, for metrics measured at
    most positions, by position at the longest length; chance level and training length marked. With bases:
    a row of those panels per base, or for by-length panels only, one panel per base, four to a row."""
    metric, lengths, train_length = results.metric, results.eval_lengths, results.train_length
    longest = lengths[-1]
    grouped, styles, legend_styles = _styles(results)
    by_position = _dense(results, metric, longest)
    cols = 2 if by_position else min(4, len(grouped))
    rows = len(grouped) if by_position else -(-len(grouped) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11 if by_position else 6.5 if cols == 1 else 4.4 * cols, 4.2 * rows),
                             squeeze=False, sharey="col" if by_position else "all")
    panels = [list(row) for row in axes] if by_position else [[ax] for ax in axes.flat]
    for ax in (ax for row in panels[len(grouped):] for ax in row):      # the last row's empty slots
        ax.set_visible(False)
    chance = [chance_level(results, metric, n) for n in lengths]
    levels = [c for c in chance if c is not None and c > 0]
    top = None if results.higher_is_better or not levels else OFF_SCALE * max(levels)    # above: off the scale
    over = averaged_over(results, metric)
    for (group, names), row in zip(grouped.items(), panels):
        ax = row[0]
        for variant in names:
            runs = results.variants[variant]
            _draw(ax, lengths, [[run.at(n).at_length.get(metric, math.nan) for run in runs] for n in lengths],
                  styles[variant], top, gid=variant)
        if len(lengths) == 1 and chance[0] is not None:     # a line through one point: across the panel instead
            ax.axhline(chance[0], **CHANCE_STYLE)
            ax.autoscale(axis="y")                  # axhline keeps the y limits it finds when they hold the line
        elif any(c is not None for c in chance):
            ax.plot(lengths, [math.nan if c is None else c for c in chance], **CHANCE_STYLE)
        _log2_axis(ax, train_length, "evaluated length L (tokens)")
        ax.set_xticks(lengths, [f"{n}\n{times(n, train_length)}" for n in lengths])
        ax.minorticks_off()
        ax.set_ylabel(f"{metric} at length L\n({over})")
        ax.set_title(_titled(group, f"{metric} by evaluated length"))
        ax.yaxis.set_tick_params(labelleft=True)
        if by_position:
            ax = row[1]
            for variant in names:
                runs = results.variants[variant]
                _draw(ax, *_by_bucket([run.at(longest).buckets[metric] for run in runs]), styles[variant], top,
                      gid=variant)
            chance_rows = results.variants[names[0]][0].at(longest).chance_buckets.get(metric)
            if chance_rows and chance[-1] is not None:      # None: the variants' chance levels differ
                ax.plot([b.hi for b in chance_rows], [b.mean for b in chance_rows], **CHANCE_STYLE)
            _log2_axis(ax, train_length,
                       f"position in a length-{longest} sequence\n(each bucket [lo, hi) drawn at hi)")
            ax.set_ylabel(f"{metric}, mean over the bucket")
            ax.set_title(_titled(group, f"{metric} by position at length {longest}"))
    arrow = "higher is better" if results.higher_is_better else "lower is better"
    _suptitle(fig, f"{results.source}: {metric} beyond the training length ({arrow})")
    extra = [Line2D([], [], **TRAIN_STYLE, label=f"training length {train_length}")]
    if any(c is not None for c in chance):
        extra.insert(0, Line2D([], [], **CHANCE_STYLE, label="chance (trivial baseline)"))
    _legend(fig, results, legend_styles, extra)
    return fig


def _layer_mean(row: LengthEval, stat: str) -> list[Bucket]:
    """Buckets of one diagnostic averaged over layers (empty when not recorded)."""
    layers = [layer[stat] for layer in row.diagnostics if stat in layer]
    if not layers:
        return []
    return [Bucket(rows[0].lo, rows[0].hi, sum(r.mean for r in rows) / len(rows), rows[0].count)
            for rows in zip(*layers)]


def diagnostics_figure(results: Comparison):
    """1/w_max of the softmax distribution (effective number of attended keys; before p-softmax's rescaling) and
    the RMS of the attention output before (solid) and after (dashed) out-norm by query position, averaged over
    layers and heads, at the longest evaluated length, on log y axes (a blown-up run's RMS, finite but 1e7 times
    the others', flattened them on a linear one); a row per base with bases."""
    longest = results.eval_lengths[-1]
    grouped, styles, legend_styles = _styles(results)
    fig, axes = plt.subplots(len(grouped), 2, figsize=(11, 4.2 * len(grouped)), squeeze=False, sharey="col")
    panels = (("inv_wmax", "1 / max_j softmax_ij (effective attended keys)"),
              ("rms_pre", "attention output RMS per head"))
    out_norm = False
    for (group, names), row in zip(grouped.items(), axes):
        for ax, (stat, label) in zip(row, panels):
            for variant in names:
                runs = results.variants[variant]
                rows = [_layer_mean(run.at(longest), stat) for run in runs]
                if not all(rows):
                    continue
                _draw(ax, *_by_bucket(rows), styles[variant], gid=variant)
                if stat == "rms_pre" and results.specs.get(variant, {}).get("out_norm", "none") != "none":
                    out_norm = True
                    _draw(ax, *_by_bucket([_layer_mean(run.at(longest), "rms_post") for run in runs]),
                          styles[variant], linestyle="--", gid=f"{variant} after out-norm")
            _log2_axis(ax, results.train_length, f"query position in a length-{longest} sequence\n"
                                                 "(each bucket [lo, hi) drawn at hi)")
            ax.set_ylabel(label)
            ax.set_title(_titled(group, label.split(" (")[0] + " by position"))
            ax.set_yscale("log")        # positive quantities: a blown-up run's RMS (1e7) leaves the others readable
    _suptitle(fig, f"{results.source}: attention diagnostics at length {longest} (mean over layers and heads)")
    extra = [Line2D([], [], **TRAIN_STYLE, label=f"training length {results.train_length}")]
    if out_norm:
        extra.append(Line2D([], [], color="grey", linestyle="--", label="RMS after out-norm"))
    _legend(fig, results, legend_styles, extra)
    return fig


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Write the pyplot figure ``fig`` as a PNG at ``path`` (atomically), then close it, saved or not."""
    try:
        atomic_write_figure(fig, path, dpi=dpi, bbox_inches="tight")
    finally:                                  # pyplot keeps every open figure: close it, saved or not
        plt.close(fig)
