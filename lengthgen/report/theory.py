"""Seed 004's extreme-value results (rows of `lengthgen.experiments.theory.theory_table`) as a plot and a
text table."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lengthgen.atomic import atomic_write_figure


def plot_theory(rows: Sequence[dict], path) -> None:
    """PNG of E[1/w_max] vs n (log x), one line per r with error bars, dashed line at each limit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    rs = list(dict.fromkeys(row["r"] for row in rows))
    for i, r in enumerate(rs):
        color = f"C{i}"
        sel = sorted((row for row in rows if row["r"] == r), key=lambda row: row["n"])
        ns = [row["n"] for row in sel]
        ax.errorbar(ns, [row["monte_carlo"] for row in sel], yerr=[row["stderr"] for row in sel],
                    color=color, marker="o", ms=4, capsize=3, label=f"r = {r:g} (direct MC, bars: ±1 standard error)")
        if all(row.get("conditional") is not None for row in sel):
            ax.plot(ns, [row["conditional"] for row in sel], color=color, ls=":", lw=1.2,
                    label=f"r = {r:g} (conditional MC)")
        if sel and sel[0].get("limit") is not None:
            ax.axhline(sel[0]["limit"], color=color, ls="--", lw=1, label=f"limit 1 + 1/(r-1) = {sel[0]['limit']:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (number of keys)")
    ax.set_ylabel(r"$E[1/w_{\max}]$")
    ax.set_title(r"softmax($r\sqrt{2\log n}\,z$), $z\sim N(0,I_n)$: top weight vs n")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    atomic_write_figure(fig, path, dpi=120)


def theory_text(rows: Sequence[dict]) -> str:
    """The rows of `lengthgen.experiments.theory.theory_table` as an aligned text table."""
    head = ["r", "n", "trials", "direct MC", "stderr", "conditional MC", "stderr", "limit", "limit - cond"]
    body = []
    for row in rows:
        lim = row["limit"]
        body.append([
            f"{row['r']:g}",
            f"2^{math.log2(row['n']):g}" if row["n"] & (row["n"] - 1) == 0 else str(row["n"]),
            str(row["trials"]),
            f"{row['monte_carlo']:.4f}",
            f"{row['stderr']:.4f}",
            f"{row['conditional']:.4f}",
            f"{row['conditional_stderr']:.4f}",
            "inf" if lim is None else f"{lim:.4f}",
            "inf" if lim is None else f"{lim - row['conditional']:.4f}",
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, body)])


__all__ = ["plot_theory", "theory_text"]
