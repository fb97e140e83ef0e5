"""Emulated fleet plumbing: request pulls capped per fetch, the pacing sleep woken by work,
engine traces, and the engine-time breakdown they reduce to."""

from __future__ import annotations

import pytest

from dora.bus import ConsumerSpec, MemoryBus
from dora.engines.sim import SimEngine, workload_preset
from dora.events import Prompt, RolloutRequest, SamplingParams
from dora.subjects import Subjects
from dora.testing.emulated_engine import GroupSpecs, PacedSimEngine, TraceEvent
from dora.testing.emulated_trace import breakdown, queue_points
from dora.testing.emulated_workers import GeneratorBus


def _request(i: int, group: int = 0) -> RolloutRequest:
    return RolloutRequest(
        request_id=f"p{group}/{i}",
        prompt=Prompt(prompt_id=f"p{group}", text="x"),
        group_id=f"p{group}",
        group_index=i,
        group_size=8,
        sampling=SamplingParams(seed=i, max_tokens=16384),
        version=0,
    )


def _paced(scale: float = 50.0, max_sleep_s: float = 0.02) -> PacedSimEngine:
    workload = workload_preset("dapo-16k")
    engine = PacedSimEngine(
        "e0", "dense-32b", workload, 0, scale, 8, GroupSpecs(workload, 0, 8), max_sleep_s
    )
    engine.core.version = 0
    engine.restart_clock()
    return engine


class _Woken:
    """Counts ``wake()`` calls (stands in for the engine)."""

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1


async def test_request_pulls_are_capped_and_wake_the_engine() -> None:
    bus = MemoryBus(Subjects("t"))
    await bus.connect()
    engine = _Woken()
    gbus = GeneratorBus(bus, engine, pull_batch=1)  # type: ignore[arg-type]
    for i in range(5):
        await bus.publish_event(bus.subjects.requests(0), _request(i))
    queue = await gbus.consumer(ConsumerSpec("gen-v0", bus.subjects.requests(0)))
    got = await queue.fetch(batch=5, timeout=0.1)
    assert len(got) == 1  # one request per pull, whatever the room
    assert engine.wakes == 1
    uncapped = GeneratorBus(bus, engine, pull_batch=None)  # type: ignore[arg-type]
    queue2 = await uncapped.consumer(ConsumerSpec("gen-v0", bus.subjects.requests(0)))
    assert len(await queue2.fetch(batch=5, timeout=0.1)) == 4  # the rest, in one pull
    await bus.publish(bus.subjects.scored, b"{}")
    other = await gbus.consumer(ConsumerSpec("learner", bus.subjects.scored))
    assert not hasattr(other, "cap")  # only request queues are capped
    await bus.close()


async def test_control_commands_wake_the_engine() -> None:
    bus = MemoryBus(Subjects("t"))
    await bus.connect()
    engine = _Woken()
    gbus = GeneratorBus(bus, engine, pull_batch=1)  # type: ignore[arg-type]

    async def handler(data: bytes) -> bytes:
        return data + b"!"

    await gbus.serve(bus.subjects.control("e0"), handler)
    assert await bus.request(bus.subjects.control("e0"), b"hi") == b"hi!"
    assert engine.wakes == 1
    await bus.close()


def test_pull_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pull_batch"):
        GeneratorBus(MemoryBus(Subjects("t")), _Woken(), pull_batch=0)  # type: ignore[arg-type]


@pytest.mark.timeout(20)
def test_wake_ends_the_pacing_sleep() -> None:
    # an hour-long pacing sleep: step() returns only because wake() was called first
    engine = SimEngine("e0", "dense-32b", "dapo-16k", time_scale=1e-6, max_sleep_s=3600.0)
    engine.load_weights(0)
    engine.add_request(_request(0))
    engine.wake()
    assert engine.step() == []  # no request can finish in a microsecond of virtual time
    assert not engine._wake.is_set()  # consumed: the next step paces again


def test_paced_engine_traces_what_happens() -> None:
    engine = _paced(scale=1e6)  # a million virtual seconds per wall second
    engine.add_request(_request(0))
    engine.add_request(_request(1))
    part = engine.abort("p0/1")
    assert part.request.request_id == "p0/1"
    done = []
    while engine.has_work():
        done += engine.step()
    kinds = [(ev.kind, ev.request_id, ev.requests) for ev in engine.trace]
    assert kinds == [
        ("add", "p0/0", 1),
        ("add", "p0/1", 2),
        ("abort", "p0/1", 1),
        ("finish", "p0/0", 0),
    ]
    assert engine.trace[-1].decode_s == engine.core.decode_s > 0


