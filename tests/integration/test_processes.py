"""``dora run --processes``: one OS process per stage replica, supervised (real processes, real
signals, the embedded nats-server with a login per stage)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "pipelines" / "echo.yaml"
CLI = [sys.executable, "-c", "from dora.cli import app; app()"]


@contextlib.contextmanager
def _echo_run(run_dir: Path, prompts: int) -> Iterator[subprocess.Popen[str]]:
    """``dora run pipelines/echo.yaml --processes`` over ``prompts`` prompts, killed if a test
    leaves it running."""
    counts = ("--set", f"prompts.count={prompts}", "--set", f"sink.expect={prompts}")
    run = subprocess.Popen(
        [*CLI, "run", str(ECHO), "--processes", "--run-dir", str(run_dir), *counts],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=run_dir.parent,
    )
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _processes(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "processes.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_each_stage_replica_runs_in_its_own_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _echo_run(run_dir, 2000) as run:
        _wait_for(lambda: len(_processes(run_dir)) == 5, "five stage processes")
        _wait_for(lambda: (run_dir / "stages" / "prompts-0.ready").exists(), "the source")
        seen = _processes(run_dir)
        for name, info in seen.items():  # `ps`: one process per stage replica, ours
            stage, replica = name.rsplit("-", 1)
            args = _cmdline(info["pid"])
            assert args[args.index("--stage") + 1] == stage, args
            assert args[args.index("--replica") + 1] == replica
            assert info["pid"] != run.pid
        assert sorted(seen) == [
            "generator-0",
            "generator-1",
            "prompts-0",
            "sink-0",
            "verifier-0",
        ]
        out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["stages"]["sink"]["count"] == 2000
    assert summary["stages"]["generator"]["replicas"] == 2
    assert summary["stages"]["generator"]["stats"]["processed"] == 2000  # both replicas
    assert not any(_alive(info["pid"]) for info in seen.values())  # nothing left behind


def test_a_stage_process_killed_mid_run_is_restarted_and_nothing_is_lost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    count = 4000
    with _echo_run(run_dir, count) as run:
        _wait_for(lambda: (run_dir / "stages" / "prompts-0.ready").exists(), "the source")
        verifier = _processes(run_dir)["verifier-0"]["pid"]
        os.kill(verifier, signal.SIGKILL)  # mid-run: prompts are still flowing
        _wait_for(
            lambda: _processes(run_dir)["verifier-0"]["restarts"] == 1, "the verifier's restart"
        )
        assert _processes(run_dir)["verifier-0"]["pid"] != verifier
        out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out
    assert "[verifier-0] exited with -9; restarting" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] and summary["processes"]["verifier-0"]["restarts"] == 1
    sink = summary["stages"]["sink"]
    assert sink["count"] == count and sink["dead_letters"] == 0  # every prompt scored once


def test_ctrl_c_drains_every_stage_process_and_leaves_none(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _echo_run(run_dir, 100000) as run:
        _wait_for(lambda: (run_dir / "stages" / "prompts-0.ready").exists(), "the source")
        pids = [info["pid"] for info in _processes(run_dir).values()]
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
    assert run.returncode == 130, out
    assert not any(_alive(pid) for pid in pids)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["completed"]
