"""The stage runtime on MemoryBus: validation, retries, dead letters, ack order, drain."""

from __future__ import annotations

import asyncio

import pytest

from dora.bus import Bus, ConsumerSpec, MemoryBroker, MemoryBus
from dora.events import DeadLetter, Event, Prompt, ScoredTrajectory
from dora.stage import (
    Context,
    Hold,
    Reject,
    RetryPolicy,
    Stage,
    StageError,
    StageRunner,
    derived_id,
    stage,
)
from dora.subjects import Subjects

FAST = RetryPolicy(max_deliver=3, backoff_s=0.01, max_backoff_s=0.02, ack_wait_s=5.0)


class Echo(Prompt):
    """An output type for tests (a Prompt subtype travels on the metrics family here)."""


def prompt(i: int) -> Prompt:
    return Prompt(event_id=f"p{i}", prompt_id=f"id{i}", text=f"Q{i}", answer=str(i))


async def collect(bus: Bus, subject: str, durable: str, n: int, timeout: float = 5.0) -> list:
    consumer = await bus.consumer(ConsumerSpec(durable, subject))
    out: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(out) < n and loop.time() < deadline:
        for msg in await consumer.fetch(batch=n - len(out), timeout=0.2):
            out.append(msg.data)
            await msg.ack()
    return out


@pytest.fixture
async def bus() -> MemoryBus:
    client = MemoryBus(Subjects("unit"))
    await client.connect()
    return client


class Recorder(Stage):
    """Processes prompts into Echo events on `metrics`; records what it saw."""

    consumes = "prompts"
    emits = {Echo: "metrics"}
    retry = FAST

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.seen: list[tuple[str, int]] = []
        self.fail_times = 0

    async def handle(self, event: Prompt, ctx: Context) -> Echo:
        self.seen.append((event.event_id, ctx.deliveries))
        if sum(1 for e, _ in self.seen if e == event.event_id) <= self.fail_times:
            raise RuntimeError("boom")
        return Echo(event_id=derived_id(event.event_id), prompt_id=event.prompt_id, text="ok")


async def run_until(runner: StageRunner, cond, timeout: float = 5.0) -> None:
    await runner.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await runner.stop()
    assert cond(), "condition not reached"


async def test_invalid_payloads_are_dead_lettered_and_valid_ones_processed(bus: MemoryBus) -> None:
    s = bus.subjects
    dl = await bus.consumer(ConsumerSpec("dl", s.deadletter))
    out = await bus.consumer(ConsumerSpec("out", s.metrics))
    bad = {
        b"{not json": "Invalid JSON",
        b"\xff\xfe\x00binary": "Invalid JSON",
        b'{"prompt_id": 5, "text": "x"}': "prompt_id",
        b'{"prompt_id": "a", "text": "x", "evil": 1}': "evil",
        b'{"prompt_id": "a", "text": "x", "schema_version": 2}': "schema_version",
        b'{"prompt_id": "' + b"a" * 5000 + b'", "text": "x"}': "prompt_id",
    }
    for i, payload in enumerate(bad):
        await bus.publish(s.prompts, payload, msg_id=f"bad{i}")
        await bus.publish_event(s.prompts, prompt(i))
    rec = Recorder()
    runner = StageRunner(rec, bus)
    await run_until(runner, lambda: runner.stats.processed + runner.stats.dead_lettered == 12)
    letters = [DeadLetter.model_validate_json(m.data) for m in await dl.fetch(batch=20)]
    assert len(letters) == len(bad) == runner.stats.dead_lettered
    for letter, (payload, needle) in zip(letters, bad.items(), strict=True):
        assert letter.stage == "recorder" and letter.subject == s.prompts
        assert needle in letter.reason and letter.reason.startswith("invalid Prompt")
        if letter.payload_encoding == "base64":
            import base64

            assert base64.b64decode(letter.payload) == payload
        else:
            assert letter.payload.encode() == payload
    assert len(await out.fetch(batch=20)) == 6
    assert sorted(e for e, _ in rec.seen) == sorted(f"p{i}" for i in range(6))


async def test_retry_with_backoff_then_dead_letter_after_max_deliveries(bus: MemoryBus) -> None:
    s = bus.subjects
    dl = await bus.consumer(ConsumerSpec("dl", s.deadletter))
    rec = Recorder()
    rec.fail_times = 99
    await bus.publish_event(s.prompts, prompt(0))
    runner = StageRunner(rec, bus)
    await run_until(runner, lambda: runner.stats.dead_lettered == 1)
    assert rec.seen == [("p0", 1), ("p0", 2), ("p0", 3)]
    assert runner.stats.retried == 2 and runner.stats.processed == 0
    (msg,) = await dl.fetch(batch=5)
    letter = DeadLetter.model_validate_json(msg.data)
    assert letter.deliveries == 3
    assert "handler failed on delivery 3/3" in letter.reason
    assert "RuntimeError: boom" in letter.reason
    assert FAST.delay(1) == 0.01 and FAST.delay(2) == 0.02 and FAST.delay(5) == 0.02


