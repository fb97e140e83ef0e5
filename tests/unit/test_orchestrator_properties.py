"""Property tests: random fleets and workloads never make ``plan`` break a rule."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from dora.rollout.actions import AssignEngine, DrainEngine, MigrateRequests, PrioritizeRequests
from dora.rollout.estimates import LengthModel
from dora.rollout.orchestrator import OrchestratorConfig, plan, slots
from dora.rollout.state import ClusterState, EngineView, RequestView

STATES = ("idle", "loading", "serving", "serving", "serving", "draining", "stopped")
NOW = 1000.0


def random_engine(rnd: random.Random, eid: str, newest: int, tail: bool) -> EngineView:
    """One engine; with ``tail`` an old version's engine, thinly or fully occupied."""
    state = "serving" if tail else rnd.choice(STATES)
    total = rnd.randint(20, 400)
    max_running = rnd.randint(0, 12)
    version = None if state == "idle" and rnd.random() < 0.5 else rnd.randint(0, newest)
    if tail:
        version = max(0, newest - 1)
    assigned = None if state == "idle" else rnd.choice([version, version, newest])
    requests: list[RequestView] = []
    if version is not None and state in ("serving", "draining", "idle"):
        used = 0
        count = rnd.randint(1, 3) if tail and rnd.random() < 0.6 else rnd.randint(0, 12)
        for i in range(count if not max_running else min(count, max_running)):
            blocks = rnd.randint(1, 30)
            if used + blocks > total:
                break
            used += blocks
            requests.append(
                RequestView(
                    f"{eid}-r{i}",
                    version,
                    rnd.randint(0, 3000),
                    4096,
                    blocks,
                    priority=rnd.choice([0, 0, 10]),
                    last_migrated_at=rnd.choice([None, None, None, NOW - 5, NOW - 100]),
                )
            )
    return EngineView(
        eid,
        state,  # type: ignore[arg-type]
        version,
        assigned,
        total,
        sum(r.kv_blocks for r in requests),
        block_size=16,
        max_running=max_running,
        tokens_per_s=rnd.choice([0.0, 0.0, 500.0, 3000.0]),
        requests=tuple(requests),
        assigned_at=rnd.choice([None, None, NOW - 1, NOW - 500]),
    )


@st.composite
def clusters(draw: st.DrawFn) -> ClusterState:
    """Random fleets; about half hold an old version's long tail next to a deep new queue."""
    seed = draw(st.integers(0, 2**32 - 1))
    newest = draw(st.integers(0, 3))
    n = draw(st.integers(1, 24))
    tail = draw(st.integers(0, n))
    rnd = random.Random(seed)
    fleet = tuple(random_engine(rnd, f"e{i:02d}", newest, i < tail) for i in range(n))
    queues = {v: rnd.randint(0, 60) for v in range(newest + 1) if rnd.random() < 0.4}
    if tail and rnd.random() < 0.7:
        queues = {newest: rnd.randint(50, 500)}
    lengths = [rnd.choice([rnd.randint(1, 300), rnd.randint(1, 4000)]) for _ in range(50)]
    return ClusterState(
        now=NOW,
        engines=fleet,
        queue_depths=queues,
        newest_version=newest,
        learner_step=newest,
        staleness_bound=draw(st.integers(1, 3)),
        lengths=LengthModel.from_lengths(lengths[: draw(st.integers(0, 50))]),
    )


configs = st.builds(
    OrchestratorConfig,
    max_actions=st.integers(1, 200),
    consolidate_below=st.sampled_from([0.3, 0.5, 0.9]),
    target_fill=st.sampled_from([0.5, 0.9, 1.0]),
    min_saving_s=st.sampled_from([0.0, 1.0]),
    consolidate_without_demand=st.booleans(),
    urgency_horizon_steps=st.integers(0, 1),
    migrate_urgent=st.booleans(),
)


def tail(state: ClusterState, e: EngineView) -> float:
    """Expected tokens left to the engine's longest request."""
    return max((state.lengths.remaining(r.generated, r.max_tokens) for r in e.requests), default=0)


def effective_pulls(state: ClusterState, actions) -> dict[str, int | None]:
    """What each usable engine pulls once the plan is applied."""
    pulls = {e.engine_id: e.pulls for e in state.engines if e.state != "stopped"}
    for a in actions:
        if isinstance(a, AssignEngine):
            pulls[a.engine_id] = a.version
        elif isinstance(a, DrainEngine):
            pulls[a.engine_id] = None
    return pulls


