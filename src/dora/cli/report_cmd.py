"""``dora report RUN_DIR``: plots a recorded run into ``report.png``, prints its summary and
saves the summary numbers next to the PNG (``report.json``) for scripts and benchmarks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer


def cli(
    run_dir: Annotated[
        Path, typer.Argument(help="Run directory (holds events/ and metrics.jsonl).")
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="PNG to write (default RUN_DIR/report.png).")
    ] = None,
) -> None:
    """Plot a run (engines x versions, load, staleness, reward, throughput) and summarize it."""
    from rich.console import Console

    from dora.report import load_run, render_report, summarize, summary_table

    console = Console()
    if not run_dir.is_dir():
        console.print(f"[red]run directory {run_dir} does not exist[/red]")
        raise typer.Exit(2)
    if not (run_dir / "events").is_dir() and not (run_dir / "metrics.jsonl").is_file():
        console.print(
            f"[red]{run_dir} holds no recorded run[/red] (no events/ and no metrics.jsonl): "
            "give the folder `dora run` made (runs/<run_id>/)",
            highlight=False,
        )
        raise typer.Exit(2)
    run = load_run(run_dir)
    path = render_report(run, out)
    summary = summarize(run)
    numbers = path.with_suffix(".json")
    numbers.write_text(json.dumps(dataclasses.asdict(summary), indent=2) + "\n")
    console.print(summary_table(summary, title=f"dora run {run_dir.name}"))
    for problem in run.problems[:20]:
        console.print(f"[yellow]unreadable:[/yellow] {problem}")
    if len(run.problems) > 20:
        console.print(f"[yellow]... and {len(run.problems) - 20} more unreadable records[/yellow]")
    console.print(f"report: {path} (numbers: {numbers})")
