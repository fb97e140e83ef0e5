"""The engine's AVX2 matmul equals ``F.linear`` on every edge of its tiling, and a row's result
does not depend on the batch around it or on the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dora.engines.torch import gemm_kernel

ops = gemm_kernel.load()
pytestmark = pytest.mark.skipif(ops is None, reason="gemm_kernel needs AVX2/FMA and a compiler")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    assert ops is not None
    return ops.linear(x, ops.pack(w), w.shape[0], b)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 200])  # edge tiles, more than one row block
@pytest.mark.parametrize(("out", "inp"), [(1, 3), (17, 255), (16, 256), (33, 257), (40, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, out: int, inp: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out + inp)
    x, w = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    got = _linear(x, w, b)
    assert got.shape == (rows, out)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # fp32 rounding of a length-`inp` dot product, nothing more
    assert torch.allclose(got.double(), exact, atol=2e-6 * inp, rtol=1e-5)


def test_row_results_are_batch_and_thread_invariant() -> None:
    """Bitwise: a row alone, the same row among 199 others, with 1 or 2 threads."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(200, 768, generator=gen), torch.randn(1280, 768, generator=gen)
    assert ops is not None
    packed = ops.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = ops.linear(x, packed, 1280, None)
        torch.set_num_threads(2)
        assert torch.equal(ops.linear(x, packed, 1280, None), full)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 5, 6, 63, 191, 199):
        assert torch.equal(ops.linear(x[i : i + 1], packed, 1280, None)[0], full[i])
    assert torch.equal(ops.linear(x[60:67], packed, 1280, None), full[60:67])


def test_mismatched_packed_weight_is_a_clear_error() -> None:
    assert ops is not None
    w = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear(torch.randn(4, 64), ops.pack(w), 48, None)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.linear(torch.randn(4, 64, dtype=torch.float64), ops.pack(w), 32, None)


def test_probe_says_it_works_here() -> None:
    assert gemm_kernel.works()
