"""Paged attention over the engine's single KV tensor (an ``AttentionBackend``).

Per layer it writes the step's new k/v into their slots, then attends:

- decode tokens (one query per sequence): with the compiled CPU kernel (``paged_kernel``),
  ONE call reads every sequence's K/V rows straight from its blocks (no copy, no padding);
  otherwise in buckets of similar context length: one batched gather of each bucket's KV by
  block ids and ONE ``scaled_dot_product_attention`` call with a padding mask (grouped-query
  heads ride along as extra query rows);
- prefill chunks one sequence at a time, causal with the chunk's offset into its context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from dora.engines.torch.paged_kernel import DecodeAttention, WriteKV


@dataclass
class DecodeBucket:
    """Decode tokens ``[start, start + size)`` of the flat batch and their KV slots."""

    start: int
    size: int
    blocks: Tensor  # [size * max_blocks] block ids, row-major (padding: block 0, masked out)
    max_ctx: int  # longest context in the bucket
    mask: Tensor | None  # [size, 1, 1, max_ctx] True = attend; None when all lengths are equal


@dataclass
class KernelDecode:
    """Decode tokens ``[0, size)`` of the flat batch, attended by the compiled kernel."""

    size: int
    table: Tensor  # [size, max_blocks] int32 block ids (padding never read)
    lens: Tensor  # [size] int32 context lengths, the new token included


@dataclass
class PrefillChunk:
    """Query tokens ``[start, start + size)`` attending to ``slots`` (their whole context)."""

    start: int
    size: int
    ctx: int  # context length, the chunk included
    blocks: Tensor  # [ceil(ctx / block_size)] block ids
    mask: Tensor | None  # [size, ctx] or None when the chunk is the whole context (causal)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV tensor and what each one attends to."""

    slot_mapping: Tensor  # [N]
    kernel_decode: KernelDecode | None = None
    decode: list[DecodeBucket] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)


class PagedAttention:
    """Callable ``(layer, q, k, v) -> out`` bound to one KV tensor and one step's metadata."""

    def __init__(
        self,
        kv_cache: Tensor,
        block_size: int,
        kernel: DecodeAttention | None = None,
        write_kv: WriteKV | None = None,
    ) -> None:
        # kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.kernel = kernel
        self.write_kv = write_kv  # one memcpy per token row; index_copy_ goes element by element
        self.meta: AttentionMetadata | None = None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        meta = self.meta
        if meta is None:
            raise RuntimeError("PagedAttention called without metadata")
        num_kv_heads, head_dim = k.shape[-2], k.shape[-1]
        k_blocks = self.kv_cache[layer, 0]  # [num_blocks, block_size, KVH, D]
        v_blocks = self.kv_cache[layer, 1]
        if self.write_kv is not None and k.stride(-1) == 1 and k.stride(-2) == head_dim:
            self.write_kv(k_blocks, v_blocks, k, v, meta.slot_mapping)
        else:
            k_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
            v_blocks.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        num_heads = q.shape[-2]
        groups = num_heads // num_kv_heads
        kd = meta.kernel_decode
        if kd is not None and self.kernel is not None:
            qd = q[: kd.size].contiguous()
            od = self.kernel(qd, k_blocks, v_blocks, kd.table, kd.lens, head_dim**-0.5)
            if kd.size == q.shape[0]:
                return od  # a pure decode step: nothing else to attend
            out[: kd.size] = od
        for b in meta.decode:
            qb = q[b.start : b.start + b.size]  # [B, H, D]
            qb = qb.view(b.size, num_kv_heads, groups, head_dim)
            kb = k_blocks.index_select(0, b.blocks).view(b.size, -1, num_kv_heads, head_dim)
            vb = v_blocks.index_select(0, b.blocks).view(b.size, -1, num_kv_heads, head_dim)
            kb = kb[:, : b.max_ctx].transpose(1, 2)  # [B, KVH, L, D]
            vb = vb[:, : b.max_ctx].transpose(1, 2)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask)
            out[b.start : b.start + b.size] = ob.reshape(b.size, num_heads, head_dim)
        for c in meta.prefill:
            qc = q[c.start : c.start + c.size].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            kc = k_blocks.index_select(0, c.blocks).view(-1, num_kv_heads, head_dim)[: c.ctx]
            vc = v_blocks.index_select(0, c.blocks).view(-1, num_kv_heads, head_dim)[: c.ctx]
            kc = kc.transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            vc = vc.transpose(0, 1).unsqueeze(0)
            if c.mask is None:
                oc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
            else:
                oc = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=True)
            out[c.start : c.start + c.size] = oc[0].transpose(0, 1)
        return out
