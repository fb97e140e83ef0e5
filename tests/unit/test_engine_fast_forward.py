"""The engine's fast forward (fused weights, packed linears, compiled row ops) equals the plain
path, and follows every weight change."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dora.engines.torch import EngineConfig, cpu_ops, fast_forward, gemm_kernel
from dora.models.layers import RMSNorm, RotaryTable, apply_rotary
from tests.unit.test_engine_support import make_engine, make_request, run_all

ops = cpu_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="cpu_ops could not be built here")
LINEARS = (
    ["torch"]
    + (["mkldnn"] if fast_forward.mkldnn_linear_works() else [])
    + (["avx2"] if gemm_kernel.works() else [])
)


def _requests() -> list:  # type: ignore[type-arg]
    rng = random.Random(3)
    return [
        make_request(
            f"r{i}",
            f"Q{i}: {i} * {i + 2} = ?",
            max_tokens=rng.randint(3, 24),
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
        )
        for i in range(16)
    ]


def _run(reqs, **config):  # type: ignore[no-untyped-def]
    engine = make_engine(**config)
    for r in reqs:
        engine.add_request(r)
    return engine, run_all(engine)


def test_row_ops_match_torch() -> None:
    assert ops is not None
    torch.manual_seed(0)
    x, d, w = torch.randn(5, 256), torch.randn(5, 256), torch.randn(256)
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = w
    with torch.no_grad():
        assert torch.allclose(ops.rms_norm(x, w, 1e-6), norm(x), atol=1e-5)
        x2 = x.clone()
        assert torch.allclose(ops.add_rms_norm(x2, d, w, 1e-6), norm(x + d), atol=1e-5)
    assert torch.equal(x2, x + d)  # the residual stream is updated in place
    rot = RotaryTable(64, 4096, 10000.0)
    pos = torch.tensor([0, 3, 100, 7, 2000])
    qkv = torch.randn(5, 8 * 64)
    got = qkv.clone()
    ops.rope_(got, rot.cos, rot.sin, pos, 6)  # q (4 heads) and k (2 heads); v untouched
    cos, sin = rot(pos, torch.float32)
    want = apply_rotary(qkv[:, : 6 * 64].view(5, 6, 64), cos, sin).reshape(5, -1)
    assert torch.allclose(got[:, : 6 * 64], want, atol=1e-6)
    assert torch.equal(got[:, 6 * 64 :], qkv[:, 6 * 64 :])
    gu = torch.randn(5, 2 * 64) * 6
    want = F.silu(gu[:, :64]) * gu[:, 64:]
    assert torch.allclose(ops.silu_mul(gu), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rope_(got, rot.cos, rot.sin, torch.tensor([0, 1, 2, 3, 4096]), 6)


@pytest.mark.parametrize("linear", LINEARS)
def test_fast_forward_matches_plain_path(linear: str) -> None:
    """Greedy and seeded tokens equal, logprobs within 1e-5, requests joining and leaving."""
    reqs = _requests()
    fast_engine, fast = _run(reqs, linear=linear)
    assert fast_engine.runner.fast is not None and fast_engine.runner.fast.linear == linear
    plain_engine, plain = _run(reqs, fast_forward=False)
    assert plain_engine.runner.fast is None
    for r in reqs:
        a, b = fast[r.request_id], plain[r.request_id]
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("linear", LINEARS)
def test_load_weights_repacks(linear: str) -> None:
    """After a weight swap the fast path serves the new weights, exactly as the plain path."""
    req = make_request("a", max_tokens=12, temperature=0.0)
    engine = make_engine(linear=linear)
    fast = engine.runner.fast
    assert fast is not None
    engine.add_request(req)
    before = run_all(engine)["a"]
    repacks = fast.repacks
    gen = torch.Generator().manual_seed(7)
    state = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in engine.model.state_dict().items()
    }
    engine.load_weights(1, state)
    assert fast.repacks == repacks + 1
    after_req = make_request("a", max_tokens=12, temperature=0.0, version=1)
    engine.add_request(after_req)
    after = run_all(engine)["a"]
    assert after.completion_token_ids != before.completion_token_ids
    plain = make_engine(fast_forward=False, version=1)
    plain.load_weights(1, state)
    plain.add_request(after_req)
    ref = run_all(plain)["a"]
    assert after.completion_token_ids == ref.completion_token_ids
    assert after.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


def test_in_place_weight_change_is_picked_up() -> None:
    """Packed weights are derived state: an in-place parameter write invalidates them."""
    engine = make_engine()
    fast = engine.runner.fast
    assert fast is not None
    repacks = fast.repacks
    assert not fast.sync()  # nothing changed: no rebuild
    with torch.no_grad():
        engine.model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    assert fast.sync() and fast.repacks == repacks + 1


def test_bad_linear_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.linear"):
        EngineConfig(linear="bogus")


def test_fast_forward_off_uses_model_forward() -> None:
    engine = make_engine(fast_forward=False)
    assert engine.runner.fast is None
    engine.add_request(make_request("a", max_tokens=3))
    assert len(run_all(engine)["a"].completion_token_ids) == 3
