"""The rollout as real stages (dispatcher, one generator per engine, orchestrator): the same
pipeline runs in one process and as one process per stage replica, and under ``--processes``
a SIGKILL of any stage's process (a generator mid-decode, the dispatcher, the orchestrator,
the learner, the verifier) is survived: the supervisor restarts it, NATS redelivers what it
held, and the run completes with the rollout invariants read from its record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora.models import build_model, save_pretrained
from tests.integration.test_run_resume import check_invariants

pytestmark = [pytest.mark.nats, pytest.mark.slow]

CLI = [sys.executable, "-c", "from dora.cli import app; app()"]
STEPS, K, B, G = 16, 1, 4, 8  # as test_run_resume's check_invariants expects


def split_pipeline(tmp: Path) -> Path:
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    model_dir = save_pretrained(model, tmp / "model", tok)
    text = f"""
name: stages-test
x-model: &model {{path: {model_dir}}}
x-shape: &shape {{batch_groups: {B}, staleness_bound: {K}}}
stages:
  - type: recorder
  - type: learner
    config:
      model: *model
      learner: {{<<: *shape, max_steps: {STEPS}, checkpoint_every: 4, tensorboard: false,
                 optim: {{lr: 1.0e-3}}}}
      eval: {{set: {{per_stratum: 0}}}}
  - type: verifier
  - type: generator
    replicas: 2
    config: {{model: *model, engine: {{num_blocks: 256, max_num_seqs: 32}}}}
  - type: orchestrator
  - type: dispatcher
    config: {{<<: *shape, model: *model, group_size: {G}, max_tokens: 12}}
  - type: prompt_source
    config: {{task: arithmetic, count: 400}}
"""
    path = tmp / "pipeline.yaml"
    path.write_text(text)
    return path


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*CLI, *args], stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def processes(run_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((run_dir / "processes.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_until(predicate, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 240
    while not predicate():
        assert proc.poll() is None, (
            f"dora run exited ({proc.returncode}) waiting for {what}:\n" + (log.read_text()[-3000:])
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("separate", [False, True], ids=["in-process", "processes"])
def test_the_rollout_as_real_stages_completes(tmp_path: Path, separate: bool) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    extra = ["--processes"] if separate else []
    proc = start(["run", str(split_pipeline(tmp_path)), "--run-dir", str(run_dir), *extra], log)
    if separate:  # `ps`: one process per generator replica, each serving its own engine
        for replica in (0, 1):
            name = f"generator-{replica}"
            wait_until(lambda n=name: processes(run_dir).get(n, {}).get("pid"), name, proc, log)
            args = Path(f"/proc/{processes(run_dir)[name]['pid']}/cmdline").read_text()
            assert "\0generator\0--replica\0" + str(replica) + "\0" in args, args
    finish(proc, log)
    check_invariants(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    generators = summary["stages"]["generator"]
    assert generators["replicas"] == 2
    assert generators["finished"] >= STEPS * B * G
    assert summary["stages"]["dispatcher"]["dispatched_requests"] >= STEPS * B * G
    engines = {
        json.loads(line)["engine_id"] for line in (run_dir / "events" / "status.jsonl").open()
    }
    assert engines == {"engine-0", "engine-1"}


KILLS = [  # (process, after this many learner steps)
    ("generator-0", 2),
    ("dispatcher-0", 4),
    ("orchestrator-0", 6),
    ("learner-0", 9),
    ("verifier-0", 11),
]


def test_sigkill_of_each_stage_process_is_survived(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(
        ["run", str(split_pipeline(tmp_path)), "--run-dir", str(run_dir), "--processes"], log
    )
    try:
        for name, after in KILLS:
            wait_until(lambda a=after: steps_done(run_dir) >= a, f"step {after}", proc, log)
            pid = processes(run_dir)[name]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_until(
                lambda n=name, p=pid: (
                    processes(run_dir)[n]["pid"] != p
                    and (run_dir / "stages" / f"{n}.ready").exists()
                ),
                f"{name} restarted",
                proc,
                log,
            )
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finish(proc, log)
    check_invariants(run_dir)
    restarts = {name: info["restarts"] for name, info in processes(run_dir).items()}
    assert all(restarts[name] == 1 for name, _ in KILLS), restarts
