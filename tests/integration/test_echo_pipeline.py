"""The echo pipeline end to end: `dora run` on the embedded nats-server, every prompt scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dora.bus.server import NatsServer
from dora.cli import app
from dora.pipeline import load_pipeline

COUNT = 24


def small_quickstart(repo_root: Path, tmp_path: Path) -> Path:
    spec = yaml.safe_load((repo_root / "pipelines" / "echo.yaml").read_text())
    for entry in spec["stages"]:
        if entry["type"] == "prompt_source":
            entry["config"]["count"] = COUNT
        if entry["type"] == "counting_sink":
            entry["config"]["expect"] = COUNT
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_dora_run_quickstart_on_embedded_nats(
    repo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dora.cli import progress_view

    monkeypatch.setattr(progress_view, "PLAIN_EVERY_S", 0.0)  # a line at every refresh
    run_dir = tmp_path / "run"
    args = ["run", str(small_quickstart(repo_root, tmp_path)), "--run-dir", str(run_dir)]
    result = CliRunner().invoke(app, [*args, "--run-id", "qs-test"])
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["run_id"] == "qs-test"
    stages = summary["stages"]
    assert stages["prompts"]["stats"]["published"] == COUNT
    assert stages["generator"]["stats"]["processed"] == COUNT
    assert stages["verifier"]["stats"]["published"] == COUNT
    assert stages["sink"]["count"] == COUNT  # every prompt scored, each once
    assert 0 < stages["sink"]["correct"] < COUNT  # ~1 in 5 answers is corrupted on purpose
    assert sum(s["stats"]["dead_lettered"] for s in stages.values()) == 0
    assert (run_dir / "nats").is_dir()  # JetStream lived in the run dir
    assert "completed" in result.output
    # off a terminal (CliRunner, CI, a log file) progress comes as plain lines
    assert "progress  prompts " in result.output and f"sink {COUNT}" in result.output
    assert summary["run_dir_bytes"] > 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["url"].startswith("nats://127.0.0.1:") and record["url"] in result.output
    # the full structured log lands in the run folder; the console shows warnings and up
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert {"event", "level", "timestamp"} <= set(events[0])
    assert any(e["event"] == "nats-server started" for e in events)
    assert "nats-server started" not in result.output
    # the same run id again would find every prompt consumed and wait forever: refused
    again = CliRunner().invoke(app, [*args, "--run-id", "qs-test"])
    assert again.exit_code == 2
    assert "already finished" in again.output and "--run-id" in again.output


async def test_quickstart_against_a_given_server(
    nats_server: NatsServer, repo_root: Path, tmp_path: Path
) -> None:
    pipe = load_pipeline(
        small_quickstart(repo_root, tmp_path), nats_url=nats_server.url, run_dir=tmp_path / "r"
    )
    summary = await pipe.run()
    assert summary["completed"]
    assert summary["stages"]["sink"]["count"] == COUNT
    assert not (tmp_path / "r" / "nats").exists()  # no embedded server was started


async def test_custom_pipeline_example_runs(repo_root: Path, tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "custom_pipeline", repo_root / "examples" / "custom_pipeline.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = await module.main(count=10, run_dir=tmp_path / "custom")
    assert summary["completed"]
    assert summary["stages"]["tally"] == {
        "right": 10,
        "wrong": 0,
        "total": 10,  # what it expects (the progress bar's total)
        "replicas": 1,
        "stats": summary["stages"]["tally"]["stats"],
    }
    assert (tmp_path / "custom" / "summary.json").is_file()


def test_unreachable_nats_fails_fast_naming_the_address(repo_root: Path, tmp_path: Path) -> None:
    from dora.bus.server import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    args = ["run", str(repo_root / "pipelines" / "echo.yaml"), "--nats", url]
    result = CliRunner().invoke(app, [*args, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps at 80 columns
    assert "nothing accepts connections" in text and "ConnectionRefused" in text
    assert "nats connection error" not in text  # no retry chatter before it


def test_a_server_that_wants_a_login_gets_the_one_given(repo_root: Path, tmp_path: Path) -> None:
    from dora.bus.auth import RunCredentials
    from dora.bus.server import NatsServer

    creds = RunCredentials.load_or_create(tmp_path / "site", "site")
    pipeline = str(repo_root / "pipelines" / "echo.yaml")
    with NatsServer(tmp_path / "nats", authorization=creds.server_authorization()) as server:
        base = ["run", pipeline, "--nats", server.url]
        refused = CliRunner().invoke(app, [*base, "--run-dir", str(tmp_path / "r1")])
        assert refused.exit_code == 1
        text = " ".join(refused.output.split())
        assert "refused the login of an anonymous client" in text
        login = str(tmp_path / "site" / "credentials" / "pipeline.json")
        args = [*base, "--nats-creds", login, "--run-dir", str(tmp_path / "r2")]
        accepted = CliRunner().invoke(app, args)
        assert accepted.exit_code == 0, accepted.output
        record = json.loads((tmp_path / "r2" / "run.json").read_text())
        assert record["nats_creds"] == login and record["credentials"] is None
