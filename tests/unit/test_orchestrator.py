"""Rule-by-rule tests of the orchestrator policy on small hand-built fleets."""

from __future__ import annotations

import random

import pytest

from dora import events
from dora.rollout.actions import AssignEngine, MigrateRequests, PrioritizeRequests
from dora.rollout.estimates import LengthModel, LengthRecorder
from dora.rollout.orchestrator import OrchestratorConfig, plan
from dora.rollout.state import ClusterState, EngineView, RequestView

LONG_TAIL = LengthModel.from_lengths([50] * 50 + [200] * 30 + [2000] * 20)


def req(rid: str, version: int, generated: int = 100, blocks: int = 8, **kw) -> RequestView:
    return RequestView(rid, version, generated, kw.pop("max_tokens", 4096), blocks, **kw)


def eng(
    eid: str,
    version: int | None,
    requests: tuple[RequestView, ...] = (),
    *,
    state: str = "serving",
    assigned: int | str | None = "same",
    total: int = 1000,
    max_running: int = 16,
    **kw,
) -> EngineView:
    used = kw.pop("used", sum(r.kv_blocks for r in requests))
    return EngineView(
        eid,
        state,  # type: ignore[arg-type]
        version,
        version if assigned == "same" else assigned,  # type: ignore[arg-type]
        total,
        used,
        max_running=max_running,
        requests=requests,
        **kw,
    )


def cluster(*engines: EngineView, queues=None, newest=1, step=None, k=2, now=1000.0):
    return ClusterState(
        now=now,
        engines=tuple(engines),
        queue_depths=queues or {},
        newest_version=newest,
        learner_step=newest if step is None else step,
        staleness_bound=k,
        lengths=LONG_TAIL,
    )


def assigns(actions) -> dict[str, int]:
    return {a.engine_id: a.version for a in actions if isinstance(a, AssignEngine)}


def full(prefix: str, version: int, n: int = 14) -> tuple[RequestView, ...]:
    return tuple(req(f"{prefix}{i}", version, 10, 40) for i in range(n))


# ---------------------------------------------------------------------- serve / idle rules


def test_idle_engine_goes_to_newest_queue() -> None:
    state = cluster(eng("a", 1, full("a", 1)), eng("b", None, state="idle"), queues={1: 40})
    assert assigns(plan(state)) == {"b": 1}


def test_idle_engine_with_nothing_queued_preloads_newest() -> None:
    state = cluster(eng("a", 1, full("a", 1)), eng("b", None, state="idle"))
    assert assigns(plan(state)) == {"b": 1}


def test_old_engine_with_no_work_moves_to_newest() -> None:
    state = cluster(eng("a", 1, full("a", 1)), eng("b", 0), queues={1: 5})
    assert assigns(plan(state)) == {"b": 1}


def test_queue_without_puller_gets_engine_holding_its_weights_first() -> None:
    state = cluster(
        eng("a", 1, full("a", 1)),
        eng("b", 1, state="idle", assigned=None),
        eng("c", 0, state="idle", assigned=None),
        queues={0: 3, 1: 40},
        step=1,
    )
    actions = plan(state)
    assert assigns(actions)["c"] == 0  # no weight load needed for version 0
    assert assigns(actions)["b"] == 1


def test_draining_engine_is_undrained_to_serve_its_queue() -> None:
    state = cluster(
        eng("a", 1, full("a", 1)),
        eng("d", 0, (req("x", 0),), state="draining"),
        queues={0: 4},
    )
    assert assigns(plan(state)) == {"d": 0}


def test_unserved_version_takes_least_loaded_busy_engine_not_in_cooldown() -> None:
    state = cluster(
        eng("a", 1, full("a", 1, 12)),
        eng("b", 1, full("b", 1, 3), assigned_at=995.0),  # cooling (assigned 5 s ago)
        eng("c", 1, full("c", 1, 5)),
        queues={0: 4, 1: 100},
    )
    assert assigns(plan(state)) == {"c": 0}


def test_last_puller_of_a_queued_version_is_never_taken() -> None:
    state = cluster(eng("a", 1, full("a", 1, 2)), queues={1: 10, 0: 3})
    # One engine, two queued versions: taking it would leave version 1 unserved instead.
    assert assigns(plan(state)) == {}


def test_newest_gets_an_engine_so_the_dispatcher_can_tag_it() -> None:
    state = cluster(
        eng("a", 0, full("a", 0, 12)),
        eng("b", 0, full("b", 0, 4)),
        newest=1,
        queues={},
    )
    assert assigns(plan(state)) == {"b": 1}