async def test_transient_failure_is_retried_and_published_once(bus: MemoryBus) -> None:
    out = await bus.consumer(ConsumerSpec("out", bus.subjects.metrics))
    rec = Recorder()
    rec.fail_times = 2
    await bus.publish_event(bus.subjects.prompts, prompt(0))
    runner = StageRunner(rec, bus)
    await run_until(runner, lambda: runner.stats.processed == 1)
    assert [d for _, d in rec.seen] == [1, 2, 3]
    assert len(await out.fetch(batch=5)) == 1


class FlakyBus(MemoryBus):
    """Fails the first ``fail`` publishes to one subject (the stage's output)."""

    def __init__(self, *a: object, fail_subject: str, fail: int, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.fail_subject, self.fail = fail_subject, fail

    async def publish(self, subject: str, data: bytes, **kw: object):  # type: ignore[override]
        if subject == self.fail_subject and self.fail > 0:
            self.fail -= 1
            raise ConnectionError("publish failed")
        return await super().publish(subject, data, **kw)  # type: ignore[arg-type]


async def test_ack_only_after_publish_succeeds() -> None:
    subjects = Subjects("unit")
    broker = MemoryBroker()
    bus = FlakyBus(subjects, broker=broker, fail_subject=subjects.metrics, fail=1)
    await bus.connect()
    out = await bus.consumer(ConsumerSpec("out", subjects.metrics))
    await bus.publish_event(subjects.prompts, prompt(0))
    rec = Recorder()
    runner = StageRunner(rec, bus)
    await run_until(runner, lambda: runner.stats.processed == 1)
    # the failed publish left the input unacked: it came back and was published then
    assert [d for _, d in rec.seen] == [1, 2]
    assert runner.stats.retried == 1
    assert len(await out.fetch(batch=5)) == 1
    state = await (await bus.consumer(runner.consumer_spec())).state()
    assert state.depth == 0


async def test_reject_and_undeclared_output_are_dead_lettered(bus: MemoryBus) -> None:
    @stage(consumes="prompts", retry=FAST)
    async def picky(p: Prompt, ctx: Context) -> Event | None:
        if p.event_id == "p0":
            raise Reject("no zeros")
        return ScoredTrajectory.model_construct()  # not declared in emits

    dl = await bus.consumer(ConsumerSpec("dl", bus.subjects.deadletter))
    await bus.publish_event(bus.subjects.prompts, prompt(0))
    await bus.publish_event(bus.subjects.prompts, prompt(1))
    runner = StageRunner(picky, bus)
    await run_until(runner, lambda: runner.stats.dead_lettered == 2)
    letters = {
        DeadLetter.model_validate_json(m.data).deliveries: DeadLetter.model_validate_json(m.data)
        for m in await dl.fetch(batch=5)
    }
    assert "no zeros" in letters[1].reason
    assert "declares nothing" in letters[3].reason


async def test_stop_drains_in_flight_work(bus: MemoryBus) -> None:
    gate = asyncio.Event()
    started: list[str] = []

    @stage(consumes="prompts", emits={Echo: "metrics"}, concurrency=4)
    async def slow(p: Prompt, ctx: Context) -> Echo:
        started.append(p.event_id)
        await gate.wait()
        return Echo(event_id=derived_id(p.event_id), prompt_id=p.prompt_id, text="ok")

    out = await bus.consumer(ConsumerSpec("out", bus.subjects.metrics))
    for i in range(4):
        await bus.publish_event(bus.subjects.prompts, prompt(i))
    runner = StageRunner(slow, bus)
    await runner.start()
    while len(started) < 4:
        await asyncio.sleep(0.01)
    stopping = asyncio.create_task(runner.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # it waits for the in-flight handlers
    gate.set()
    await stopping
    assert runner.stats.processed == 4
    assert len(await out.fetch(batch=10)) == 4
    assert (await (await bus.consumer(runner.consumer_spec())).state()).depth == 0


async def test_drain_timeout_naks_unfinished_work_for_the_next_run(bus: MemoryBus) -> None:
    hang = asyncio.Event()

    @stage(consumes="prompts", emits={Echo: "metrics"}, concurrency=2)
    async def stuck(p: Prompt, ctx: Context) -> Echo:
        await hang.wait()
        return Echo(event_id=derived_id(p.event_id), prompt_id=p.prompt_id, text="ok")

    for i in range(2):
        await bus.publish_event(bus.subjects.prompts, prompt(i))
    first = StageRunner(stuck, bus, drain_timeout=0.05)
    await first.start()
    while first.stats.in_flight < 2:
        await asyncio.sleep(0.01)
    await first.stop()
    assert first.stats.processed == 0
    hang.set()
    second = StageRunner(stuck.clone(), bus)
    await run_until(second, lambda: second.stats.processed == 2)


def test_declaration_errors() -> None:
    with pytest.raises(StageError, match="input model"):

        @stage(consumes="prompts")
        async def untyped(event, ctx):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(StageError, match="consumes"):

        @stage()
        async def nothing(event: Prompt, ctx: Context) -> None:
            return None

    class Both(Stage):
        consumes = "prompts"

        async def handle(self, event: Prompt, ctx: Context) -> None: ...

        async def produce(self, ctx: Context):  # type: ignore[override]
            yield prompt(0)

    with pytest.raises(StageError, match="exactly one"):
        Both()
    with pytest.raises(StageError, match="name"):
        Recorder(name="bad name")


async def test_unknown_subject_family_is_refused(bus: MemoryBus) -> None:
    @stage(consumes="nowhere")
    async def lost(event: Prompt, ctx: Context) -> None:
        return None

    with pytest.raises(StageError, match="unknown family 'nowhere'"):
        await StageRunner(lost, bus).prepare()


async def test_message_that_outlived_its_deliveries_is_dead_lettered(bus: MemoryBus) -> None:
    """Deliveries that died with their process (never settled) still end in a dead letter."""
    rec = Recorder(retry=RetryPolicy(max_deliver=2, ack_wait_s=0.05))
    dl = await bus.consumer(ConsumerSpec("dl", bus.subjects.deadletter))
    await bus.publish_event(bus.subjects.prompts, prompt(0))
    runner = StageRunner(rec, bus)
    crashed = await bus.consumer(runner.consumer_spec())
    for _ in range(2):  # two deliveries taken by "processes" that died before settling
        assert len(await crashed.fetch(batch=1, timeout=2.0)) == 1
    await run_until(runner, lambda: runner.stats.dead_lettered == 1)
    assert rec.seen == []  # the handler is not tried again
    (msg,) = await dl.fetch(batch=5)
    letter = DeadLetter.model_validate_json(msg.data)
    assert letter.deliveries == 3 and "without being settled" in letter.reason


async def test_log_context_is_bound_per_message(bus: MemoryBus) -> None:
    from structlog.testing import capture_logs

    @stage(consumes="prompts")
    async def chatty(p: Prompt, ctx: Context) -> None:
        ctx.log.info("handling")

    await bus.publish_event(bus.subjects.prompts, prompt(7))
    runner = StageRunner(chatty, bus)
    with capture_logs() as logs:
        await run_until(runner, lambda: runner.stats.processed == 1)
    (entry,) = [e for e in logs if e["event"] == "handling"]
    assert entry["run"] == "unit" and entry["stage"] == "chatty"
    assert entry["subject"] == bus.subjects.prompts and entry["event_id"] == "p7"
    assert entry["deliveries"] == 1


async def test_held_messages_are_acked_only_when_the_stage_settles_them(bus: MemoryBus) -> None:
    """A batching consumer (a learner) acks a batch after using it; a nak'ed one comes back."""
    batches: list[list[str]] = []
    buffer: list[tuple[str, Hold]] = []

    @stage(consumes="prompts", concurrency=4)
    async def learner(p: Prompt, ctx: Context) -> None:
        buffer.append((p.event_id, ctx.hold()))
        if len(buffer) == 4:
            batch = buffer[:]
            buffer.clear()
            batches.append([e for e, _ in batch])
            for i, (_, h) in enumerate(batch):
                if len(batches) == 1 and i == 0:
                    h.nak()  # e.g. rejected by a staleness check: try it again later
                elif len(batches) == 1 and i == 1:
                    h.reject("too stale")
                else:
                    h.ack()

    dl = await bus.consumer(ConsumerSpec("dl", bus.subjects.deadletter))
    for i in range(3):
        await bus.publish_event(bus.subjects.prompts, prompt(i))
    runner = StageRunner(learner, bus)
    state = await bus.consumer(runner.consumer_spec())
    await runner.start()
    while runner.stats.in_flight < 3:
        await asyncio.sleep(0.01)
    assert (await state.state()).ack_pending == 3  # handled, but held: not acked yet
    for i in range(3, 7):
        await bus.publish_event(bus.subjects.prompts, prompt(i))
    await run_until(runner, lambda: len(batches) == 2)
    assert batches[0] == ["p0", "p1", "p2", "p3"]
    assert sorted(batches[1]) == ["p0", "p4", "p5", "p6"]  # p0 came back after its nak
    assert runner.stats.dead_lettered == 1 and runner.stats.retried == 1
    (msg,) = await dl.fetch(batch=5)
    assert "too stale" in DeadLetter.model_validate_json(msg.data).reason


async def test_stop_hands_back_held_messages_at_once(bus: MemoryBus) -> None:
    @stage(consumes="prompts", concurrency=8)
    async def hoarder(p: Prompt, ctx: Context) -> None:
        ctx.hold()  # a batch that never fills

    for i in range(3):
        await bus.publish_event(bus.subjects.prompts, prompt(i))
    runner = StageRunner(hoarder, bus, drain_timeout=60.0)
    await runner.start()
    while runner.stats.in_flight < 3:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(runner.stop(), timeout=10.0)  # not the 60 s drain timeout
    consumer = await bus.consumer(runner.consumer_spec())
    assert (await consumer.state()).depth == 3  # none lost
    again = await consumer.fetch(batch=3, timeout=1.0)
    assert len(again) == 3  # handed back (nak): deliverable now, not after the ack wait
