"""TorchEngine: continuous batching, determinism, prefix caching, preemption, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from dora.engines.base import CapacityError, EngineError, VersionMismatch
from dora.events import ResumeState
from tests.unit.test_engine_support import make_engine, make_request, run_all, run_alone

PROMPTS = [f"Q{i}: what is {i} * {i + 3}? Think step by step." for i in range(64)]


def test_greedy_matches_dense_forward() -> None:
    """The paged path equals recomputing the whole sequence with the dense forward."""
    engine = make_engine()
    req = make_request("r", max_tokens=20)
    traj = run_all_one(engine, req)
    ids = list(traj.prompt_token_ids)
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(20):
            logits = engine.model(torch.tensor([ids]))[0, -1]
            tok = int(logits.argmax())
            expected.append(tok)
            ids.append(tok)
            if tok == engine.model.config.eos_token_id:
                break
    assert list(traj.completion_token_ids) == expected
    assert traj.loss_mask == (1,) * len(expected)
    assert traj.text == engine.tokenizer.decode(expected)


def run_all_one(engine, req):  # type: ignore[no-untyped-def]
    engine.add_request(req)
    return run_all(engine)[req.request_id]


def test_continuous_batching_equals_alone() -> None:
    """64 requests joining and leaving give each the tokens (and logprobs) it gets alone."""
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", PROMPTS[i], max_tokens=rng.randint(4, 40)) for i in range(64)]
    engine = make_engine(max_num_seqs=64)
    out = {}
    pending = list(reqs)
    for r in pending[:24]:
        engine.add_request(r)
    pending = pending[24:]
    while engine.has_work() or pending:
        for _ in range(rng.randint(0, 4)):
            if pending:
                engine.add_request(pending.pop(0))
        for t in engine.step():
            out[t.request.request_id] = t
    assert set(out) == {r.request_id for r in reqs}
    for r in reqs[::9]:  # a sample of them alone (keeps the test fast)
        alone = run_alone(r)
        got = out[r.request_id]
        assert got.completion_token_ids == alone.completion_token_ids
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert engine.counters.finished == 64


def test_seeded_sampling_is_batch_invariant() -> None:
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=24)
    reqs = [make_request(f"s{i}", PROMPTS[i], seed=1000 + i, **kw) for i in range(12)]
    engine = make_engine()
    for r in reqs:
        engine.add_request(r)
    out = run_all(engine)
    for r in reqs[:3]:
        alone = run_alone(r)
        assert out[r.request_id].completion_token_ids == alone.completion_token_ids
        assert out[r.request_id].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # different seeds give different samples; the same seed twice gives the same
    assert len({out[r.request_id].completion_token_ids for r in reqs}) > 1
    again = run_alone(reqs[0])
    assert again.completion_token_ids == out[reqs[0].request_id].completion_token_ids


def test_prefix_caching_shares_blocks() -> None:
    engine = make_engine(block_size=16)
    text = "A long shared prompt of a GRPO group: " * 3  # 114 chars -> 7 full blocks
    a = make_request("a", text, max_tokens=8)
    engine.add_request(a)
    engine.step()  # a is prefilled; its full blocks are now cached
    first = engine.counters.prefill_tokens
    b = make_request("b", text, max_tokens=8)
    engine.add_request(b)
    engine.step()
    second = engine.counters.prefill_tokens - first
    seq_a, seq_b = engine._seqs["a"], engine._seqs["b"]
    shared = set(seq_a.block_table) & set(seq_b.block_table)
    assert len(shared) >= 6
    assert all(engine.blocks.ref_count[blk] == 2 for blk in shared)
    assert second < first - 6 * 16 + 2  # b computed only its uncached tail (+ a's decode)
    assert engine.counters.cached_tokens == len(shared) * 16  # b admitted with them
    out = run_all(engine)
    assert out["a"].completion_token_ids == out["b"].completion_token_ids
    assert engine.blocks.num_used == 0


def test_cached_tokens_counts_prefix_cache_hits_once() -> None:
    """Only tokens admitted with cached KV count, and each admission counts once."""
    engine = make_engine(block_size=16)
    text = "A long shared prompt of a GRPO group: " * 3  # 115 tokens with BOS: 7 full blocks
    run_all_one(engine, make_request("a", text, max_tokens=4))
    assert engine.counters.cached_tokens == 0  # nothing was cached before a
    run_all_one(engine, make_request("b", text, max_tokens=4))
    assert engine.counters.cached_tokens == 7 * 16
    prefill_b = engine.counters.prefill_tokens
    run_all_one(engine, make_request("c", text[:40], max_tokens=4))  # 41 tokens: 2 full blocks
    assert engine.counters.cached_tokens == 7 * 16 + 2 * 16
    assert engine.counters.prefill_tokens - prefill_b == 41 - 2 * 16
    off = make_engine(block_size=16, enable_prefix_caching=False)
    for rid in ("a", "b"):
        run_all_one(off, make_request(rid, text, max_tokens=4))
    assert off.counters.cached_tokens == 0


def test_preemption_with_tiny_pool_finishes_identically() -> None:
    reqs = [make_request(f"p{i}", PROMPTS[i], max_tokens=40) for i in range(6)]
    engine = make_engine(num_blocks=10, block_size=16)
    for r in reqs:
        engine.add_request(r)
    out = run_all(engine)
    assert engine.counters.preemptions > 0
    assert sum(t.reprefilled_tokens for t in out.values()) > 0
    assert engine.counters.reprefilled_tokens == sum(t.reprefilled_tokens for t in out.values())
    for r in reqs:
        alone = run_alone(r)
        assert out[r.request_id].completion_token_ids == alone.completion_token_ids
    assert engine.blocks.num_used == 0


def test_chunked_prefill_under_token_budget() -> None:
    req = make_request("c", "x" * 150, max_tokens=6)
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request(req)
    engine.step()
    assert engine.counters.prefill_tokens == 32
    out = run_all(engine)
    assert out["c"].completion_token_ids == run_alone(req).completion_token_ids


def test_priority_runs_first() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request(make_request("low", max_tokens=3))
    engine.add_request(make_request("high", max_tokens=3))
    engine.set_priority("high", 10)
    order = [t.request.request_id for _ in range(20) for t in engine.step()]
    assert order == ["high", "low"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (make_request("long", "x" * 5000), "context"),
        (make_request("unk", prompt_token_ids=(1, 5, 100_000)), "prompt_token_ids"),
        (make_request("neg", prompt_token_ids=(1, -3)), "prompt_token_ids"),
        (make_request("zero", max_tokens=0), "max_tokens"),
        (make_request("neg_max", max_tokens=-5), "max_tokens"),
        (make_request("ver", version=3), "version"),
    ],
)
def test_bad_requests_are_refused_and_others_finish(bad, message) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request(make_request("ok1", max_tokens=5))
    with pytest.raises(EngineError, match=message):
        engine.add_request(bad)
    engine.add_request(make_request("ok2", max_tokens=5))
    out = run_all(engine)
    assert set(out) == {"ok1", "ok2"}


def test_request_larger_than_pool_is_capacity_error() -> None:
    engine = make_engine(num_blocks=4, block_size=16)
    with pytest.raises(CapacityError, match="KV blocks"):
        engine.add_request(make_request("big", max_tokens=200))


def test_load_weights_refused_while_holding_other_version() -> None:
    engine = make_engine()
    engine.add_request(make_request("r", max_tokens=4))
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(VersionMismatch, match="version 0"):
        engine.load_weights(1, state)
    engine.load_weights(0, state)  # same version: allowed
    run_all(engine)
    engine.load_weights(1, state)
    assert engine.version == 1
    with pytest.raises(VersionMismatch):
        engine.add_request(make_request("old", max_tokens=4))
    engine.add_request(make_request("new", version=1, max_tokens=4))
    assert run_all(engine)["new"].version == 1


def test_abort_returns_partial_and_frees_blocks() -> None:
    engine = make_engine()
    engine.add_request(make_request("a", max_tokens=30))
    for _ in range(5):
        engine.step()
    part = engine.abort("a")
    assert len(part.token_ids) == 5 and len(part.logprobs) == 5
    assert part.engines == ("e0",)
    assert engine.blocks.num_used == 0 and not engine.has_work()
    with pytest.raises(EngineError, match="unknown request_id"):
        engine.abort("a")


def test_resume_counts_reprefill_and_token_versions() -> None:
    full = run_alone(make_request("r", max_tokens=12))
    resume = ResumeState(
        token_ids=full.completion_token_ids[:5],
        logprobs=full.logprobs[:5],
        token_versions=(0,) * 5,
        engines=("old",),
    )
    engine = make_engine(version=1)
    req = make_request("r", version=1, max_tokens=12, resume=resume)
    traj = run_all_one(engine, req)
    assert traj.completion_token_ids == full.completion_token_ids  # same weights: same tokens
    assert traj.token_versions == (0,) * 5 + (1,) * 7
    assert traj.reprefilled_tokens == len(full.prompt_token_ids) + 5
    assert traj.engines == ("old", "e0")


def test_status_reports_load() -> None:
    engine = make_engine()
    engine.add_request(make_request("a", max_tokens=10))
    engine.add_request(make_request("b", max_tokens=10))
    engine.step()
    st = engine.status()
    assert st.running == 2 and st.waiting == 0 and st.state == "serving"
    assert st.kv_blocks_used == sum(r.kv_blocks for r in st.requests) == 4  # 23 tokens each
    assert st.kv_blocks_total == 512
    assert {r.request_id for r in st.requests} == {"a", "b"}
    assert all(r.generated == 1 for r in st.requests)


def test_satisfies_engine_protocol() -> None:
    from dora.engines.base import Engine

    assert isinstance(make_engine(), Engine)


def test_stop_token_ids_and_stop_strings() -> None:
    free = run_alone(make_request("f", max_tokens=20))
    toks = free.completion_token_ids
    by_id = run_alone(make_request("i", max_tokens=20, stop_token_ids=(toks[3],)))
    assert by_id.finish_reason == "stop"
    assert by_id.completion_token_ids == toks[: toks.index(toks[3]) + 1]
    text = free.text
    needle = text[4:6]
    by_str = run_alone(make_request("s", max_tokens=20, stop_strings=(needle,)))
    assert by_str.finish_reason == "stop"
    assert needle in by_str.text and needle not in by_str.text[:-1]  # stopped at its first end
    assert len(by_str.completion_token_ids) < len(toks)


def test_from_pretrained_and_load_weights_from_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dora.engines.torch import EngineConfig, TorchEngine
    from dora.models import build_model, save_pretrained

    model, tok = build_model("tiny", seed=0, num_hidden_layers=2)
    save_pretrained(model, tmp_path / "ckpt", tok)
    engine = TorchEngine.from_pretrained(tmp_path / "ckpt", EngineConfig(num_blocks=64))
    ref = run_alone(make_request("r", max_tokens=8))
    assert run_all_one(engine, make_request("r", max_tokens=8)).completion_token_ids == (
        ref.completion_token_ids
    )
    other, _ = build_model("tiny", seed=1, num_hidden_layers=2)
    save_pretrained(other, tmp_path / "v1")
    engine.load_weights(1, tmp_path / "v1")
    out = run_all_one(engine, make_request("r", version=1, max_tokens=8))
    assert out.version == 1 and out.completion_token_ids != ref.completion_token_ids
    with pytest.raises(EngineError, match="cannot load weights"):
        engine.load_weights(2, tmp_path / "missing")


def test_kv_cache_in_huge_page_memory_is_plain_zeros() -> None:
    """The KV tensor (huge-page advised where the OS allows) is zeros, writable, contiguous."""
    from dora.engines.torch.model_runner import zeros_huge_pages

    for shape in [(2, 3), (4, 2, 64, 16, 2, 64)]:  # below and above the 2 MiB threshold
        t = zeros_huge_pages(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
        assert not t.any()
        t.view(-1)[-1] = 3.0
        assert float(t.sum()) == 3.0
    engine = make_engine()
    assert engine.runner.kv_cache.is_contiguous() and not engine.runner.kv_cache.any()
