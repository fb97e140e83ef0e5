"""Services outside the pipeline, on the wire contract alone: the example producer feeds a live
`dora run`, a consumer started before the run reads every trajectory, a reader that joins
after the run has ended reads the replay copy from the start, and a missing server is a
one-line error. The examples import nothing from dora."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dora.bus.server import NatsServer

pytestmark = pytest.mark.nats

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = ROOT / "examples" / "external_consumer.py"
PRODUCER = ROOT / "examples" / "external_producer.py"
PIPELINE = ROOT / "examples" / "external_pipeline.yaml"
CLI = [sys.executable, "-c", "from dora.cli import app; app()"]
COUNT = 32  # the pipeline's sink expects 32 scored prompts


def _example(script: Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]


def _produce(run_dir: Path) -> subprocess.CompletedProcess[str]:
    """The example producer feeding COUNT prompts to the run in ``run_dir``."""
    return subprocess.run(
        _example(PRODUCER, "--run-dir", str(run_dir), "--count", str(COUNT)),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("script", [CONSUMER, PRODUCER], ids=["consumer", "producer"])
def test_examples_import_nothing_from_dora(script: Path) -> None:
    tree = ast.parse(script.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m == "dora" or m.startswith("dora.") for m in modules)


def test_outside_producer_and_consumers_around_a_live_run(
    nats_server: NatsServer, run_id: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # 1. a consumer started before the run exists waits for its stream, then attaches
    early = subprocess.Popen(
        _example(CONSUMER, "--nats", nats_server.url, "--run", run_id, "--max", str(COUNT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_args = ("--run-dir", str(run_dir), "--run-id", run_id, "--nats", nats_server.url)
    run = subprocess.Popen(
        [*CLI, "run", str(PIPELINE), *run_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert early.stderr is not None
        waited = early.stderr.readline()
        attached = waited if waited.startswith("attached") else early.stderr.readline()
        assert attached.strip() == f"attached to dora.{run_id}.trajectories as external-audit"
        assert waited.startswith(f"waiting for run {run_id}'s trajectories stream")

        # 2. the producer finds the run by its folder and feeds it; a second run of it is a no-op
        produced = _produce(run_dir)
        assert produced.returncode == 0, produced.stderr
        assert (
            produced.stdout.strip()
            == f"published {COUNT} prompts to run {run_id} (0 already there)"
        )
        again = _produce(run_dir)
        assert (
            again.stdout.strip() == f"published 0 prompts to run {run_id} ({COUNT} already there)"
        )

        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] and summary["stages"]["sink"]["count"] == COUNT

        early_out, _ = early.communicate(timeout=60)
        assert early.returncode == 0, early_out
        lines = early_out.splitlines()
        assert lines[-1] == f"validated {COUNT}, invalid 0"
        assert len({line for line in lines if line.startswith("valid ")}) == COUNT
    finally:
        for proc in (early, run):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # 3. after the run has ended, a new reader gets every scored trajectory from the replay copy
    late_args = ("--family", "scored", "--replay", "--durable", "late", "--idle-timeout", "2")
    late = subprocess.run(
        _example(CONSUMER, "--run-dir", str(run_dir), *late_args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert late.returncode == 0, late.stderr
    lines = late.stdout.splitlines()
    assert lines[-1] == f"validated {COUNT}, invalid 0"
    assert len({line for line in lines if line.startswith("valid ")}) == COUNT


def test_no_server_is_a_one_line_error(tmp_path: Path) -> None:
    for script, extra in ((CONSUMER, []), (PRODUCER, ["--count", "1"])):
        result = subprocess.run(
            _example(script, "--nats", "nats://127.0.0.1:1", "--run", "nothing", *extra),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 3
        assert result.stderr.splitlines() == [
            "error: cannot connect to nats://127.0.0.1:1 (NoServersError: nats: no servers "
            "available for connection)"
        ]


def test_producer_refuses_an_invalid_prompt_before_sending_anything(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    good = {"event_id": "p1", "prompt_id": "p1", "text": "Q: 1+2\nA:\n", "answer": "3"}
    prompts.write_text(json.dumps(good) + "\n" + json.dumps({"prompt_id": "p2"}) + "\n")
    result = subprocess.run(
        _example(PRODUCER, "--nats", "nats://127.0.0.1:1", "--run", "r", str(prompts)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: prompt 2 is not a valid Prompt: (root): 'text' is a required property"
    )


def test_examples_log_in_to_an_embedded_run_with_the_run_folders_credentials(
    run_id: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        [*CLI, "run", str(PIPELINE), "--run-dir", str(run_dir), "--run-id", run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    live = subprocess.Popen(
        _example(CONSUMER, "--run-dir", str(run_dir), "--live", "--max", str(COUNT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert live.stderr is not None
        assert live.stderr.readline().strip() == f"listening on dora.{run_id}.trajectories"
        record = json.loads((run_dir / "run.json").read_text())
        assert record["credentials"] == {
            "reader": "credentials/reader.json",
            "producer": "credentials/producer.json",
        }
        # the read-only login may not attach a consumer to the pipeline's own stream
        durable = subprocess.run(
            _example(CONSUMER, "--run-dir", str(run_dir), "--max", "1", "--wait", "30"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert durable.returncode == 3
        assert "the server refused: permissions violation for publish to" in durable.stderr
        assert "use --replay, or --live" in durable.stderr

        produced = _produce(run_dir)
        assert produced.returncode == 0, produced.stderr

        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out
        live_out, _ = live.communicate(timeout=60)
        assert live.returncode == 0, live_out
        assert live_out.splitlines()[-1] == f"validated {COUNT}, invalid 0"
    finally:
        for proc in (live, run):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
