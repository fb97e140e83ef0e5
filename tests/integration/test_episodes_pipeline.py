"""Episodes in a real `dora run --processes`: an environment stage in its own process serves
multi-turn episodes to two generator processes; its process is SIGKILLed mid-run, the
supervisor restarts it, and the run completes with every request one trajectory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from dora.subjects import Subjects
from tests.integration.test_run_resume import B, G, K, check_invariants, start, tiny_model_dir
from tests.integration.test_stage_processes import finish, processes, steps_done, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.slow]

STEPS = 6
TURN_END = json.dumps(list("etaoinshrdlu#%&?!=:;"))  # the random tiny model ends turns fast


def episodes_pipeline(tmp: Path) -> Path:
    model_dir = tiny_model_dir(tmp)
    text = f"""
name: episodes-test
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
  - type: environment
    config:
      environment: "tests.integration.env_worker:SlowTool"
      environment_config: {{delay_s: 1.0}}
  - type: generator
    replicas: 2
    config:
      model: *model
      engine: {{num_blocks: 512, max_num_seqs: 32}}
      episodes:
        environment: "tests.integration.env_worker:SlowTool"
        turn_stop_strings: {TURN_END}
        reply_timeout_s: 20
  - type: orchestrator
  - type: dispatcher
    config: {{<<: *shape, model: *model, group_size: {G}, max_tokens: 120}}
  - type: prompt_source
    config: {{task: arithmetic, count: 400}}
"""
    path = tmp / "pipeline.yaml"
    path.write_text(text)
    return path


async def until_steps_wait(run_dir: Path, deadline_s: float = 120.0) -> None:
    """Until a later step (turn 1+, on ``env_steps.<owner>``) is stored unanswered: an episode
    lives in the replica's memory and waits on it. A stored reset (``env_steps.any``) is not
    enough: the restarted replica would answer it as if nothing happened."""
    import nats

    info = json.loads((run_dir / "run.json").read_text())
    login = json.loads((run_dir / "credentials" / "pipeline.json").read_text())
    client = await nats.connect(info["url"], user=login["user"], password=login["password"])
    subjects = Subjects(info["run_id"])
    stream, resets = subjects.stream("env_steps"), subjects.env_steps("any")
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                state = (await client.jetstream().stream_info(stream, subjects_filter=">")).state
                if any(n and s != resets for s, n in (state.subjects or {}).items()):
                    return
                await asyncio.sleep(0.02)
    finally:
        await client.close()


def test_an_environment_process_killed_mid_run_loses_no_episode(tmp_path: Path) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    args = ["run", str(episodes_pipeline(tmp_path)), "--run-dir", str(run_dir), "--processes"]
    proc = start(args, log)
    try:
        wait_until(lambda: steps_done(run_dir) >= 1, "step 1", proc, log)
        asyncio.run(until_steps_wait(run_dir))  # each of its steps takes 1 s: kill it then
        os.kill(processes(run_dir)["environment-0"]["pid"], signal.SIGKILL)
    finally:
        finish(proc, log)
    check_invariants(run_dir, steps=STEPS)  # one trajectory per request, one version each
    trajectories = [json.loads(line) for line in (run_dir / "events" / "trajectories.jsonl").open()]
    episodes = [t["episode"] for t in trajectories]
    assert all(e is not None and e["environment"].endswith(":SlowTool") for e in episodes)
    done = [t["episode"] for t in trajectories if t["finish_reason"] == "stop"]
    assert done and all(e["turns"] == 3 and e["reward"] == 1.0 for e in done)
    assert any(e["attempts"] == 2 for e in episodes), "no episode was cut off by the kill"
    for t in trajectories:  # environment tokens never in the loss
        for span in t["turns"]:
            want = {1} if span["role"] == "assistant" and not t["error"] else {0}
            if span["end"] > span["start"]:
                assert set(t["loss_mask"][span["start"] : span["end"]]) <= want | {0}
                if span["role"] == "tool":
                    assert set(t["loss_mask"][span["start"] : span["end"]]) == {0}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"]["environment"]["episodes"] > 0
