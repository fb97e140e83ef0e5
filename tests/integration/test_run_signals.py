"""Ctrl-C stops `dora run` in every phase: during the warm start (which runs in a worker
thread an asyncio cancellation cannot reach) the run stops within a step, exits 130, and
leaves no nats-server behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dora.training.warmstart import is_complete

PIPELINE = """
name: interrupted
stages:
  - type: rollout
    config:
      model:
        warmstart: {task: chain, steps: 100000, batch_tokens: 256, row_tokens: 128}
      engines: 1
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ", 1)[1][0] != "Z"


def test_ctrl_c_during_the_warm_start_stops_the_run(repo_root: Path, tmp_path: Path) -> None:
    pipeline = tmp_path / "interrupted.yaml"
    pipeline.write_text(PIPELINE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "DORA_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-c", "from dora.cli import app; app()", "run", str(pipeline)]
    cmd += ["--run-dir", str(run_dir), "--log-level", "info"]
    proc = subprocess.Popen(
        cmd, cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the warm start is training
            seen.append(line)
            if "warmstart_training" in line:
                break
        else:
            raise AssertionError("no warm start began:\n" + "".join(seen[-40:]))
        servers = [int(p.stem.rsplit("_", 1)[1]) for p in (run_dir / "nats").glob("*.ports")]
        assert servers, "the run's nats-server wrote no ports file"
        proc.send_signal(signal.SIGINT)
        # a hang guard, not a timing claim: 100,000 steps would take hours
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, "".join(seen[-20:]) + rest[-3000:]
    assert "interrupted" in rest
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in servers), "the embedded nats-server outlived the run"
    cache = tmp_path / "cache" / "warmstart"
    assert not any(is_complete(d) for d in cache.glob("*")), "an interrupted warm start was cached"
