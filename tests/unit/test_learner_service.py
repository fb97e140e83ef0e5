"""The learner service on the in-process bus: stepping, ledger waits, dead letters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from dora.bus import ConsumerSpec, MemoryBroker, MemoryBus
from dora.events import DeadLetter, Ledger, Metrics, VersionCounts, WeightVersion
from dora.learner import LearnerConfig, LearnerService
from dora.learner.metrics import read_metrics
from dora.learner.synthetic import make_scored
from dora.models import LlamaModel, build_model
from dora.subjects import Subjects


def tiny() -> LlamaModel:
    torch.set_num_threads(1)
    model, _ = build_model(
        "tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    return model


@pytest.fixture
async def mbus() -> MemoryBus:
    bus = MemoryBus(Subjects("svc"), broker=MemoryBroker())
    await bus.connect()
    yield bus
    await bus.close()


def config(**kw: object) -> LearnerConfig:
    base = dict(
        batch_groups=2, staleness_bound=2, checkpoint_every=1, tensorboard=False, ack_wait_s=5.0
    )
    base.update(kw)
    return LearnerConfig(**base)  # type: ignore[arg-type]


async def publish_group(bus: MemoryBus, gid: str, version: int = 0, size: int = 2) -> None:
    for i in range(size):
        scored = make_scored(
            group_id=gid, group_index=i, group_size=size, version=version, reward=float(i)
        )
        await bus.publish_event(bus.subjects.scored, scored)


async def drain(bus: MemoryBus, subject: str, name: str) -> list[bytes]:
    consumer = await bus.consumer(ConsumerSpec(durable=name, filter_subject=subject))
    out = []
    while msgs := await consumer.fetch(100, timeout=0.05):
        for m in msgs:
            out.append(m.data)
            await m.ack()
    await consumer.close()
    return out


async def start(service: LearnerService) -> asyncio.Task[None]:
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    return task


async def test_steps_every_b_groups_and_publishes(mbus: MemoryBus, tmp_path: Path) -> None:
    service = LearnerService(mbus, tiny(), config(max_steps=2), tmp_path)
    task = await start(service)
    for g in range(4):
        await publish_group(mbus, f"g{g}")
    await asyncio.wait_for(task, 60)
    assert [len(ids) for _, ids in service.history] == [4, 4]
    assert [step for step, _ in service.history] == [0, 1]
    weights = [
        WeightVersion.model_validate_json(d) for d in await drain(mbus, mbus.subjects.weights, "w")
    ]
    assert [w.version for w in weights] == [0, 1, 2]
    metrics = [
        Metrics.model_validate_json(d) for d in await drain(mbus, mbus.subjects.metrics, "m")
    ]
    assert [m.step for m in metrics] == [0, 1]
    assert metrics[0].values["groups/batch"] == 2.0
    assert sorted(metrics[0].consumed_groups + metrics[1].consumed_groups) == [
        "g0",
        "g1",
        "g2",
        "g3",
    ]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert service.checkpoints.latest() == tmp_path / "checkpoints" / "step_000002"


async def test_waits_for_urgent_group_in_ledger(mbus: MemoryBus, tmp_path: Path) -> None:
    # K=0: version-0 groups must all be in step 0; the ledger says 3 were dispatched
    ledger = Ledger(
        learner_step=0,
        staleness_bound=0,
        batch_groups=2,
        versions=(VersionCounts(version=0, dispatched=3),),
    )
    await mbus.kv_put("ledger", ledger.model_dump_json().encode())
    service = LearnerService(
        mbus, tiny(), config(staleness_bound=0, max_steps=1, ledger_poll_s=0.0), tmp_path
    )
    task = await start(service)
    await publish_group(mbus, "a")
    await publish_group(mbus, "b")
    while service.selector.waiting_since is None:  # blocked on the missing urgent group
        await asyncio.sleep(0.01)
    assert not service.history
    await publish_group(mbus, "c")
    await asyncio.wait_for(task, 60)
    ((step, ids),) = service.history
    assert step == 0
    assert len(ids) == 6  # all three urgent groups, although B = 2
    assert read_metrics(tmp_path)[0]["values"]["staleness/wait_s"] > 0


async def test_bad_and_too_stale_samples_are_dead_lettered(mbus: MemoryBus, tmp_path: Path) -> None:
    service = LearnerService(
        mbus, tiny(), config(batch_groups=1, staleness_bound=0, max_steps=2), tmp_path
    )
    task = await start(service)
    await mbus.publish(mbus.subjects.scored, b"not json")
    bad = make_scored(group_id="x", group_index=0, group_size=2, logprobs=[0.0])
    await mbus.publish_event(mbus.subjects.scored, bad)
    future = make_scored(group_id="f", group_index=0, group_size=1, version=7)
    await mbus.publish_event(mbus.subjects.scored, future)  # v7 was never published
    await publish_group(mbus, "g0", version=0)
    while not service.history:
        await asyncio.sleep(0.01)
    again = make_scored(group_id="g0", group_index=0, group_size=2)
    await mbus.publish_event(mbus.subjects.scored, again.model_copy(update={"event_id": "again"}))
    await publish_group(mbus, "late", version=0)  # step 1 now: staleness 1 > K = 0
    await publish_group(mbus, "g1", version=1)
    await asyncio.wait_for(task, 60)
    letters = [
        DeadLetter.model_validate_json(d) for d in await drain(mbus, mbus.subjects.deadletter, "d")
    ]
    reasons = sorted(d.reason.split(":")[0] for d in letters)
    assert reasons == [
        "duplicate",
        "invalid ScoredTrajectory",
        "invalid trajectory",
        "too stale",
        "too stale",
        "unknown version",
    ]
    assert "logprobs" in next(d.reason for d in letters if d.reason.startswith("invalid traj"))
    trained = [rid for _, ids in service.history for rid in ids]
    assert not any(rid.startswith("late") for rid in trained)
    assert service.buffer.refused == {"late"}


async def test_stop_checkpoints_the_buffer_and_a_restart_trains_it(
    mbus: MemoryBus, tmp_path: Path
) -> None:
    first = LearnerService(mbus, tiny(), config(), tmp_path)
    task = await start(first)
    await publish_group(mbus, "g0")
    half = make_scored(group_id="g1", group_index=0, group_size=2, reward=1.0)
    await mbus.publish_event(mbus.subjects.scored, half)
    while first.buffer.received < 3:
        await asyncio.sleep(0.01)
    first.stop()
    await asyncio.wait_for(task, 30)
    assert not first.history
    state = first.checkpoints.load(tiny())[1]
    assert state.step == 0 and len(state.buffered) == 3
    probe = await mbus.consumer(
        ConsumerSpec(durable="learner", filter_subject=mbus.subjects.scored)
    )
    assert (await probe.state()).depth == 0  # everything acked: the checkpoint holds it
    await probe.close()

    second = LearnerService(mbus, tiny(), config(max_steps=1), tmp_path)
    task = await start(second)
    other = make_scored(group_id="g1", group_index=1, group_size=2, reward=0.0)
    await mbus.publish_event(mbus.subjects.scored, other)
    await asyncio.wait_for(task, 30)
    ((_, ids),) = second.history
    assert sorted(ids) == ["g0-0", "g0-1", "g1-0", "g1-1"]