def _ev(kind: str, at: float, rid: str, extra: float, n: int) -> TraceEvent:
    return TraceEvent(kind, at, rid, extra, n, 0.0)


def test_queue_points_count_dispatched_but_not_taken() -> None:
    traces = {"a": [_ev("add", 3.0, "r1", 1.0, 1)], "b": [_ev("add", 4.0, "r2", 2.0, 1)]}
    assert queue_points(traces.values()) == [(1.0, 1), (2.0, 2), (3.0, 1), (4.0, 0)]


def test_breakdown_splits_idle_time_by_queue_state() -> None:
    # window [0, 10], 2x time scale. Engine a takes r1 at 2 (dispatched at 0), holds it to 10.
    # Engine b is idle until it takes r2 at 8 (dispatched at 6), finishes it at 9.
    traces = {
        "a": [_ev("add", 2.0, "r1", 0.0, 1)],
        "b": [_ev("add", 8.0, "r2", 6.0, 1), _ev("finish", 9.0, "r2", 0.0, 0)],
    }
    busy = {"a": (12.0, 1.0, 0.0), "b": (2.0, 0.0, 1.0)}
    b = breakdown(traces, busy, 0.0, 10.0, 2.0)
    assert b.engine_s == 40.0
    assert (b.decode_s, b.prefill_s, b.load_s) == (14.0, 1.0, 1.0)
    # a idle 0-2 with r1 queued; b idle 0-2 queued, 2-6 empty, 6-8 queued, 9-10 empty
    assert b.idle_queued_s == pytest.approx(2 * (2 + 2 + 2))
    assert b.idle_empty_s == pytest.approx(2 * (4 + 1))
    assert b.pickup_s_mean == pytest.approx(2 * 2.0)
    # held: a 0 then 1 from 2; b 1 during 8-9
    assert b.held_mean == pytest.approx((8 + 1) / 2 / 10)
    assert b.held_spread == pytest.approx((6 + 1) / 10)
    assert b.fractions()["decode"] == pytest.approx(14 / 40)


@pytest.mark.parametrize("mode", ["partial", "dora"])
def test_sim_breakdown_observes_without_changing_the_run(mode: str) -> None:
    from dora.engines.sim import cost_preset
    from dora.sim import SimConfig, simulate
    from dora.testing.emulated_trace import sim_breakdown

    cfg = SimConfig(
        engines=4,
        mode=mode,  # type: ignore[arg-type]
        steps=3,
        batch_groups=8,
        group_size=4,
        cost=cost_preset("dense-32b"),
    )
    result, parts = sim_breakdown(cfg)
    plain = simulate(cfg)
    assert result.tokens_per_s == plain.tokens_per_s
    assert result.utilization == plain.utilization
    assert parts.decode_s / parts.engine_s == pytest.approx(plain.utilization)
    # time an engine sat empty is at most what it did not spend decoding, prefilling, loading
    idle = parts.idle_queued_s + parts.idle_empty_s
    assert idle <= parts.engine_s - parts.decode_s - parts.prefill_s - parts.load_s + 1e-6
    if mode == "partial":  # one queue, spread at once: nothing waits while an engine is empty
        assert parts.idle_queued_s == 0.0


def test_scorer_trims_a_payload_to_what_the_learner_needs() -> None:
    from dora.events import ResumeState
    from dora.testing.emulated_workers import trimmed

    engine = SimEngine("e0", "dense-7b", "dapo-16k", seed=0)
    engine.load_weights(1)
    first = _request(0).model_copy(update={"version": 1})
    part = ResumeState(token_ids=(5, 6, 7), logprobs=(-1.0,) * 3, token_versions=(0, 0, 1))
    engine.add_request(first.model_copy(update={"resume": part}))
    (full,) = [t for _ in iter(engine.has_work, False) for t in engine.step()]
    traj, completion, prompt = trimmed(full.model_dump_json().encode())
    assert (completion, prompt) == (len(full.completion_token_ids), len(full.prompt_token_ids))
    assert traj.request.resume is None and traj.request.request_id == "p0/0"
    assert traj.completion_token_ids == full.completion_token_ids[:1]
    assert traj.prompt_token_ids == full.prompt_token_ids[:1]
    assert len(traj.logprobs) == len(traj.loss_mask) == 1
    assert traj.token_versions == (0,)  # the oldest token's version
    assert traj.version == full.version == 1 and traj.turns == ()
