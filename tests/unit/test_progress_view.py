"""The console's progress: one view for a run in one process and for ``--processes``, whose
stage processes each report their counters and the supervisor adds replicas up."""

from __future__ import annotations

from io import StringIO

from rich.console import Console

from dora.cli import progress_view
from dora.cli.progress_view import ProgressView, plain_line, progress_rows
from dora.pipeline.processes import add_replica


def stats(processed: int, **extra: int) -> dict[str, int]:
    base = dict.fromkeys(("received", "published", "retried", "dead_lettered"), 0)
    return {**base, "processed": processed, **extra}


def test_replicas_add_their_counts_and_keep_the_stage_total() -> None:
    merged: dict = {}
    add_replica(merged, "generator", {"replicas": 1, "stats": stats(3), "done": 40, "total": 9})
    add_replica(merged, "generator", {"replicas": 1, "stats": stats(4), "done": 2, "total": 9})
    add_replica(merged, "learner", {"replicas": 1, "stats": stats(0), "done": 5, "total": 50})
    assert merged["generator"]["replicas"] == 2
    assert merged["generator"]["done"] == 42 and merged["generator"]["total"] == 9
    assert merged["generator"]["stats"]["processed"] == 7
    rows = progress_rows(merged)
    assert rows[0][:3] == ("generator", 42, 9) and rows[1][:3] == ("learner", 5, 50)
    assert plain_line(rows, "processes 8/8 running") == (
        "progress  generator 42/9 | learner 5/50 | processes 8/8 running"
    )


def test_a_stage_without_its_own_count_shows_what_it_processed() -> None:
    rows = progress_rows({"verifier": {"replicas": 1, "stats": stats(12, retried=1)}})
    assert rows == [("verifier", 12, None, "in 0 out 0 retried 1 dead 0")]


def test_off_a_terminal_the_view_prints_plain_lines(monkeypatch) -> None:
    monkeypatch.setattr(progress_view, "PLAIN_EVERY_S", 0.0)
    out = StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with ProgressView(console) as view:
        view.show([("learner", 1, 3, "")])
        view.show([("learner", 2, 3, ""), ("generator", 7, None, "")], "processes 2/2")
    lines = [line for line in out.getvalue().splitlines() if line.startswith("progress")]
    assert lines == ["progress  learner 1/3", "progress  learner 2/3 | generator 7 | processes 2/2"]
