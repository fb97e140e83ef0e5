"""Run reports: load a run directory (recorder JSONL + learner metrics), summarize, plot.

``load_run(run_dir) -> RunData``, ``render_report(run, out) -> Path`` (``report.png``),
``summarize(run) -> Summary`` and ``summary_table(summary)`` (rich) are what the main job and
``dora report`` call; ``report_figure(run) -> Figure`` is the same figure, unsaved.
"""

from dora.report.derive import Staleness, Summary, staleness, summarize
from dora.report.load import RunData, load_run
from dora.report.plots import render_report, report_figure
from dora.report.summary import summary_table

__all__ = [
    "RunData",
    "Staleness",
    "Summary",
    "load_run",
    "render_report",
    "report_figure",
    "staleness",
    "summarize",
    "summary_table",
]
