"""Reports from result files: tables (`tables`) and plots (`plots`). Nothing here trains or evaluates."""

from __future__ import annotations

from pathlib import Path

from lengthgen.report.plots import plot_diagnostics, plot_extrapolation
from lengthgen.report.tables import markdown_report, summarize, terminal_table


def write_report(results: dict, out: str | Path) -> list[Path]:
    """Write ``report.md``, ``extrapolation.png`` and ``diagnostics.png`` for a compare ``results`` dict."""
    out = Path(out)
    paths = [out / "report.md", out / "extrapolation.png", out / "diagnostics.png"]
    paths[0].write_text(markdown_report(results))
    plot_extrapolation(results, paths[1])
    plot_diagnostics(results, paths[2])
    return paths


__all__ = ["markdown_report", "plot_diagnostics", "plot_extrapolation", "summarize", "terminal_table",
           "write_report"]
