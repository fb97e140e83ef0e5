"""Timing core: jumping from event to event equals stepping token by token."""

from __future__ import annotations

import pytest

from dora.engines.sim.core import SimRequest, TimingCore
from dora.engines.sim.cost import DENSE_7B, DENSE_32B
from dora.engines.sim.workload import AGENTIC, RequestSpec


def _reqs(lengths: list[int], prompt: int = 100) -> list[SimRequest]:
    return [SimRequest(i, 0, i, 0, RequestSpec(prompt, (n,))) for i, n in enumerate(lengths)]


def _reference(lengths: list[int], prompt: int, max_seqs: int) -> dict[int, float]:
    """Token-by-token stepping with the same scheduling rules (FIFO, prefill on admission)."""
    cost = DENSE_32B
    t = 0.0
    waiting = list(range(len(lengths)))
    running: dict[int, int] = {}  # rid -> generated
    done: dict[int, float] = {}
    while waiting or running:
        while waiting and len(running) < max_seqs:
            rid = waiting.pop(0)
            t += cost.prefill_time(prompt)
            running[rid] = 0
        ctx = sum(prompt + g for g in running.values())
        t += cost.step_time(len(running), ctx)
        for rid in list(running):
            running[rid] += 1
            if running[rid] == lengths[rid]:
                del running[rid]
                done[rid] = t
    return done


@pytest.mark.parametrize("max_seqs", [64, 3])
def test_event_driven_equals_stepping(max_seqs: int) -> None:
    lengths = [5, 40, 17, 300, 1, 120, 77, 9]
    core = TimingCore(DENSE_32B, max_seqs=max_seqs)
    core.version = 0
    reqs = _reqs(lengths)
    for r in reqs:
        core.add(r)
    finished = core.run_until_idle()
    want = _reference(lengths, 100, max_seqs)
    assert sorted(r.rid for r in finished) == list(range(len(lengths)))
    for r in finished:
        assert r.finished_at == pytest.approx(want[r.rid], rel=1e-9)
        assert r.generated == lengths[r.rid]
    assert core.decoded_tokens == sum(lengths)


def test_advancing_in_small_slices_changes_nothing() -> None:
    lengths = [50, 400, 33, 1000]
    a = TimingCore(DENSE_7B)
    b = TimingCore(DENSE_7B)
    a.version = b.version = 0
    for r in _reqs(lengths):
        a.add(r)
    for r in _reqs(lengths):
        b.add(r)
    end_a = {r.rid: r.finished_at for r in a.run_until_idle()}
    end_b: dict[int, float] = {}
    t = 0.0
    while b.has_work():
        t = max(t, b.next_event_time())
        for r in b.advance_to(t):
            end_b[r.rid] = r.finished_at
    assert end_a == pytest.approx(end_b)


def test_export_import_keeps_remaining_length_without_prefill() -> None:
    src, dst = TimingCore(DENSE_32B, 0), TimingCore(DENSE_32B, 1)
    src.version = dst.version = 0
    (req,) = _reqs([1000])
    src.add(req)
    src.advance_to(5.0)
    moved = src.remove(req.rid, keep_kv=True)
    assert 0 < moved.generated < 1000
    remaining = moved.remaining
    assert moved.context == 100 + moved.generated
    assert not src.has_work() and src.context == 0
    prefill_before = dst.prefill_s
    dst.import_request(moved, 5.0)
    (done,) = dst.run_until_idle()
    assert done.generated == 1000 and dst.decoded_tokens == remaining
    assert dst.prefill_s == prefill_before  # zero re-prefill
    assert done.engines == [0, 1]


def test_abort_then_resume_reprefills() -> None:
    core = TimingCore(DENSE_32B)
    core.version = 0
    (req,) = _reqs([500])
    core.add(req)
    core.advance_to(3.0)
    held = core.interrupt_all()
    assert held == [req] and req.prefill == req.context == 100 + req.generated
    p0, ctx = core.prefill_s, req.context
    core.add(req)
    (done,) = core.run_until_idle()
    assert core.prefill_s - p0 == pytest.approx(DENSE_32B.prefill_time(ctx))
    assert done.generated == 500


def test_kv_full_preempts_and_still_finishes_everything() -> None:
    small = DENSE_32B.with_overrides(hbm_bytes=70e9 / 0.9 + 4e9 / 0.9)  # ~19k KV tokens
    core = TimingCore(small, max_seqs=32)
    core.version = 0
    lengths = [3000] * 12
    for r in _reqs(lengths):
        core.add(r)
    finished = core.run_until_idle()
    assert len(finished) == 12 and all(r.generated == 3000 for r in finished)
    assert core.preemptions > 0 and sum(r.recomputed for r in finished) > 0
    assert core.kv_used() == 0


