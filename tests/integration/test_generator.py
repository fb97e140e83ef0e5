"""Generator stage + migrator on a real nats-server, with a deterministic engine double."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from dora.bus import Bus, ConsumerSpec, NatsBus
from dora.bus.server import NatsServer
from dora.events import (
    AssignVersion,
    ControlReply,
    DeadLetter,
    Drain,
    Migrate,
    RolloutRequest,
    SamplingParams,
    Trajectory,
)
from dora.rollout.generator import Generator
from dora.rollout.generator_config import GeneratorConfig
from dora.rollout.migrator import Migrator
from dora.subjects import Subjects
from tests.fakes import FakeEngine, fake_request

pytestmark = pytest.mark.nats


async def no_weights(version: int) -> dict[str, Any]:
    return {}


request = fake_request


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a condition the system under test makes true (polls; fails on timeout)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(*generators: Generator) -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks = [asyncio.create_task(g.run()) for g in generators]
    await asyncio.gather(*(g.ready.wait() for g in generators))
    try:
        yield tasks
    finally:
        for g in generators:
            g.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(bus: Bus, count: int, timeout: float = 15.0) -> list[Trajectory]:
    consumer = await bus.consumer(ConsumerSpec("audit", bus.subjects.trajectories))
    out: list[Trajectory] = []
    async with asyncio.timeout(timeout):
        while len(out) < count:
            for msg in await consumer.fetch(batch=50, timeout=0.5):
                out.append(Trajectory.model_validate_json(msg.data))
                await msg.ack()
    assert await consumer.fetch(batch=1, timeout=0.3) == [], "more trajectories than requests"
    return out


@pytest.fixture
async def bus2(nats_server: NatsServer, subjects: Subjects) -> AsyncIterator[NatsBus]:
    """A second client of the same server (an engine in another process)."""
    client = NatsBus(subjects, nats_server.url)
    await client.connect()
    yield client
    await client.close()


def generator(bus: Bus, engine_id: str, **kw: Any) -> Generator:
    engine = FakeEngine(engine_id, tokens_per_step=kw.pop("tokens_per_step", 1))
    kw.setdefault("initial_version", 0)
    config = GeneratorConfig(engine_id=engine_id, **kw)
    return Generator(engine, bus, no_weights, config)


async def test_one_trajectory_per_request_and_bounded_pull(nats_bus: NatsBus) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    gen = generator(nats_bus, "e0", max_running=3)
    peak = 0

    original = gen.engine.add_request

    def tracking_add(req: RolloutRequest) -> None:
        nonlocal peak
        original(req)
        peak = max(peak, len(gen.engine.running))

    gen.engine.add_request = tracking_add  # type: ignore[method-assign]
    for i in range(20):
        await nats_bus.publish_event(nats_bus.subjects.requests(0), request(i))
    async with running(gen):
        got = await collect(nats_bus, 20)
    assert sorted(t.request.request_id for t in got) == sorted(f"r{i}" for i in range(20))
    assert all(t.event_id == f"traj-{t.request.request_id}" for t in got)
    assert peak <= 3
    assert all(
        list(t.completion_token_ids) == [(t.request.sampling.seed + k) % 97 for k in range(12)]
        for t in got
    )


async def test_bad_request_is_dead_lettered_and_serving_continues(nats_bus: NatsBus) -> None:
    dead = await nats_bus.consumer(ConsumerSpec("dl", nats_bus.subjects.deadletter))
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    await nats_bus.publish(nats_bus.subjects.requests(0), b"{not json", msg_id="bad-1")
    await nats_bus.publish_event(
        nats_bus.subjects.requests(0),
        request(1).model_copy(update={"sampling": SamplingParams(max_tokens=0)}),
    )
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(2))
    gen = generator(nats_bus, "e0")
    async with running(gen):
        got = await collect(nats_bus, 1)
        letters = []
        async with asyncio.timeout(10):
            while len(letters) < 2:
                for msg in await dead.fetch(batch=10, timeout=0.5):
                    letters.append(DeadLetter.model_validate_json(msg.data))
                    await msg.ack()
    assert [t.request.request_id for t in got] == ["r2"]
    reasons = sorted(letter.reason for letter in letters)
    assert any(r.startswith("invalid RolloutRequest: <payload>: Invalid JSON") for r in reasons)
    assert any("max_tokens" in r for r in reasons)


async def test_migration_moves_request_with_its_lease(nats_bus: NatsBus, bus2: NatsBus) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    source = generator(nats_bus, "src", tokens_per_step=1)
    source.engine.freeze_at = 7
    target = generator(bus2, "dst")
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(1, max_tokens=30))
    async with running(source):
        await until(lambda: any(len(s.tokens) == 7 for s in source.engine.running.values()))
        async with running(target):
            # the target must not pull anything itself
            reply = await nats_bus.request(
                nats_bus.subjects.control("dst"), Drain(engine_id="dst").model_dump_json().encode()
            )
            assert ControlReply.model_validate_json(reply).ok
            await nats_bus.request(
                nats_bus.subjects.control("dst"),
                AssignVersion(engine_id="dst", version=0).model_dump_json().encode(),
            )
            prefill_before = target.engine.prefill_tokens
            outcomes = await Migrator(nats_bus).execute(
                Migrate(source="src", target="dst", version=0, request_ids=("r1",))
            )
            assert [o.ok for o in outcomes] == [True]
            (traj,) = await collect(nats_bus, 1)
    assert traj.engines == ("src", "dst")
    assert [(m.source, m.target, m.at_token) for m in traj.migrations] == [("src", "dst", 7)]
    assert traj.completion_token_ids == tuple((1 + k) % 97 for k in range(30))
    assert target.engine.prefill_tokens == prefill_before  # no re-prefill on import
    assert source.engine.num_requests() == 0 and not source.held


async def test_failed_import_restores_request_on_source(nats_bus: NatsBus, bus2: NatsBus) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    source = generator(nats_bus, "src")
    source.engine.freeze_at = 4
    target = generator(bus2, "dst", initial_version=None)  # not serving v0: import must fail
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(3, max_tokens=10))
    async with running(source, target):
        await until(lambda: any(len(s.tokens) == 4 for s in source.engine.running.values()))
        outcomes = await Migrator(nats_bus, timeout_s=5).execute(
            Migrate(source="src", target="dst", version=0, request_ids=("r3",))
        )
        assert [o.ok for o in outcomes] == [False]
        assert "import" in outcomes[0].reason
        source.engine.freeze_at = None
        (traj,) = await collect(nats_bus, 1)
    assert traj.engines == ("src",) and traj.migrations == ()
    assert traj.completion_token_ids == tuple((3 + k) % 97 for k in range(10))


async def test_crashed_engine_requests_are_regenerated_once(
    nats_bus: NatsBus, bus2: NatsBus, nats_server: NatsServer, subjects: Subjects
) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    crash_bus = NatsBus(subjects, nats_server.url)
    await crash_bus.connect()
    doomed = generator(crash_bus, "doomed", heartbeat_interval_s=0.2, queue_ack_wait_s=1.0)
    doomed.engine.freeze_at = 3
    for i in range(6):
        await nats_bus.publish_event(nats_bus.subjects.requests(0), request(i, max_tokens=8))
    task = asyncio.create_task(doomed.run())
    await until(lambda: len(doomed.engine.running) == 6)
    await crash_bus.nc.close()  # the connection dies first: nothing gets settled
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    survivor = generator(bus2, "survivor")
    async with running(survivor):
        got = await collect(nats_bus, 6)
    assert sorted(t.request.request_id for t in got) == [f"r{i}" for i in range(6)]
    assert all(t.engines == ("survivor",) and t.version == 0 for t in got)


async def test_partial_mode_resubmits_under_new_version(nats_bus: NatsBus) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    gen = generator(nats_bus, "e0", mode="partial")
    gen.engine.freeze_at = 5
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(1, max_tokens=9))
    async with running(gen):
        await until(lambda: any(len(s.tokens) == 5 for s in gen.engine.running.values()))
        await nats_bus.request(
            nats_bus.subjects.control("e0"),
            AssignVersion(engine_id="e0", version=1).model_dump_json().encode(),
        )
        gen.engine.freeze_at = None
        (traj,) = await collect(nats_bus, 1)
    assert traj.version == 1
    assert traj.token_versions == (0,) * 5 + (1,) * 4
    assert traj.reprefilled_tokens == 5
    assert gen.engine.loads == [0, 1]


async def test_a_request_redelivered_while_still_generating_is_kept_not_rerun(
    nats_bus: NatsBus,
) -> None:
    """A lapsed lease (heartbeats that could not reach the server, as in a NATS outage) makes
    the queue redeliver a request this generator still runs: it takes the new delivery as the
    lease and generates the request once, instead of dead-lettering it as a duplicate."""
    dead = await nats_bus.consumer(ConsumerSpec("dl", nats_bus.subjects.deadletter))
    gen = generator(nats_bus, "e0", queue_ack_wait_s=0.5)
    gen._heartbeat = asyncio.Event().wait  # type: ignore[method-assign]  # no beat gets through
    gen.engine.freeze_at = 3  # mid-way, until the lease has lapsed twice
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(1))
    async with running(gen):
        await until(lambda: gen.stats.rebound >= 2)
        gen.engine.freeze_at = None
        (got,) = await collect(nats_bus, 1)
    assert got.request.request_id == "r1" and gen.stats.pulled == 1
    assert await dead.fetch(batch=5, timeout=0.3) == []
