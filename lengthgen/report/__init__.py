"""Reports from results: tables (`tables`) and plots (`plots`) of a `lengthgen.eval.Comparison` or `RunEval`,
and seed 004's theory rows (`theory`). Nothing here trains or evaluates."""

from __future__ import annotations

from pathlib import Path

from lengthgen.atomic import atomic_write_text
from lengthgen.eval.results import Comparison
from lengthgen.report.plots import plot_diagnostics, plot_extrapolation
from lengthgen.report.tables import markdown_report, position_table, run_summary, summarize, terminal_table


def write_report(results: Comparison, out: str | Path) -> list[Path]:
    """Write ``report.md``, ``extrapolation.png`` and ``diagnostics.png`` for ``results`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / "extrapolation.png", out / "diagnostics.png"]
    atomic_write_text(paths[0], markdown_report(results))
    plot_extrapolation(results, paths[1])
    plot_diagnostics(results, paths[2])
    return paths


__all__ = ["markdown_report", "plot_diagnostics", "plot_extrapolation", "position_table", "run_summary",
           "summarize", "terminal_table", "write_report"]
