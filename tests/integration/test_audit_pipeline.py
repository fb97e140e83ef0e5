"""The recorder next to a real pipeline (quickstart on nats-server): every trajectory and
scored event of the run is in the JSONL once, and ``dora.report`` reads and plots the run."""

from __future__ import annotations

from pathlib import Path

import yaml

from dora.audit import RunRecorder
from dora.bus import NatsBus
from dora.pipeline import load_pipeline
from dora.report import load_run, render_report, summarize

COUNT = 24


async def test_recorder_beside_quickstart(
    nats_bus: NatsBus, repo_root: Path, tmp_path: Path
) -> None:
    spec = yaml.safe_load((repo_root / "pipelines" / "echo.yaml").read_text())
    for entry in spec["stages"]:
        if entry["type"] == "prompt_source":
            entry["config"]["count"] = COUNT
        if entry["type"] == "counting_sink":
            entry["config"]["expect"] = COUNT
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"

    async with RunRecorder(nats_bus, run_dir) as recorder:
        summary = await load_pipeline(path, bus=nats_bus, run_dir=run_dir).run()
    assert summary["completed"]
    assert recorder.stats.written["trajectories"] == COUNT
    assert recorder.stats.written["scored"] == COUNT
    assert recorder.stats.rejected == 0

    run = load_run(run_dir)
    assert run.problems == []
    assert len({t.request_id for t in run.trajectories}) == COUNT
    assert len(run.scored) == COUNT
    correct = summary["stages"]["sink"]["correct"]
    assert sum(s.correct for s in run.scored) == correct
    s = summarize(run)
    assert (s.trajectories, s.reprefilled_tokens, s.migrations_ok) == (COUNT, 0, 0)
    assert render_report(run).stat().st_size > 10_000