def test_a_core_with_on_preempt_hands_a_preempted_request_back() -> None:
    """Released, not queued locally: the engine keeps admitting, the request has lost its KV
    (it re-prefills prompt + generated wherever it resumes) and the recompute is counted."""
    small = DENSE_32B.with_overrides(hbm_bytes=70e9 / 0.9 + 4e9 / 0.9)  # ~19k KV tokens
    released: list[SimRequest] = []
    core = TimingCore(small, max_seqs=32, on_preempt=released.append)
    core.version = 0
    for r in _reqs([3000] * 12):
        core.add(r)
    finished = core.run_until_idle()
    assert released and core.preemptions == len(released)
    assert not (set(id(r) for r in released) & set(id(r) for r in finished))
    assert len(finished) + len(released) == 12
    for r in released:
        assert r.generated > 0 and r.prefill == r.context and r.kv_held == 0
        assert r.recomputed >= r.context
    assert core.num_waiting == 0 and core.kv_used() == 0


def test_multi_turn_waits_for_tools() -> None:
    spec = next(s for g in range(50) for s in AGENTIC.group(0, g, 1) if len(s.segments) >= 3)
    core = TimingCore(DENSE_7B)
    core.version = 0
    core.add(SimRequest(0, 0, 0, 0, spec))
    (done,) = core.run_until_idle()
    assert done.generated == spec.decode_tokens
    assert done.completion_tokens == spec.total_tokens
    assert done.finished_at > sum(spec.tool_latency)
    assert core.kv_used() == 0


def test_version_mismatch_is_refused() -> None:
    core = TimingCore(DENSE_7B)
    core.version = 1
    with pytest.raises(ValueError, match="version"):
        core.add(_reqs([10])[0])


def test_resident_kv_of_queued_requests_is_dropped_before_a_livelock() -> None:
    """Imports (and woken tool waiters) keep their KV while queued; when that resident KV
    alone fills the cache, the core drops it (they recompute later) rather than preempting
    and re-admitting its one running request forever."""
    small = DENSE_32B.with_overrides(hbm_bytes=70e9 / 0.9 + 4e9 / 0.9)  # ~19k KV tokens
    sources = [TimingCore(small, i) for i in range(2)]
    dst = TimingCore(small, 2, max_seqs=1)  # the imports beyond one stay queued
    reqs = _reqs([7000] * 4)
    for i, r in enumerate(reqs):
        sources[i % 2].version = 0
        sources[i % 2].add(r)
    t = 0.0
    while min(r.generated for r in reqs) < 5000:
        t += 10.0
        for src in sources:
            src.advance_to(t)
            src.requests()
    moved = [sources[i % 2].remove(r.rid, keep_kv=True) for i, r in enumerate(reqs)]
    dst.version = 0
    for r in moved:
        dst.import_request(r, t)
    assert dst.kv_used() > dst.capacity  # the imports overflow the cache
    finished = dst.run_until_idle()
    assert sorted(r.rid for r in finished) == [r.rid for r in reqs]
    assert all(r.generated == 7000 for r in finished)
    assert sum(r.recomputed for r in finished) > 0
    assert dst.kv_used() == 0


def test_a_request_larger_than_the_cache_is_an_error_not_a_hang() -> None:
    small = DENSE_32B.with_overrides(hbm_bytes=70e9 / 0.9 + 4e9 / 0.9)  # ~19k KV tokens
    core = TimingCore(small)
    core.version = 0
    core.add(_reqs([25_000])[0])
    with pytest.raises(ValueError, match="kv_capacity"):
        core.run_until_idle()


def _in_tool_wait(core: TimingCore) -> SimRequest:
    spec = next(s for g in range(50) for s in AGENTIC.group(0, g, 1) if len(s.segments) >= 3)
    core.version = 0
    core.add(SimRequest(0, 0, 0, 0, spec))
    while core.num_tool_waiting == 0:
        core.advance_to(core.next_event_time())
    return core.requests()[0]


def test_an_interrupted_tool_waiter_still_waits_for_its_tool() -> None:
    """Partial rollout drops its KV but not its tool call: re-added, it waits for the answer,
    then prefills its whole context (counted by the caller as re-prefill)."""
    core = TimingCore(DENSE_7B)
    req = _in_tool_wait(core)
    ready = req.tool_ready_at
    assert core.kv_holders() == {req.rid}
    (back,) = core.interrupt_all()
    assert back.prefill == back.context and core.kv_used() == 0
    core.add(back)
    core.advance_to(ready - 1e-3)
    assert core.num_tool_waiting == 1 and core.num_running == 0 and core.kv_used() == 0
    p0 = core.prefill_s
    core.advance_to(ready)
    tool = req.spec.tool_tokens[req.seg - 1]
    assert core.num_running == 1
    assert core.prefill_s - p0 == pytest.approx(DENSE_7B.prefill_time(req.context))
    assert req.context == req.spec.prompt_len + req.spec.segments[0] + tool
    (done,) = core.run_until_idle()
    assert done.generated == req.spec.decode_tokens and done.recomputed == 0


def test_an_evicted_tool_waiter_is_charged_once() -> None:
    """KV pressure evicts a tool waiter: its recompute is counted when evicted, it prefills
    its whole context when the tool answers, and it is never counted twice."""
    core = TimingCore(DENSE_7B)
    req = _in_tool_wait(core)
    context = req.context
    assert core._evict_tool_waiter() and req.recomputed == context
    assert core.kv_used() == 0 and core.kv_holders() == set()
    (done,) = core.run_until_idle()
    assert done.recomputed == context and done.generated == req.spec.decode_tokens