# ---------------------------------------------------------------------- urgency


def test_urgent_requests_are_prioritized_once() -> None:
    urgent = eng("a", 0, (req("u1", 0), req("u2", 0, priority=10)))
    fresh = eng("b", 2, (req("f1", 2),))
    state = cluster(urgent, fresh, newest=2, step=2, k=2)
    prio = [a for a in plan(state) if isinstance(a, PrioritizeRequests)]
    assert prio == [PrioritizeRequests("a", ("u1",), 10, "urgent")]


def test_nothing_urgent_before_the_horizon() -> None:
    state = cluster(eng("a", 1, (req("r", 1),)), newest=2, step=2, k=2)
    assert not [a for a in plan(state) if isinstance(a, PrioritizeRequests)]
    cfg = OrchestratorConfig(urgency_horizon_steps=1)
    assert [a for a in plan(state, cfg) if isinstance(a, PrioritizeRequests)]


# ---------------------------------------------------------------------- consolidation


def tail_fleet(**kw) -> ClusterState:
    """Version 0's long tail spread thin over three engines; version 1 has a deep queue."""
    return cluster(
        eng("t0", 0, (req("x1", 0, 900, 60),), **kw),
        eng("t1", 0, (req("x2", 0, 800, 60), req("x3", 0, 700, 50)), **kw),
        eng("t2", 0, (req("x4", 0, 1000, 70), *full("y", 0, 6)), **kw),
        eng("n0", 1, full("n", 1, 16)),
        queues={1: 200},
        newest=1,
        k=4,
    )


def test_long_tail_is_consolidated_and_freed_engines_load_newest() -> None:
    actions = plan(tail_fleet())
    migrations = [a for a in actions if isinstance(a, MigrateRequests)]
    assert {m.source for m in migrations} == {"t0", "t1"}
    assert {m.target for m in migrations} == {"t2"}
    assert all(m.version == 0 for m in migrations)
    moved = {rid for m in migrations for rid in m.request_ids}
    assert moved == {"x1", "x2", "x3"}
    assert assigns(actions) == {"t0": 1, "t1": 1}


def test_requests_migrate_only_between_engines_of_one_kind() -> None:
    """A mixed fleet: the built-in engines' tails pack into the built-in target, the vLLM
    engine's tail into the vLLM target, never across (their KV layouts differ)."""
    state = cluster(
        eng("d0", 0, (req("a1", 0, 900, 60),)),
        eng("d1", 0, (req("a2", 0, 1000, 70), *full("y", 0, 6))),
        eng("v0", 0, (req("b1", 0, 900, 60),), kind="vllm"),
        eng("v1", 0, (req("b2", 0, 1000, 70), *full("z", 0, 6)), kind="vllm"),
        eng("n0", 1, full("n", 1, 16)),
        queues={1: 200},
        newest=1,
        k=4,
    )
    migrations = [a for a in plan(state) if isinstance(a, MigrateRequests)]
    assert {(m.source, m.target) for m in migrations} == {("d0", "d1"), ("v0", "v1")}
    lone = cluster(
        eng("d0", 0, (req("a1", 0, 900, 60),)),
        eng("v1", 0, (req("b2", 0, 1000, 70), *full("z", 0, 6)), kind="vllm"),
        eng("n0", 1, full("n", 1, 16)),
        queues={1: 200},
        newest=1,
        k=4,
    )
    assert not [a for a in plan(lone) if isinstance(a, MigrateRequests)]


def test_two_engines_switching_pack_the_shorter_tail_into_the_longer() -> None:
    """Both engines were told to serve version 1 while finishing version 0's tail (the
    two-engine main job after each publication). Their free slots cannot take version 1's
    queue before the tails end, so the queue still needs an engine: the shorter tail moves
    into the longer one, and the emptied engine loads version 1 at once."""
    state = cluster(
        eng("a", 0, (req("s1", 0, 40, 4), req("s2", 0, 60, 4)), assigned=1, max_running=48),
        eng("b", 0, (req("l1", 0, 300, 20), req("l2", 0, 500, 30)), assigned=1, max_running=48),
        queues={1: 64},
        newest=1,
    )
    migrations = [a for a in plan(state) if isinstance(a, MigrateRequests)]
    assert [(m.source, m.target, set(m.request_ids)) for m in migrations] == [
        ("a", "b", {"s1", "s2"})
    ]


