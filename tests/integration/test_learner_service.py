"""The learner service on a real nats-server: stepping, weight versions, crash and resume."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch

from dora.bus import ConsumerSpec, NatsBus
from dora.events import ScoredTrajectory, WeightVersion
from dora.learner import LearnerConfig, LearnerService, WeightFetcher
from dora.learner.checkpoint import CheckpointManager
from dora.learner.synthetic import score_completions
from dora.learner.weights import serialize_state_dict, sha256
from dora.models import LlamaModel, build_model, hf_state_dict

pytestmark = pytest.mark.nats

G = 2  # samples per group


def tiny() -> LlamaModel:
    torch.set_num_threads(1)
    model, _ = build_model(
        "tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    return model


def make_groups(count: int, start: int = 0) -> list[list[ScoredTrajectory]]:
    """Groups built from the tiny model's own logprobs (distinct completions, rewards 0/1)."""
    model = tiny()
    return [
        score_completions(
            model,
            group_id=f"g{i}",
            prompt_ids=[1, 20 + i % 7, 30],
            completions=[[40 + i % 11, 41], [50, 51 + i % 5, 52]],
            rewards=[1.0, 0.0],
        )
        for i in range(start, start + count)
    ]


def config(**kw: object) -> LearnerConfig:
    base = dict(
        batch_groups=1,
        staleness_bound=100,
        checkpoint_every=2,
        tensorboard=False,
        ack_wait_s=1.0,
        fetch_timeout_s=0.1,
    )
    base.update(kw)
    return LearnerConfig(**base)  # type: ignore[arg-type]


async def publish(bus: NatsBus, groups: list[list[ScoredTrajectory]]) -> None:
    for group in groups:
        for s in group:
            await bus.publish_event(bus.subjects.scored, s)


async def weight_events(bus: NatsBus) -> list[WeightVersion]:
    consumer = await bus.consumer(
        ConsumerSpec(durable="wtest", filter_subject=bus.subjects.weights)
    )
    out: list[WeightVersion] = []
    while msgs := await consumer.fetch(100, timeout=0.3):
        for m in msgs:
            out.append(WeightVersion.model_validate_json(m.data))
            await m.ack()
    await consumer.close()
    return out


async def test_steps_publish_verified_increasing_versions(
    nats_bus: NatsBus, tmp_path: Path
) -> None:
    service = LearnerService(nats_bus, tiny(), config(batch_groups=2, max_steps=3), tmp_path)
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    await publish(nats_bus, make_groups(6))
    await asyncio.wait_for(task, 120)
    assert [len(ids) for _, ids in service.history] == [2 * G] * 3
    events = await weight_events(nats_bus)
    assert [e.version for e in events] == [0, 1, 2, 3]
    assert [e.step for e in events[1:]] == [0, 1, 2]
    fetcher = WeightFetcher(nats_bus)
    for e in events:  # every blob matches its announced checksum
        state = await fetcher.fetch(e)
        assert sha256(serialize_state_dict(state)) == e.checksum
    final = hf_state_dict(service.model)
    assert all(torch.equal(final[k], v) for k, v in (await fetcher.fetch(3)).items())
    assert "weights/publish_s" in events[-1].metrics


async def test_killed_learner_resumes_without_repeats_or_gaps(
    nats_bus: NatsBus, tmp_path: Path
) -> None:
    groups = make_groups(6)
    all_ids = {s.trajectory.request.request_id for g in groups for s in g}

    # run 1: train 3 steps (checkpoint after step 2 covers only steps 0-1), then crash
    three = asyncio.Event()
    first = LearnerService(
        nats_bus,
        tiny(),
        config(),
        tmp_path,
        on_step=lambda step, *_: three.set() if step == 2 else None,
    )
    task = asyncio.create_task(first.run())
    await asyncio.wait_for(first.ready.wait(), 30)
    await publish(nats_bus, groups[:3])
    await asyncio.wait_for(three.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(first.history) == 3
    latest = CheckpointManager(tmp_path / "checkpoints").latest()
    assert latest is not None and latest.name == "step_000002"

    # run 2: a fresh process image resumes from the checkpoint; the rest arrives
    await publish(nats_bus, groups[3:])
    second = LearnerService(nats_bus, tiny(), config(max_steps=6), tmp_path)
    await asyncio.wait_for(second.run(), 120)
    assert second.resumed_from == 2
    # version 3 (step 2) was published before the crash: the journal names its groups, so
    # the resumed learner adopts v3's weights instead of training that number again
    assert [step for step, _ in second.history] == [3, 4, 5]
    lineage = [rid for _, ids in first.history for rid in ids]
    lineage += [rid for _, ids in second.history for rid in ids]
    assert Counter(lineage).most_common(1)[0][1] == 1  # nothing trained twice
    assert set(lineage) == all_ids  # nothing skipped
    # once the final checkpoint is written, the only messages left unacked are g2's: trained
    # before the crash and journaled, the resumed learner may finish before they come back
    consumer = await nats_bus.consumer(
        ConsumerSpec(
            durable="learner",
            filter_subject=nats_bus.subjects.scored,
            max_ack_pending=second.config.ack_pending_limit,
            max_deliver=1000,
            ack_wait_s=1.0,
        )
    )
    left: set[str] = set()
    while msgs := await consumer.fetch(100, timeout=2.5):  # > ack_wait: redeliveries arrive
        for m in msgs:
            left.add(ScoredTrajectory.model_validate_json(m.data).trajectory.request.group_id)
            await m.ack()
    state = await consumer.state()
    await consumer.close()
    assert left <= {"g2"}
    assert state.pending == 0 and state.ack_pending == 0
