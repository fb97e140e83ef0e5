"""The main job's parts together: dora-mode rollout with the real GRPO learner on real NATS.

A trivially learnable reward (the first generated character is a digit) on a small random
model: the learner's reward must rise within a few steps, and the rollout invariants must
hold with the real learner (one version per trajectory, staleness <= K at consumption,
exactly one trajectory per dispatched request, nothing dead-lettered).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dora.bus.server import NatsServer
from dora.events import ScoredTrajectory, Trajectory
from dora.learner.metrics import read_metrics
from dora.models import build_model, save_pretrained
from dora.pipeline import Pipeline
from dora.stage import Context, derived_id, stage
from dora.stages.learner import LearnerStage
from dora.stages.prompt_source import PromptSource
from dora.stages.recorder import RecorderStage
from dora.stages.rollout import RolloutStage

pytestmark = [pytest.mark.nats, pytest.mark.slow]

B, G, K, STEPS = 4, 8, 1, 8
DIGITS = set("0123456789")


@stage(consumes="trajectories", emits={ScoredTrajectory: "scored"}, concurrency=16)
async def first_char_is_digit(traj: Trajectory, ctx: Context) -> ScoredTrajectory:
    reward = float(traj.text[:1] in DIGITS)
    return ScoredTrajectory(
        event_id=derived_id(traj.event_id, "scored"), trajectory=traj, reward=reward
    )


async def test_reward_rises_and_invariants_hold(tmp_path: Path, nats_server: NatsServer) -> None:
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    model_dir = save_pretrained(model, tmp_path / "model", tok)
    run_dir = tmp_path / "run"
    source = {"path": str(model_dir)}
    pipeline = Pipeline(run_id="mainjob", nats_url=nats_server.url, run_dir=run_dir)
    pipeline.add(RecorderStage())
    pipeline.add(
        LearnerStage(
            model=source,
            learner={
                "batch_groups": B,
                "staleness_bound": K,
                "max_steps": STEPS,
                "checkpoint_every": 4,
                "tensorboard": False,
                "optim": {"lr": 3e-3},
            },
            eval={"prompts": 0},
        )
    )
    pipeline.add(first_char_is_digit)
    pipeline.add(
        RolloutStage(
            model=source,
            engines=2,
            mode="dora",
            group_size=G,
            batch_groups=B,
            staleness_bound=K,
            max_tokens=6,
            max_running=32,
            engine={"num_blocks": 256, "max_num_seqs": 32},
        )
    )
    pipeline.add(PromptSource(task="arithmetic", count=400))
    await pipeline.run()

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    rewards = [m["values"]["reward/mean"] for m in metrics]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert all(m["values"]["staleness/max"] <= K for m in metrics)

    events = run_dir / "events"
    trajectories = [json.loads(line) for line in (events / "trajectories.jsonl").open()]
    ids = [t["request"]["request_id"] for t in trajectories]
    assert len(ids) == len(set(ids)), "a request produced two trajectories"
    assert all(t["version"] == t["request"]["version"] for t in trajectories)
    assert all(t["reprefilled_tokens"] == 0 for t in trajectories)
    dead = events / "deadletter.jsonl"
    assert not dead.exists() or dead.read_text().strip() == ""
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (run_dir / "final" / "model.safetensors").is_file()