def test_a_switching_engine_takes_no_tail_longer_than_its_own() -> None:
    state = cluster(
        eng("a", 0, (req("l1", 0, 40, 30),), assigned=1, max_running=48),
        eng("b", 0, (req("s1", 0, 1950, 4),), assigned=1, max_running=48),
        queues={1: 64},
        newest=1,
    )
    # a is emptier but its request has ~2,000 tokens to go, b's only ~50: b moves into a
    migrations = [a for a in plan(state) if isinstance(a, MigrateRequests)]
    assert [(m.source, m.target) for m in migrations] == [("b", "a")]


def test_no_consolidation_without_demand_for_the_freed_engines() -> None:
    state = tail_fleet()
    idle_queue = _replace(state, queue_depths={})
    assert not [a for a in plan(idle_queue) if isinstance(a, MigrateRequests)]


def test_recently_migrated_request_is_not_moved_again() -> None:
    state = tail_fleet()
    engines = list(state.engines)
    engines[0] = eng("t0", 0, (req("x1", 0, 900, 60, last_migrated_at=990.0),))
    moved = {
        rid
        for a in plan(_replace(state, engines=tuple(engines)))
        if isinstance(a, MigrateRequests)
        for rid in a.request_ids
    }
    assert "x1" not in moved and moved == {"x2", "x3"}


def test_migration_must_pay_for_itself() -> None:
    cfg = OrchestratorConfig(migration_s_per_request=100.0)
    assert not [a for a in plan(tail_fleet(), cfg) if isinstance(a, MigrateRequests)]


def test_urgent_tail_is_migrated_unless_disabled() -> None:
    state = _replace(tail_fleet(), staleness_bound=1, learner_step=1)
    assert [a for a in plan(state) if isinstance(a, MigrateRequests)]
    actions = plan(state, OrchestratorConfig(migrate_urgent=False))
    assert not [a for a in actions if isinstance(a, MigrateRequests)]
    assert [a for a in actions if isinstance(a, PrioritizeRequests)]


def test_target_kv_capacity_is_respected() -> None:
    cfg = OrchestratorConfig(target_fill=0.2)  # t2 may grow to 200 blocks only
    for a in plan(tail_fleet(total=1000), cfg):
        if isinstance(a, MigrateRequests):
            assert a.kv_blocks <= 200


def test_migration_disabled_for_ablation() -> None:
    actions = plan(tail_fleet(), OrchestratorConfig(migrate=False))
    assert not [a for a in actions if isinstance(a, MigrateRequests)]


# ---------------------------------------------------------------------- bounds, modes, API


def test_actions_are_bounded_and_deterministic() -> None:
    engines = [eng(f"i{i:02d}", None, state="idle") for i in range(30)]
    state = cluster(*engines, queues={1: 1000})
    assert len(plan(state, OrchestratorConfig(max_actions=7))) == 7
    shuffled = engines[:]
    random.Random(3).shuffle(shuffled)
    assert plan(state) == plan(cluster(*shuffled, queues={1: 1000}))


def test_partial_mode_moves_every_engine_to_newest() -> None:
    state = cluster(eng("a", 0, full("a", 0)), eng("b", 1, full("b", 1)), newest=1)
    cfg = OrchestratorConfig(reassign_busy_to_newest=True)
    assert assigns(plan(state, cfg)) == {"a": 1}


def test_actions_map_to_wire_commands() -> None:
    cmd = MigrateRequests("a", "b", 3, ("r1",), 4).to_command()
    assert isinstance(cmd, events.Migrate)
    assert (cmd.source, cmd.target, cmd.version, cmd.request_ids) == ("a", "b", 3, ("r1",))
    assert AssignEngine("e", 2).to_command().version == 2
    assert PrioritizeRequests("e", ("r",), 10).to_command().priority == 10


def test_bad_config_and_state_name_the_field() -> None:
    with pytest.raises(ValueError, match="target_fill"):
        OrchestratorConfig(target_fill=0.0)
    with pytest.raises(ValueError, match="assign_cooldown_s"):
        OrchestratorConfig(assign_cooldown_s=-1)
    with pytest.raises(ValueError, match="duplicate engine_id"):
        cluster(eng("a", 0), eng("a", 0))
    with pytest.raises(ValueError, match="queue_depths"):
        cluster(eng("a", 0), queues={0: -1})
    with pytest.raises(ValueError, match="state"):
        eng("a", 0, state="sleeping")


# ---------------------------------------------------------------------- estimates


