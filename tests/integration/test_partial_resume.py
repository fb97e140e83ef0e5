"""Partial-rollout baseline: interrupted requests resume first, on the real generator path.

Runs on MemoryBus and on a real nats-server (the ``bus`` fixture): the order is decided by the
generator (in-place resume, older-version backlog before the new queue), not by the bus.
"""

from __future__ import annotations

import asyncio

from dora.bus import Bus, ConsumerSpec
from dora.events import AssignVersion, RolloutRequest, Trajectory
from dora.rollout.generator_config import request_queue_spec
from dora.rollout.partial import RESUME_PRIORITY
from tests.fakes import fake_request
from tests.integration.test_generator import collect, generator, running, until


async def assign(bus: Bus, engine_id: str, version: int) -> None:
    command = AssignVersion(engine_id=engine_id, version=version)
    await bus.request(bus.subjects.control(engine_id), command.model_dump_json().encode())


async def test_interrupted_requests_resume_before_newer_queued_ones(bus: Bus) -> None:
    await bus.consumer(ConsumerSpec("audit", bus.subjects.trajectories))
    gen = generator(bus, "e0", mode="partial", max_running=2)
    added: list[RolloutRequest] = []
    original = gen.engine.add_request

    def tracking_add(req: RolloutRequest) -> None:
        original(req)
        added.append(req)

    gen.engine.add_request = tracking_add  # type: ignore[method-assign]
    gen.engine.freeze_at = 5
    for i in (1, 2):  # in flight at the update
        await bus.publish_event(bus.subjects.requests(0), fake_request(i, max_tokens=9))
    async with running(gen):
        await until(lambda: sum(len(s.tokens) == 5 for s in gen.engine.running.values()) == 2)
        # queued, not pulled (the engine is full): one old-version request, two new ones
        await bus.publish_event(bus.subjects.requests(0), fake_request(6, max_tokens=4))
        for i in (3, 4):
            await bus.publish_event(bus.subjects.requests(1), fake_request(i, 1, max_tokens=4))
        await asyncio.sleep(0)
        await assign(bus, "e0", 1)
        gen.engine.freeze_at = None
        got = await collect(bus, 5)
    after = [r for r in added if r.version == 1]
    order = [r.request_id for r in after]
    assert set(order[:2]) == {"r1", "r2"}, order  # resumed first, on this engine
    assert order[2] == "r6", order  # then the request still queued under v0
    assert set(order[3:]) == {"r3", "r4"}, order
    assert all(r.priority >= RESUME_PRIORITY for r in after[:3])
    by_id: dict[str, Trajectory] = {t.request.request_id: t for t in got}
    assert sorted(by_id) == ["r1", "r2", "r3", "r4", "r6"]  # one trajectory each, none lost
    for rid in ("r1", "r2"):
        t = by_id[rid]
        assert t.version == 1
        assert t.token_versions == (0,) * 5 + (1,) * 4
        assert t.reprefilled_tokens == 5
    assert by_id["r6"].version == 1 and by_id["r6"].reprefilled_tokens == 0
    assert gen.engine.loads == [0, 1]
    assert gen.stats.resubmitted == 2


async def test_a_handed_back_old_version_request_is_still_resumed(bus: Bus) -> None:
    """A request another engine pulled and handed back (nak) counts as delivered, not pending:
    the backlog must still fetch it, or it is never generated after every engine moved on."""
    await bus.consumer(ConsumerSpec("audit", bus.subjects.trajectories))
    gen = generator(bus, "e0", mode="partial", max_running=1)
    gen.engine.freeze_at = 3
    await bus.publish_event(bus.subjects.requests(0), fake_request(1, max_tokens=5))
    async with running(gen):
        await until(lambda: any(len(s.tokens) == 3 for s in gen.engine.running.values()))
        await bus.publish_event(bus.subjects.requests(0), fake_request(7, max_tokens=3))
        other = await bus.consumer(request_queue_spec(bus.subjects, 0))  # a second engine
        (msg,) = await other.fetch(batch=1, timeout=2.0)
        await msg.nak()  # reassigned mid-fetch: handed back
        assert (await other.state()).depth == 2  # r1 held by e0, r7 handed back
        await assign(bus, "e0", 1)
        gen.engine.freeze_at = None
        got = await collect(bus, 2)
    by_id = {t.request.request_id: t for t in got}
    assert sorted(by_id) == ["r1", "r7"]  # the handed-back request was generated, not stranded
    assert by_id["r7"].version == 1
