"""Reports from results: tables (`tables`, shared by the terminal and ``report.md``), ``report.md``
(`markdown`), plots (`plots`), retrieval maps (`needle`), the rule that names a winner (`stats`) and seed 004's
theory rows (`theory`). Nothing here trains or evaluates."""

from __future__ import annotations

from pathlib import Path

from lengthgen.atomic import atomic_write_text
from lengthgen.eval.results import Comparison
from lengthgen.report.markdown import DIAGNOSTICS, EXTRAPOLATION, has_diagnostics, markdown_report
from lengthgen.report.needle import NEEDLE_PLOT, plot_needle, variant_maps, write_needle
from lengthgen.report.plots import plot_diagnostics, plot_extrapolation
from lengthgen.report.stats import Verdict, verdict
from lengthgen.report.tables import position_table, run_summary, terminal_table, verdicts


def write_report(results: Comparison, out: str | Path) -> list[Path]:
    """Write ``report.md`` (embedding the plots), ``extrapolation.png``, ``diagnostics.png`` when the runs
    recorded attention diagnostics and ``needle.png`` when they have retrieval maps, for ``results`` into ``out``,
    deleting, where a report was, an optional plot that these results do not have (the results reported there
    before had it; a ``lengthgen needle`` map's own needle.png, beside its needle.json, stays); returns the paths
    written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / EXTRAPOLATION]
    stale = (out / "report.md").is_file()
    plot_extrapolation(results, paths[1])
    for name, plot, data in ((DIAGNOSTICS, plot_diagnostics, results if has_diagnostics(results) else None),
                             (NEEDLE_PLOT, plot_needle, variant_maps(results) or None)):
        if data is None:
            if stale and not (name == NEEDLE_PLOT and (out / "needle.json").is_file()):
                (out / name).unlink(missing_ok=True)
        else:
            paths.append(out / name)
            plot(data, paths[-1])
    atomic_write_text(paths[0], markdown_report(results))
    return paths


__all__ = ["Verdict", "markdown_report", "plot_diagnostics", "plot_extrapolation", "plot_needle", "position_table",
           "run_summary", "terminal_table", "verdict", "verdicts", "write_needle", "write_report"]