def test_remaining_is_conditional_on_length_so_far() -> None:
    model = LengthModel.from_lengths([10, 20, 30, 1000])
    assert model.remaining(0, 4096) == pytest.approx(265.0)
    assert model.remaining(25, 4096) == pytest.approx((30 + 1000) / 2 - 25)
    assert model.remaining(500, 4096) == pytest.approx(500.0)
    assert model.remaining(500, 600) == 100.0  # capped by max_tokens
    assert model.remaining(2000, 3000) == 500.0  # beyond data: half of what is left
    assert LengthModel().remaining(0, 100) == 50.0


def test_recorder_keeps_a_window() -> None:
    rec = LengthRecorder(window=3)
    for n in (1, 2, 3, 4):
        rec.add(n)
    assert rec.model().lengths == (2, 3, 4)
    with pytest.raises(ValueError, match="length"):
        rec.add(-1)


def _replace(state: ClusterState, **kw) -> ClusterState:
    from dataclasses import replace

    return replace(state, **kw)


def test_engine_view_from_status_adds_the_service_memory() -> None:
    status = events.EngineStatus(
        engine_id="e1",
        version=2,
        assigned_version=3,
        state="serving",
        running=1,
        waiting=2,
        kv_blocks_used=5,
        kv_blocks_total=100,
        block_size=16,
        tokens_per_s=12.5,
        max_running=8,
        requests=(
            events.RunningRequest(
                request_id="r", version=2, generated=7, max_tokens=64, kv_blocks=5
            ),
        ),
    )
    view = EngineView.from_status(
        status, priorities={"r": 10}, migrated_at={"r": 3.0}, assigned_at=1.0
    )
    assert (view.version, view.assigned_version, view.pulls, view.waiting) == (2, 3, 3, 2)
    (r,) = view.requests
    assert (r.priority, r.last_migrated_at, r.generated, r.kv_blocks) == (10, 3.0, 7, 5)
    assert view.assigned_at == 1.0 and view.max_running == 8


# ---------------------------------------------------------------------- proportional share


def test_queued_versions_get_engines_in_proportion_to_weighted_work() -> None:
    # K = 3, learner at step 3: version 1 (deadline in 1 step) and version 3 (in 3 steps) both
    # have 300 queued; version 1 has one puller, version 3 eleven, all busy, six nearly empty.
    engines = [eng("p00", 1, full("p", 1))] + [
        eng(f"n{i:02d}", 3, full(f"n{i}", 3, 14 if i < 5 else 4)) for i in range(11)
    ]
    state = cluster(*engines, queues={1: 300, 3: 300}, newest=3, k=3)
    # shares: v1 (300 + 14) / 2 = 157, v3 (300 + 94) / 4 = 98.5 of 12 pullers -> 7.4 / 4.6
    moved = assigns(plan(state))
    assert sorted(moved.values()) == [1] * 6  # only nearly empty engines move (6 of them)
    assert set(moved) == {f"n{i:02d}" for i in range(5, 11)}
    assert assigns(plan(state, OrchestratorConfig(rebalance=False))) == {}  # the old behaviour


def test_rebalance_respects_cooldown_and_the_newest_last_puller() -> None:
    engines = [eng("p00", 1, full("p", 1))] + [
        eng(f"n{i:02d}", 3, full(f"n{i}", 3, 2), assigned_at=995.0) for i in range(5)
    ]
    engines.append(eng("n99", 3, full("n99", 3, 2)))
    state = cluster(*engines, queues={1: 300, 3: 10}, newest=3, k=3)
    # every v3 engine but one is cooling; the one left is v3's last free-to-move puller
    moved = assigns(plan(state))
    assert set(moved) <= {"n99"}
    pulls_v3 = [e for e in engines if e.assigned_version == 3 and e.engine_id not in moved]
    assert pulls_v3


