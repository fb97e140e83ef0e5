"""What the dispatcher cannot use on its observation subjects (scored, metrics, weights) goes
to the dead-letter subject with the reason, instead of a log line and a silent ack."""

from __future__ import annotations

import asyncio

from dora.bus import ConsumerSpec, MemoryBus
from dora.events import DeadLetter
from dora.rollout.dispatch_service import DispatchService
from dora.rollout.dispatcher import Dispatcher, DispatcherConfig
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
