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
