"""The main job's parts together: rollout with the real GRPO learner on real NATS.

A trivially learnable reward (the first generated character is a digit) on a small random
model: under dora the learner's reward must rise within a few steps, and in every mode (dora
and the three baselines, each with its default configuration) the run must complete with the
rollout invariants (staleness <= K at consumption, exactly one trajectory per dispatched
request, nothing dead-lettered; under dora one version per trajectory and no re-prefill).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from dora.bench.run_stats import run_stats
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

B, G, K, STEPS = 4, 8, 1, 12
DIGITS = set("0123456789")


@stage(consumes="trajectories", emits={ScoredTrajectory: "scored"}, concurrency=16)
async def first_char_is_digit(traj: Trajectory, ctx: Context) -> ScoredTrajectory:
    reward = float(traj.text[:1] in DIGITS)
    return ScoredTrajectory(
        event_id=derived_id(traj.event_id, "scored"), trajectory=traj, reward=reward
    )


def build_pipeline(
    tmp_path: Path,
    url: str | None,
    *,
    mode: str,
    steps: int,
    k: int,
    max_running: int = 32,
    engine: dict[str, int] | None = None,
) -> tuple[Pipeline, Path]:
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    model_dir = save_pretrained(model, tmp_path / "model", tok)
    run_dir = tmp_path / "run"
    source = {"path": str(model_dir)}
    # A run id of its own: the session's nats-server keeps every earlier test's streams and
    # KV state, and a second run under one id would resume the first (its dispatcher snapshot,
    # its queued prompts). A hang fails with the stages' state and the ledger (stall_timeout).
    run_id = f"mainjob-{mode}-{steps}-{uuid.uuid4().hex[:6]}"
    pipeline = Pipeline(run_id=run_id, nats_url=url, run_dir=run_dir, stall_timeout=120)
    pipeline.add(RecorderStage())
    pipeline.add(
        LearnerStage(
            model=source,
            learner={
                "batch_groups": B,
                "staleness_bound": k,
                "max_steps": steps,
                "checkpoint_every": 4,
                "tensorboard": False,
                "optim": {"lr": 3e-3},
            },
            eval={"set": {"per_stratum": 0}},
        )
    )
    pipeline.add(first_char_is_digit)
    pipeline.add(
        RolloutStage(
            model=source,
            engines=2,
            mode=mode,
            group_size=G,
            batch_groups=B,
            staleness_bound=k,
            max_tokens=6,
            max_running=max_running,
            engine=engine or {"num_blocks": 256, "max_num_seqs": 32},
        )
    )
    pipeline.add(PromptSource(task="arithmetic", count=400))
    return pipeline, run_dir


def check_invariants(run_dir: Path, steps: int, k: int) -> list[dict]:
    """Every step ran, none trained past K, one trajectory per request, no dead letter."""
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["values"]["staleness/max"] <= k for m in metrics)
    events = run_dir / "events"
    trajectories = [json.loads(line) for line in (events / "trajectories.jsonl").open()]
    ids = [t["request"]["request_id"] for t in trajectories]
    assert len(ids) == len(set(ids)), "a request produced two trajectories"
    dead = events / "deadletter.jsonl"
    assert not dead.exists() or dead.read_text().strip() == ""
    return trajectories


async def test_reward_rises_and_invariants_hold(tmp_path: Path, nats_server: NatsServer) -> None:
    pipeline, run_dir = build_pipeline(tmp_path, nats_server.url, mode="dora", steps=STEPS, k=K)
    summary = await pipeline.run()

    trajectories = check_invariants(run_dir, STEPS, K)
    # service stages report their own work in the progress view and the summary table
    rollout = summary["stages"]["rollout"]
    assert rollout["done"] == rollout["finished"] >= len(trajectories) > 0
    rewards = [m["values"]["reward/mean"] for m in read_metrics(run_dir)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert all(t["version"] == t["request"]["version"] for t in trajectories)
    assert all(t["reprefilled_tokens"] == 0 for t in trajectories)
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (run_dir / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial", "dora"])
async def test_every_mode_runs_to_completion(
    mode: str, tmp_path: Path, nats_server: NatsServer
) -> None:
    """Each mode with the default K=2 and engines holding fewer requests than the dispatcher
    admits, so requests queue under old versions (in partial mode they are retagged to the
    newest one before they generate: the learner must count them under their admitted tag)."""
    k, steps = 2, 6
    pipeline, run_dir = build_pipeline(
        tmp_path, nats_server.url, mode=mode, steps=steps, k=k, max_running=4
    )
    await pipeline.run()
    effective_k = {"sync": 0, "one_step_off": 1}.get(mode, k)
    trajectories = check_invariants(run_dir, steps, effective_k)
    for t in trajectories:
        admitted, tag = t["request"]["admitted_version"], t["request"]["version"]
        assert admitted is not None and admitted <= tag
        if mode != "partial":  # only partial rollout retags (and re-prefills)
            assert admitted == tag
            assert t["reprefilled_tokens"] == 0
    stats = run_stats(run_dir)  # what `dora bench modes --task` compares, from the record
    assert stats["steps"] == steps and stats["trajectories"] == len(trajectories)
    assert stats["generated_tok_s"] > 0 and stats["trained_tok_s"] > 0
    assert 0 < stats["utilization"] <= 1 and 0 <= stats["learner_wait_frac"] < 1
    reprefilled = sum(t["reprefilled_tokens"] for t in trajectories)
    assert stats["reprefilled_tokens"] == reprefilled
