"""What the dispatcher cannot use on its observation subjects (scored, metrics, weights) goes
to the dead-letter subject with the reason, instead of a log line and a silent ack."""

from __future__ import annotations

import asyncio

from dora.bus import ConsumerSpec, MemoryBus
from dora.events import DeadLetter, Prompt, ScoredTrajectory, Trajectory
from dora.rollout.dispatch_service import DispatchService
from dora.rollout.dispatcher import Dispatcher, DispatcherConfig
from dora.rollout.dispatcher_snapshot import SNAPSHOT_KEY
from dora.subjects import Subjects


async def test_bad_observations_are_dead_lettered_with_the_reason() -> None:
    bus = MemoryBus(Subjects("obs"))
    await bus.connect()
    s = bus.subjects
    letters = await bus.consumer(ConsumerSpec("audit", s.deadletter))
    service = DispatchService(bus, Dispatcher(DispatcherConfig()))
    task = asyncio.create_task(service.run())
    try:
        await bus.publish(s.metrics, b"\x00\xff not json")
        await bus.publish(s.weights, b'{"version": "seven"}')
        got: list[DeadLetter] = []
        while len(got) < 2:
            for msg in await letters.fetch(batch=8, timeout=5.0):
                got.append(DeadLetter.model_validate_json(msg.data))
                await msg.ack()
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)
        await bus.close()
    by_subject = {letter.subject: letter for letter in got}
    assert set(by_subject) == {s.metrics, s.weights}
    assert by_subject[s.metrics].reason.startswith("invalid Metrics")
    assert by_subject[s.metrics].payload_encoding == "base64"  # invalid UTF-8 kept exactly
    assert by_subject[s.weights].reason.startswith("invalid WeightVersion")
    assert all(letter.stage == "dispatcher" for letter in got)


class SlowReadBus(MemoryBus):
    """A KV read takes a round trip, as on NATS (the memory bus answers without yielding)."""

    async def kv_get(self, key: str) -> bytes | None:
        await asyncio.sleep(0.05)
        return await super().kv_get(key)


async def test_a_restarted_dispatcher_restores_before_it_applies_what_waited() -> None:
    """A ``scored`` sample published while the dispatcher was down is applied to the restored
    group: restoring after the observers started rejected it as never dispatched (CI saw it
    after a resume) and could overwrite the saved state with an empty one."""
    bus = SlowReadBus(Subjects("restart"))
    await bus.connect()
    s = bus.subjects
    before = Dispatcher(DispatcherConfig(group_size=2, batch_groups=1))
    requests = before.admit(Prompt(prompt_id="p", text="1+1", answer="2"), [0]).requests
    before.mark_published()
    await bus.kv_put(SNAPSHOT_KEY, before.snapshot().model_dump_json().encode())
    await bus.consumer(ConsumerSpec("dispatcher", s.scored))  # the previous one's, durable
    for request in requests:
        trajectory = Trajectory(
            request=request,
            version=0,
            prompt_token_ids=(),
            completion_token_ids=(1,),
            logprobs=(-0.1,),
            loss_mask=(1,),
            text="2",
            finish_reason="stop",
        )
        await bus.publish_event(s.scored, ScoredTrajectory(trajectory=trajectory, reward=1.0))
    letters = await bus.consumer(ConsumerSpec("audit", s.deadletter))
    service = DispatchService(bus, Dispatcher(DispatcherConfig(group_size=2, batch_groups=1)))
    task = asyncio.create_task(service.run())
    try:
        while service.dispatcher.ledger_state.counts(0).finished < 1:
            await asyncio.wait_for(service._changed.wait(), 5.0)
            service._changed.clear()
        assert await letters.fetch(batch=8, timeout=0.2) == []
    finally:
        service.stop()
        await asyncio.wait_for(task, 10)
        await bus.close()