def test_relief_moves_preempted_requests_to_an_engine_of_their_version_with_room() -> None:
    """A request preempted on a full engine holds no KV; it moves, tokens only, to the
    same-version engine with the most KV room, oldest first; never to another version, a
    full engine, or an engine of another kind."""
    stuck = tuple(req(f"p{i}", 1, 500, 0, preempted=True, dispatched_at=float(i)) for i in range(3))
    full = eng("a", 1, (req("r", 1, 900, 900), *stuck), used=990, waiting=3)
    roomy = eng("b", 1, (req("s", 1, 10, 10),), used=100)
    roomier = eng("c", 1, (req("t", 1, 10, 10),), max_running=3)  # two open slots
    newer = eng("d", 2, (), used=0)
    other_kind = eng("e", 1, (), used=0, kind="vllm")
    actions = plan(cluster(full, roomy, roomier, newer, other_kind, newest=2, step=2))
    moves = [a for a in actions if isinstance(a, MigrateRequests) and a.reason == "relieve"]
    moved = {rid: m.target for m in moves for rid in m.request_ids}
    assert moved == {"p0": "c", "p1": "c", "p2": "b"}, moves
    assert all(m.source == "a" and m.version == 1 and m.kv_blocks == 0 for m in moves)
    off = OrchestratorConfig(relieve_preempted=False)
    assert not [
        a
        for a in plan(cluster(full, roomy, roomier, newer, newest=2, step=2), off)
        if isinstance(a, MigrateRequests) and a.reason == "relieve"
    ]


def test_a_preempted_request_is_reported_by_the_engine_and_reaches_the_view() -> None:
    running = events.RunningRequest(
        request_id="r", version=0, generated=40, max_tokens=64, kv_blocks=0, preempted=True
    )
    status = events.EngineStatus(engine_id="e", version=0, requests=(running,))
    assert EngineView.from_status(status).requests[0].preempted


# ---------------------------------------------------------------------- fast lane

LANE = OrchestratorConfig(fast_lane=True)


def crowded_tail(*extra: EngineView, queues=None, k: int = 1) -> ClusterState:
    """Version 0 is the cohort the learner waits for (K = 1, learner at step 1). Engine "c"
    decodes 10 requests at 10 tok/s each: two have run long (1,000 tokens; the length history
    expects 1,000 more: 100 s), eight are young (expected ~47 s). Engine "l" runs one."""
    young = tuple(req(f"y{i}", 0, 10, 8) for i in range(8))
    long = (req("L1", 0, 1000, 70), req("L2", 0, 1000, 70))
    crowded = eng("c", 0, (*long, *young), tokens_per_s=100.0, max_running=64)
    lane = eng("l", 0, (req("m", 0, 1000, 70),), tokens_per_s=40.0, max_running=64)
    newest = eng("n", 1, full("n", 1, 16), max_running=64)
    return cluster(crowded, lane, newest, *extra, queues=queues, newest=1, step=1, k=k)


def lane_moves(actions) -> dict[str, tuple[str, str]]:
    return {
        rid: (a.source, a.target)
        for a in actions
        if isinstance(a, MigrateRequests) and a.reason == "fast-lane"
        for rid in a.request_ids
    }


def test_fast_lane_moves_the_critical_requests_onto_a_lightly_loaded_engine() -> None:
    """Only the requests expected to run longer than fast_lane_min_s move, with their KV,
    and the lane engine is not consolidated back into a full batch."""
    actions = plan(crowded_tail(), LANE)
    assert lane_moves(actions) == {"L1": ("c", "l"), "L2": ("c", "l")}
    assert all(a.kv_blocks == 140 for a in actions if isinstance(a, MigrateRequests))
    assert not [a for a in actions if isinstance(a, MigrateRequests) and a.source == "l"]
    assert not lane_moves(plan(crowded_tail())), "off by default"


def test_fast_lane_fills_a_lane_only_up_to_its_batch() -> None:
    actions = plan(crowded_tail(), OrchestratorConfig(fast_lane=True, fast_lane_batch=2))
    assert lane_moves(actions) == {"L1": ("c", "l")}


def test_an_idle_engine_holding_the_weights_is_a_lane_only_when_no_queue_needs_it() -> None:
    """With lanes of two, "l" has one spot: the faster lane (one request at 40 tok/s) takes
    the longest request, the idle engine (assumed at 30) the other, and stays on version 0."""
    idle = eng("i", 0, (), max_running=64)
    two = OrchestratorConfig(fast_lane=True, fast_lane_batch=2)
    actions = plan(crowded_tail(idle), two)
    assert sorted(lane_moves(actions).values()) == [("c", "i"), ("c", "l")]
    assert "i" not in assigns(actions)
    wanted = plan(crowded_tail(idle, queues={1: 500}), two)
    assert assigns(wanted).get("i") == 1, "a queue that needs the engine comes first"
    assert sorted(lane_moves(wanted).values()) == [("c", "l")]


def test_no_fast_lane_for_a_version_the_learner_does_not_wait_for_yet() -> None:
    assert not lane_moves(plan(crowded_tail(k=2), LANE))
