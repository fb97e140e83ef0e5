"""The compiled paged decode-attention kernel equals dense attention and the torch path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dora.engines.torch import paged_kernel
from tests.unit.test_engine_support import make_engine, make_request, run_all

op = paged_kernel.load()
pytestmark = pytest.mark.skipif(op is None, reason="paged kernel could not be built here")


def _reference(q, k_cache, v_cache, table, lens):  # type: ignore[no-untyped-def]
    """Dense attention of each sequence over its context, read block by block."""
    out = torch.empty_like(q)
    kvh = k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = table[b, : -(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].reshape(-1, kvh, q.shape[-1])[:n].transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kvh, q.shape[-1])[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)
        out[b] = o[:, 0]
    return out


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (12, 4), (4, 4)])
def test_kernel_matches_dense_attention(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    bs, d, num_blocks, batch = 16, 64, 64, 7
    k_cache = torch.randn(num_blocks, bs, kv_heads, d)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d)
    lens = torch.tensor([1, 5, 16, 17, 40, 100, 129], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    table = torch.randperm(num_blocks)[: batch * width].view(batch, width).int()
    q = torch.randn(batch, heads, d)
    got = op(q, k_cache, v_cache, table, lens, d**-0.5)
    assert torch.allclose(got, _reference(q, k_cache, v_cache, table, lens), atol=1e-5)
    # a sequence's output does not depend on the others in the batch
    alone = op(q[3:4].contiguous(), k_cache, v_cache, table[3:4].contiguous(), lens[3:4], d**-0.5)
    assert torch.equal(alone[0], got[3])


def test_kernel_refuses_bad_metadata() -> None:
    k_cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    table = torch.tensor([[9]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, k_cache, k_cache, table, torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="ctx_lens out of range"):
        op(q, k_cache, k_cache, table * 0, torch.tensor([17], dtype=torch.int32), 0.125)


def test_write_kv_equals_index_copy_from_a_qkv_view() -> None:
    """The memcpy write reads k/v as the fast forward hands them over (views into q|k|v rows)."""
    write = paged_kernel.load_write_kv()
    assert write is not None
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen)
    k, v = qkv[:, 256:384].view(5, 2, 64), qkv[:, 384:].view(5, 2, 64)
    slots = torch.tensor([3, 17, 0, 40, 63])
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    write(k_cache, v_cache, k, v, slots)
    want_k, want_v = torch.zeros(64, 2, 64), torch.zeros(64, 2, 64)
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache.view(64, 2, 64), want_k)
    assert torch.equal(v_cache.view(64, 2, 64), want_v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        write(k_cache, v_cache, k, v, torch.tensor([0, 1, 2, 3, 64]))
    with pytest.raises(RuntimeError, match="contiguous"):
        write(k_cache, v_cache, k.transpose(1, 2), v, slots)


def test_engine_with_kernel_equals_torch_path() -> None:
    """Greedy tokens equal, logprobs within 1e-5, with requests joining and leaving."""
    rng = random.Random(1)
    reqs = [
        make_request(f"r{i}", f"Q{i}: {i} + {i * 7} = ?", max_tokens=rng.randint(3, 30))
        for i in range(20)
    ]
    outs = []
    for kernel in (True, False):
        engine = make_engine(paged_kernel=kernel)
        assert engine.runner.uses_kernel is kernel
        for r in reqs:
            engine.add_request(r)
        outs.append(run_all(engine))
    fast, slow = outs
    for r in reqs:
        a, b = fast[r.request_id], slow[r.request_id]
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_kernel_threads_and_kv_head_split_do_not_change_results() -> None:
    """With few sequences and 2 threads, work splits by (sequence, kv head): same bits."""
    torch.manual_seed(1)
    k_cache = torch.randn(128, 16, 2, 64)
    v_cache = torch.randn(128, 16, 2, 64)
    lens = torch.tensor([5, 300, 1000], dtype=torch.int32)
    table = torch.randperm(128).repeat(2)[: 3 * 64].view(3, 64).int()
    q = torch.randn(3, 4, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k_cache, v_cache, table, lens, 0.125)
        torch.set_num_threads(2)
        two = op(q, k_cache, v_cache, table, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.allclose(one, _reference(q, k_cache, v_cache, table, lens), atol=1e-5)
