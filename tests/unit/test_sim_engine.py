"""SimEngine: the Engine protocol on the timing model (virtual time)."""

from __future__ import annotations

import pytest

from dora.engines.base import Engine, VersionMismatch
from dora.engines.sim import SimEngine
from dora.events import Prompt, RolloutRequest, SamplingParams


def _request(i: int, version: int = 0, max_tokens: int = 16384) -> RolloutRequest:
    prompt = Prompt(prompt_id=f"p{i // 4}", text="What is 2+2?")
    return RolloutRequest(
        request_id=f"r{i}",
        prompt=prompt,
        group_id=f"g{i // 4}",
        group_index=i % 4,
        group_size=4,
        sampling=SamplingParams(seed=1000 + i, max_tokens=max_tokens),
        version=version,
    )


def _engine(name: str = "e0") -> SimEngine:
    e = SimEngine(name, "dense-7b", "dapo-16k", seed=0)
    e.load_weights(0)
    return e


def _drain(e: SimEngine) -> dict[str, object]:
    out = {}
    while e.has_work():
        for t in e.step():
            out[t.request.request_id] = t
    return out


def test_protocol_and_deterministic_lengths() -> None:
    a, b = _engine(), _engine()
    assert isinstance(a, Engine)
    for i in range(8):
        a.add_request(_request(i))
        b.add_request(_request(7 - i))
    ta, tb = _drain(a), _drain(b)
    assert set(ta) == {f"r{i}" for i in range(8)}
    for rid in ta:  # the same request is as long on any engine, in any batch
        assert ta[rid].completion_token_ids == tb[rid].completion_token_ids
        assert len(ta[rid].logprobs) == len(ta[rid].loss_mask) == len(ta[rid].completion_token_ids)
        assert ta[rid].version == 0 and ta[rid].engines == ("e0",)


def test_max_tokens_truncates() -> None:
    e = _engine()
    e.add_request(_request(0, max_tokens=50))
    (t,) = _drain(e).values()
    assert len(t.completion_token_ids) == 50 and t.finish_reason == "length"


def test_version_checks() -> None:
    e = _engine()
    with pytest.raises(VersionMismatch):
        e.add_request(_request(0, version=1))
    e.add_request(_request(0))
    with pytest.raises(VersionMismatch):
        e.load_weights(1)


def test_migration_keeps_tokens_and_needs_no_prefill() -> None:
    src, dst = _engine("src"), _engine("dst")
    ref = _engine("ref")
    src.add_request(_request(3))
    ref.add_request(_request(3))
    want = _drain(ref)["r3"].completion_token_ids
    src.core.advance_to(src.core.clock + 2.0)  # part-way (its only event is its end)
    blob = src.export_request("r3")
    prefill_before = dst.core.prefill_s
    rid = dst.import_request(blob)
    src.release_exported(rid)
    assert not src.has_work()
    (t,) = _drain(dst).values()
    assert t.completion_token_ids == want
    assert dst.core.prefill_s == prefill_before
    assert t.engines == ("src", "dst") and len(t.migrations) == 1
    assert t.migrations[0].kv_bytes > 0 and t.reprefilled_tokens == 0


def test_abort_returns_partial_output() -> None:
    e = _engine()
    e.add_request(_request(1))
    e.core.advance_to(e.core.clock + 1.0)
    out = e.abort("r1")
    assert len(out.token_ids) > 0 and not e.has_work()
    assert e.status().running == 0


def test_resumed_request_reports_which_version_made_each_token() -> None:
    from dora.rollout.partial import RESUME_PRIORITY, resumed

    e = _engine()
    e.load_weights(0)
    e.add_request(_request(1))
    e.core.advance_to(e.core.clock + 1.0)
    part = e.abort("r1")
    done = len(part.token_ids)
    again = resumed(part, loaded=0, version=1)
    assert again.version == 1 and again.priority == RESUME_PRIORITY
    e.load_weights(1)
    e.add_request(again)
    (t,) = _drain(e).values()
    n = len(t.completion_token_ids)
    assert t.token_versions == (0,) * done + (1,) * (n - done)
    assert t.reprefilled_tokens >= done


