"""A stage process killed with SIGKILL mid-run: after a restart every event reaches the sink
exactly once (at-least-once delivery + publish dedupe by deterministic event ids)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from dora.bus import ConsumerSpec, NatsBus
from dora.bus.server import NatsServer
from dora.events import Trajectory
from dora.stage import derived_id
from dora.tasks import make_task

COUNT = 300
PIPELINE = """
name: crashy
stages:
  - type: 'tests.integration.stage_worker:SlowGenerator'
    name: generator
    concurrency: 4
    retry: {ack_wait_s: 1.0, backoff_s: 0.05}
    config: {delay_s: 0.01}
"""


def start_worker(
    repo: Path, pipeline: Path, url: str, run_id: str, run_dir: Path
) -> subprocess.Popen:
    code = "from dora.cli import app; app()"
    cmd = [sys.executable, "-c", code, "run", str(pipeline), "--nats", url, "--run-id", run_id]
    cmd += ["--run-dir", str(run_dir)]
    log = (run_dir / "worker.log").open("ab")
    return subprocess.Popen(cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT)


async def test_sigkilled_stage_restarts_and_every_event_is_processed_once(
    nats_server: NatsServer, nats_bus: NatsBus, repo_root: Path, tmp_path: Path
) -> None:
    s = nats_bus.subjects
    pipeline = tmp_path / "crashy.yaml"
    pipeline.write_text(PIPELINE)
    sink = await nats_bus.consumer(ConsumerSpec("sink", s.trajectories, max_ack_pending=1024))
    task = make_task("arithmetic", max_terms=4)
    source_ids = set()
    for prompt in task.prompts("train", COUNT):
        event = prompt.model_copy(update={"event_id": derived_id("prompt", prompt.prompt_id)})
        source_ids.add(event.event_id)
        await nats_bus.publish_event(s.prompts, event)

    received: list[str] = []  # raw, not deduplicated: a duplicate would show here
    prompts_of: list[str] = []

    async def drain_sink(until: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(received) < until and loop.time() < deadline:
            try:
                msgs = await sink.fetch(batch=256, timeout=0.3)
            except TimeoutError:  # nats-py may raise instead of returning []
                continue
            for msg in msgs:
                traj = Trajectory.model_validate_json(msg.data)
                received.append(traj.event_id)
                prompts_of.append(traj.request.prompt.event_id)
                await msg.ack()

    first = start_worker(repo_root, pipeline, nats_server.url, s.run, tmp_path)
    try:
        await drain_sink(until=COUNT // 5, timeout=60)
        assert len(received) >= COUNT // 5, (tmp_path / "worker.log").read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    killed_at = len(received)
    assert killed_at < COUNT, "the worker finished before it was killed; nothing was tested"

    second = start_worker(repo_root, pipeline, nats_server.url, s.run, tmp_path)
    try:
        await drain_sink(until=COUNT, timeout=60)
        await drain_sink(until=COUNT + 1, timeout=1.5)  # anything extra would be a duplicate
        second.send_signal(signal.SIGTERM)  # clean stop: drain, then exit 128 + SIGTERM
        assert second.wait(timeout=30) == 128 + signal.SIGTERM, (
            tmp_path / "worker.log"
        ).read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.kill(second.pid, signal.SIGKILL)
            second.wait()

    assert len(received) == len(set(received)) == COUNT
    assert sorted(prompts_of) == sorted(source_ids)
    state = await (await nats_bus.consumer(ConsumerSpec("generator", s.prompts))).state()
    assert state.depth == 0