@settings(max_examples=400, deadline=None)
@given(clusters(), configs)
def test_plan_never_breaks_a_rule(state: ClusterState, config: OrchestratorConfig) -> None:
    actions = plan(state, config)
    by_id = {e.engine_id: e for e in state.engines}
    queued = {v for v, d in state.queue_depths.items() if d > 0}

    # bounded
    assert len(actions) <= config.max_actions
    moved_requests = [r for a in actions if isinstance(a, MigrateRequests) for r in a.request_ids]
    assert len(moved_requests) <= config.max_migrated_requests
    assert len(moved_requests) == len(set(moved_requests)), "a request moved twice in one plan"

    # each engine assigned at most once, never a stopped one, only a useful version
    assigned = [a.engine_id for a in actions if isinstance(a, AssignEngine)]
    assert len(assigned) == len(set(assigned))
    for a in actions:
        if isinstance(a, AssignEngine):
            assert by_id[a.engine_id].state != "stopped"
            assert a.version == state.newest_version or a.version in queued

    # migrations: same version, live serving target with room, cooled-down requests
    sources = {a.source for a in actions if isinstance(a, MigrateRequests)}
    incoming: dict[str, int] = {}
    seats: dict[str, int] = {}
    for a in actions:
        if not isinstance(a, MigrateRequests):
            continue
        src, dst = by_id[a.source], by_id[a.target]
        assert a.source != a.target and a.target not in sources
        assert dst.state == "serving" and dst.version == a.version
        if dst.assigned_version != a.version:  # switching away: takes only shorter tails
            assert tail(state, dst) >= tail(state, src)
        assert a.target not in assigned, "a target must not be reassigned in the same plan"
        held = {r.request_id: r for r in src.requests}
        for rid in a.request_ids:
            r = held[rid]
            assert r.version == a.version
            assert r.last_migrated_at is None or NOW - r.last_migrated_at >= 30.0
            if not config.migrate_urgent:
                assert state.steps_left(r.version) > config.urgency_horizon_steps
        assert a.kv_blocks == sum(held[rid].kv_blocks for rid in a.request_ids)
        incoming[a.target] = incoming.get(a.target, 0) + a.kv_blocks
        seats[a.target] = seats.get(a.target, 0) + len(a.request_ids)
    for tid, blocks in incoming.items():
        t = by_id[tid]
        assert t.kv_blocks_used + blocks <= t.kv_blocks_total
        assert t.running + t.waiting + seats[tid] <= slots(t, config)
    # an evacuated source is fully emptied and then serves the newest version
    pulls = effective_pulls(state, actions)
    for sid in sources:
        moved = {
            r
            for a in actions
            if isinstance(a, MigrateRequests) and a.source == sid
            for r in a.request_ids
        }
        assert moved == {r.request_id for r in by_id[sid].requests}
        assert pulls[sid] == state.newest_version

    # urgency: only urgent requests, on the engine that holds them
    for a in actions:
        if isinstance(a, PrioritizeRequests):
            held = {r.request_id: r for r in by_id[a.engine_id].requests}
            for rid in a.request_ids:
                assert state.steps_left(held[rid].version) <= config.urgency_horizon_steps
                assert held[rid].priority < a.priority

    if len(actions) >= config.max_actions:
        return  # truncated plans are checked for the bounds only
    # every queued version keeps a puller when there are enough engines
    usable = [e for e in state.engines if e.state != "stopped"]
    if len(usable) >= len(queued):
        served = set(pulls.values())
        assert queued <= served, f"unserved versions {queued - served}"
    # no engine idles while a queue has work
    if queued:
        for e in usable:
            if e.running or e.waiting or e.state == "loading":
                continue
            p = pulls[e.engine_id]
            assert p is not None and (p == state.newest_version or p in queued), e.engine_id


@settings(max_examples=100, deadline=None)
@given(clusters(), configs, st.randoms(use_true_random=False))
def test_plan_is_deterministic(state: ClusterState, config: OrchestratorConfig, rnd) -> None:
    shuffled = list(state.engines)
    rnd.shuffle(shuffled)
    first = plan(state, config)
    assert plan(state, config) == first
    assert plan(replace(state, engines=tuple(shuffled)), config) == first


@pytest.mark.parametrize("kind", [MigrateRequests, PrioritizeRequests, AssignEngine])
def test_strategy_is_not_vacuous(kind: type) -> None:
    """The random fleets do reach every kind of action (else the property proves little)."""
    found = find(
        clusters(),
        lambda s: any(isinstance(a, kind) for a in plan(s)),
        settings=settings(max_examples=500, database=None),
    )
    assert any(isinstance(a, kind) for a in plan(found))
