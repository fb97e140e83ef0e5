"""Simulator: deterministic, conserves requests, respects K, and sync waits for its longest."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.engines.sim import DENSE_7B
from dora.sim import MODES, SimConfig, simulate
from dora.sim.runner import _driver

SMALL = SimConfig(
    engines=6, steps=3, batch_groups=12, group_size=4, staleness=1, cost=DENSE_7B, plan_tick_s=5.0
)


def _run(mode: str, **kw: object):
    cfg = replace(SMALL, mode=mode, **kw)  # type: ignore[arg-type]
    d = _driver(cfg)
    records = d.run()
    return cfg, d, records


@pytest.mark.parametrize("admission", ["slots", "kv"])
@pytest.mark.parametrize("mode", MODES)
def test_every_request_finishes_once_and_batches_are_whole(mode: str, admission: str) -> None:
    cfg, d, records = _run(mode, admission=admission)
    fleet = d.fleet
    assert len(records) == cfg.steps
    assert fleet.finished_count == len(fleet.done_ids) <= len(fleet.requests)
    consumed = [g for g in fleet.groups if g.consumed_step >= 0]
    assert len(consumed) == sum(r.groups for r in records) >= cfg.steps * cfg.batch_groups
    for g in consumed:
        assert g.finished and all(r.rid in fleet.done_ids for r in g.requests)
        assert all(r.generated == r.spec.decode_tokens for r in g.requests)
    # every core's accounting returns to a consistent state
    for core in fleet.cores:
        assert core.kv_used() >= 0 and core.context >= 0


@pytest.mark.parametrize("mode", ["partial", "dora", "dora_noreuse"])
@pytest.mark.parametrize("k", [1, 2])
def test_staleness_is_bounded(mode: str, k: int) -> None:
    _, _, records = _run(mode, staleness=k)
    stale = [s for r in records for s in r.staleness]
    assert stale and min(stale) >= 0 and max(stale) <= k


def test_sync_waits_for_its_longest_trajectory() -> None:
    _, d, records = _run("sync")
    for rec in records:
        groups = [g for g in d.fleet.groups if g.consumed_step == rec.step]
        longest = max(r.finished_at - r.started_at for g in groups for r in g.requests)
        assert rec.rollout_s >= longest
        assert rec.train_end - rec.train_start > 0
        single = DENSE_7B.single_request_time(rec.longest_prompt, rec.longest_tokens)
        assert rec.rollout_s >= single * 0.999
        assert rec.staleness == [0] * len(groups)


def test_partial_reprefills_and_dora_does_not() -> None:
    partial = simulate(replace(SMALL, mode="partial"))
    partial_sync = simulate(replace(SMALL, mode="partial_sync"))
    dora = simulate(replace(SMALL, mode="dora"))
    assert partial.reprefilled_tokens > 0 and partial_sync.reprefilled_tokens > 0
    assert dora.reprefilled_tokens == 0


def test_iteration_synchronous_partial_stops_rollout_while_training_and_carries() -> None:
    _, d, records = _run("partial_sync")
    reqs = d.fleet.requests.values()
    for rec in records:
        during = [r for r in reqs if r.done and rec.train_start < r.finished_at < rec.train_end]
        assert not during, "a request finished while the learner trained"
        groups = [g for g in d.fleet.groups if g.consumed_step == rec.step]
        assert len(groups) == SMALL.batch_groups  # exactly B finished groups per step
    carried = [r for r in reqs if len({v for v, _ in r.version_tokens}) > 1]
    assert carried  # some trajectories spanned an update (resumed under new weights)


def test_same_seed_same_table() -> None:
    a = simulate(replace(SMALL, mode="dora", seed=3)).to_dict()
    b = simulate(replace(SMALL, mode="dora", seed=3)).to_dict()
    c = simulate(replace(SMALL, mode="dora", seed=4)).to_dict()
    for r in (a, b, c):
        r.pop("sim_seconds")
    assert a == b
    assert a != c


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engines"):
        SimConfig(engines=0)


def test_new_requests_are_spread_over_engines_with_room() -> None:
    """Like NATS pull delivery: 16 requests on 8 idle engines give 2 each, not 16 on one."""
    from dora.sim.fleet import Fleet

    fleet = Fleet(replace(SMALL, engines=8, group_size=8, mode="sync"))
    for e, core in enumerate(fleet.cores):
        core.version = 0
        fleet.hungry[0].add(e)
    fleet.dispatch_group(0)
    fleet.dispatch_group(0)
    fleet.feed(0)
    assert [c.num_requests() for c in fleet.cores] == [2] * 8
    assert not fleet.queues[0]


def test_oracle_start_orders_queue_the_longest_work_first() -> None:
    """The critical-path yardsticks: longest request first, or groups by drawn difficulty."""
    import math

    from dora.sim.fleet import Fleet

    fleet = Fleet(replace(SMALL, mode="dora"))
    fifo = fleet.dispatch_groups(0, 5)
    assert [r.rid for r in fleet.queues[0]] == [r.rid for g in fifo for r in g.requests]
    fleet.queues[0].clear()
    fleet.dispatch_groups(0, 5, "oracle_request")
    lengths = [r.spec.decode_tokens for r in fleet.queues[0]]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) > 1
    fleet.queues[0].clear()
    groups = fleet.dispatch_groups(0, 5, "oracle_group")
    difficulty = {g.gid: sum(math.log(r.spec.decode_tokens) for r in g.requests) for g in groups}
    queued = [difficulty[r.group] for r in fleet.queues[0]]
    assert queued == sorted(queued, reverse=True) and len(set(queued)) == 5


def test_an_oracle_start_order_runs_and_is_checked_at_load() -> None:
    a = simulate(replace(SMALL, mode="dora"))
    b = simulate(replace(SMALL, mode="dora", start_order="oracle_request"))
    assert a.finished > 0 and b.finished > 0
    assert a.to_dict() != b.to_dict()
    with pytest.raises(ValueError, match="start_order"):
        SimConfig(start_order="shortest")  # type: ignore[arg-type]


def test_kv_admission_hands_preempted_requests_to_engines_with_room() -> None:
    """Under KV admission a preempted request does not wait behind its engine's full cache:
    the baselines' generators requeue it (any engine with room resumes it), dora's planner
    moves it as tokens only (``plan``'s relief). Nothing is lost; the recompute is counted
    once (a KV cache that fills up: a small HBM)."""
    small = DENSE_7B.with_overrides(hbm_bytes=(15.2e9 + 4e9 + 1.2e9) / 0.9)
    _, d, records = _run("sync", admission="kv", cost=small, kv_max_seqs=64)
    assert len(records) == SMALL.steps and not d.fleet._released
    reqs = list(d.fleet.requests.values())
    assert any(len(set(r.engines)) > 1 and r.recomputed and not r.migrations for r in reqs)
    _, d, records = _run("dora", admission="kv", cost=small, kv_max_seqs=64)
    assert len(records) == SMALL.steps and d.fleet.max_seqs == 64
    reqs = list(d.fleet.requests.values())
    relieved = [r for r in reqs if r.migrations and r.recomputed and not r.migrated_bytes]
    assert relieved and all(len(set(r.engines)) > 1 for r in relieved)
    assert sum(r.reprefilled for r in relieved) == 0
    with pytest.raises(ValueError, match="admission"):
        SimConfig(admission="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_watermark"):
        SimConfig(kv_watermark=0.0)


def test_without_relief_a_preempted_request_waits_on_its_engine() -> None:
    small = DENSE_7B.with_overrides(hbm_bytes=(15.2e9 + 4e9 + 1.2e9) / 0.9)
    _, d, _ = _run("dora", admission="kv", cost=small, kv_max_seqs=64, relieve_preempted=False)
    reqs = list(d.fleet.requests.values())
    assert sum(r.recomputed for r in reqs) > 0
    assert not [r for r in reqs if r.migrations and not r.migrated_bytes]


def test_cohort_tails_report_each_versions_makespan_and_its_last_finishers() -> None:
    cfg = replace(SMALL, mode="dora")
    result = simulate(cfg)
    cohorts = result.extra["cohorts"]
    d = _driver(cfg)
    d.run()
    assert cohorts and [c["version"] for c in cohorts] == sorted(c["version"] for c in cohorts)
    alone = 1.0 / DENSE_7B.step_time(1, 0)
    for c in cohorts:
        done = [r for g in d.fleet.groups if g.version == c["version"] for r in g.requests]
        done = [r for r in done if r.done]
        first = min(r.dispatched_at for r in done)
        assert c["makespan_s"] == max(r.finished_at for r in done) - first
        assert 0 <= c["tail_start_s"] <= c["makespan_s"]
        assert 0 < c["tail_tok_per_s"] <= alone  # no request decodes faster than alone


@pytest.mark.parametrize("k", [1, 2])
def test_the_fast_lane_runs_every_request_to_completion(k: int) -> None:
    """The fast lane (plan's rule 7) moves requests with their KV; nothing is lost or
    re-prefilled, and staleness stays within K."""
    cfg, d, records = _run(
        "dora", staleness=k, fast_lane=True, fast_lane_batch=2, fast_lane_min_s=1.0
    )
    consumed = [g for g in d.fleet.groups if g.consumed_step >= 0]
    assert all(g.finished for g in consumed) and len(records) == cfg.steps
    assert all(r.reprefilled == 0 for r in d.fleet.requests.values())
    assert max(s for r in records for s in r.staleness) <= k
    assert d.actions.get("MigrateRequests:fast-lane", 0) > 0
