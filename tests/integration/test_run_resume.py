"""A real ``dora run`` process killed (SIGKILL) or interrupted (SIGINT) mid-training, then
``dora run --resume``: the run completes with the rollout invariants read from its record.

Invariants: every learner step 0..N-1 recorded exactly once, staleness <= K at consumption,
exactly one trajectory per request, every consumed group consumed once and complete, nothing
dead-lettered; and the killed process's embedded nats-server does not outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dora.learner.metrics import read_metrics
from dora.models import build_model, save_pretrained

pytestmark = [pytest.mark.slow]

STEPS, K, B, G = 16, 1, 4, 8
CLI = [sys.executable, "-c", "from dora.cli import app; app()"]


def tiny_model_dir(tmp: Path) -> Path:
    """The small model every multi-process run test trains (built, never downloaded)."""
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    return save_pretrained(model, tmp / "model", tok)


def pipeline_file(tmp: Path) -> Path:
    model_dir = tiny_model_dir(tmp)
    text = f"""
name: resume-test
stages:
  - type: recorder
  - type: learner
    config:
      model: {{path: {model_dir}}}
      learner: {{batch_groups: {B}, staleness_bound: {K}, max_steps: {STEPS},
                 checkpoint_every: 4, tensorboard: false, optim: {{lr: 1.0e-3}}}}
      eval: {{set: {{per_stratum: 0}}}}
  - type: verifier
    config: {{verifier: exact_match}}
  - type: rollout
    config:
      model: {{path: {model_dir}}}
      engines: 2
      group_size: {G}
      batch_groups: {B}
      staleness_bound: {K}
      max_tokens: 12
      engine: {{num_blocks: 256, max_num_seqs: 32}}
  - type: prompt_source
    config: {{task: arithmetic, count: 400}}
"""
    path = tmp / "pipeline.yaml"
    path.write_text(text)
    return path


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # its own session: a signal goes to this process only, as `kill PID` does
    return subprocess.Popen(
        [*CLI, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen[bytes]) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, f"dora run exited early with {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"no learner step {steps} within 180 s")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def check_invariants(run_dir: Path, steps: int = STEPS, k: int = K, g: int = G) -> None:
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["values"]["staleness/max"] <= k for m in metrics)
    events = run_dir / "events"
    recorded = [json.loads(line) for line in (events / "metrics.jsonl").open()]
    assert sorted(m["step"] for m in recorded) == list(range(steps)), "a step ran twice"
    consumed = Counter(g for m in recorded for g in m["consumed_groups"])
    assert consumed and max(consumed.values()) == 1, "a group was trained twice"
    trajectories = [json.loads(line) for line in (events / "trajectories.jsonl").open()]
    ids = Counter(t["request"]["request_id"] for t in trajectories)
    assert max(ids.values()) == 1, "a request produced two trajectories"
    for t in trajectories:  # one version each, never re-prefilled
        assert t["version"] == t["request"]["version"] and not t["token_versions"], t
        assert t["reprefilled_tokens"] == 0, t
    per_group = Counter(t["request"]["group_id"] for t in trajectories)
    assert all(per_group[group] == g for group in consumed), "a consumed group lacks a trajectory"
    dead = events / "deadletter.jsonl"
    assert not dead.exists() or dead.read_text().strip() == ""


@pytest.mark.parametrize(
    ("sig", "after_steps"),
    [(signal.SIGKILL, 2), (signal.SIGKILL, 7), (signal.SIGINT, 5)],
    ids=["kill-before-first-checkpoint", "kill-between-checkpoints", "sigint"],
)
def test_stopped_run_resumes_to_completion(
    tmp_path: Path, sig: signal.Signals, after_steps: int
) -> None:
    pipeline, run_dir = pipeline_file(tmp_path), tmp_path / "run"
    first = start(["run", str(pipeline), "--run-dir", str(run_dir)], tmp_path / "first.log")
    try:
        wait_for_steps(run_dir, after_steps, first)
        servers = children(first.pid)
        first.send_signal(sig)
        code = first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert code == 128 + sig if sig == signal.SIGINT else code == -sig
    assert all(gone(pid) for pid in servers), "the embedded nats-server outlived dora run"
    log = tmp_path / "second.log"
    second = start(["run", "--resume", str(run_dir)], log)
    try:
        code = second.wait(timeout=300)
    finally:
        if second.poll() is None:
            second.kill()
    assert code == 0, log.read_text()[-3000:]
    check_invariants(run_dir)


def test_killed_echo_run_resumes_and_counts_every_event_once(
    tmp_path: Path, repo_root: Path
) -> None:
    """The sink completes after ``expect`` distinct events: a resumed run counts the events
    the killed process saw as well (before, it waited forever for the ones it missed)."""
    count, run_dir = 4000, tmp_path / "run"
    sets = ["--set", f"prompts.count={count}", "--set", f"sink.expect={count}"]
    args = ["run", str(repo_root / "pipelines" / "echo.yaml"), "--run-dir", str(run_dir), *sets]
    first = start(args, tmp_path / "first.log")
    counted = run_dir / "state" / "sink.counted"
    try:
        deadline = time.monotonic() + 120
        while not (counted.exists() and len(counted.read_text().splitlines()) >= count // 3):
            assert first.poll() is None and time.monotonic() < deadline, "no progress"
            time.sleep(0.05)
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    before = len(counted.read_text().splitlines())
    assert before < count, "the run finished before it was killed"
    second = start(["run", "--resume", str(run_dir)], tmp_path / "second.log")
    try:
        code = second.wait(timeout=180)
    finally:
        if second.poll() is None:
            second.kill()
    assert code == 0, (tmp_path / "second.log").read_text()[-3000:]
    sink = json.loads((run_dir / "summary.json").read_text())["stages"]["sink"]
    assert sink["count"] + sink["dead_letters"] == count
    rows = [json.loads(line) for line in counted.open()]
    assert sink["count"] == len({key for kind, key, *_ in rows if kind == "S"})