def _agentic(name: str) -> SimEngine:
    e = SimEngine(name, "dense-7b", "agentic", seed=0)
    e.load_weights(0)
    return e


def _until_tool_wait(e: SimEngine) -> None:
    """Advance until its one request waits for a tool (between two turns)."""
    while e.core.num_tool_waiting == 0:
        e.core.advance_to(e.core.next_event_time())
        assert e.has_work()


def _multi_turn_request(min_turns: int = 3) -> RolloutRequest:
    probe = _agentic("probe")
    for i in range(200):
        spec = probe._build(_request(i)).spec
        if len(spec.segments) >= min_turns:
            return _request(i)
    raise AssertionError("no multi-turn request in 200 draws")


def test_a_request_waiting_for_its_tool_migrates_and_keeps_waiting() -> None:
    """Exported between turns: the snapshot says parked and since when; the target waits out
    the rest of the tool call, prefills only the tool reply, and the episode ends with every
    turn, the same tokens as without the move, and no re-prefill."""
    request = _multi_turn_request()
    ref = _agentic("ref")
    ref.add_request(request)
    want = _drain(ref)[request.request_id]
    src, dst = _agentic("src"), _agentic("dst")
    src.add_request(request)
    _until_tool_wait(src)
    (waiter,) = src.core.requests()
    ready = waiter.tool_ready_at
    assert src.status().parked == 1 and src.status().requests[0].parked
    blob = src.export_request(request.request_id)
    from dora.engines.snapshot import decode_snapshot

    header = decode_snapshot(blob)[0]
    assert header.parked and header.parked_at == pytest.approx(
        src._wall(ready - waiter.spec.tool_latency[waiter.seg - 1])
    )
    dst.import_request(blob)
    src.release_exported(request.request_id)
    (moved,) = dst.core.requests()
    assert moved.tool_ready_at == pytest.approx(ready, abs=1e-3)  # the clocks share an epoch
    assert dst.status().parked == 1
    spec, first = moved.spec, moved.seg - 1
    replies = [  # the pending reply and the later ones, each appended to a resident context
        dst.cost.prefill_time(
            spec.tool_tokens[i],
            spec.prompt_len + sum(spec.segments[: i + 1]) + sum(spec.tool_tokens[:i]),
        )
        for i in range(first, len(spec.tool_tokens))
    ]
    prefill_before = dst.core.prefill_s
    dst.core.advance_to(ready - 1e-3)
    assert dst.core.num_tool_waiting == 1 and dst.core.num_running == 0  # still waiting
    (t,) = _drain(dst).values()
    assert t.completion_token_ids == want.completion_token_ids
    assert [turn.role for turn in t.turns] == [turn.role for turn in want.turns]
    assert t.reprefilled_tokens == 0 and moved.recomputed == 0
    assert dst.core.prefill_s - prefill_before == pytest.approx(sum(replies))
    assert moved.finished_at > ready


def test_a_multi_turn_request_resumes_at_its_next_turn() -> None:
    """Partial rollout: an interrupted multi-turn request resumes where it stood (turn and
    token), re-prefilling its context, and finishes with every turn."""
    request = _multi_turn_request()
    e = _agentic("e0")
    e.add_request(request)
    _until_tool_wait(e)
    part = e.abort(request.request_id)
    from dora.rollout.partial import resumed

    e.load_weights(1)
    e.add_request(resumed(part, loaded=0, version=1))
    (t,) = _drain(e).values()
    assert t.reprefilled_tokens >= len(part.token_ids) > 0
    assert t.completion_token_ids[: len(part.token_ids)] == part.token_ids
    assert sum(1 for turn in t.turns if turn.role == "assistant") >= 3
