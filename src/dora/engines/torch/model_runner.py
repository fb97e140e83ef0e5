"""Turns a scheduled batch into one ``forward_tokens`` call over the paged KV tensor.

The runner owns the KV tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(one tensor per engine, so exporting a request is a gather by block ids and importing it is a
scatter) and builds the attention metadata of each step.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import structlog
import torch
from torch import Tensor

from dora.engines.torch import fast_forward as fast_forward_mod
from dora.engines.torch import paged_kernel
from dora.engines.torch.attention import (
    AttentionMetadata,
    DecodeBucket,
    KernelDecode,
    PagedAttention,
    PrefillChunk,
)
from dora.engines.torch.fast_forward import FastForward
from dora.engines.torch.sequence import Sequence
from dora.models import LlamaModel

log = structlog.get_logger(__name__)


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A CPU tensor of zeros in private anonymous memory advised for transparent huge pages.

    Why: decode attention reads every running sequence's K/V blocks each step (as many bytes
    as the weights on the small preset), from blocks scattered over a large tensor; with 4 KiB
    pages much of that read time is TLB misses. Where huge pages are unavailable (not Linux,
    THP off) it is an ordinary ``torch.zeros``: same values, same layout.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < (2 << 20) or advise is None:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advise)
    except (OSError, ValueError, AttributeError) as exc:
        log.info("kv_huge_pages_unavailable", error=f"{type(exc).__name__}: {exc}"[:200])
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the mapping alive; anonymous memory is zero-filled
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


@dataclass
class ScheduledSeq:
    """``num_tokens`` pending tokens of ``seq`` computed in this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last pending token (so it samples)."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class ModelRunner:
    """Holds the model and the KV tensor; runs one step's forward."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        bucket_waste: float = 0.5,
        use_kernel: bool = True,
        fast_forward: bool = True,
        linear: str = "auto",
    ) -> None:
        self.model = model
        cfg = model.config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.bucket_waste = bucket_waste
        shape = (
            cfg.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        if device.type == "cpu":
            self.kv_cache = zeros_huge_pages(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        kernel = None
        if use_kernel and device.type == "cpu" and dtype == torch.float32:
            kernel = paged_kernel.load()
        write_kv = paged_kernel.load_write_kv() if kernel is not None else None
        self.attn = PagedAttention(self.kv_cache, block_size, kernel, write_kv)
        self.fast: FastForward | None = None
        if fast_forward and fast_forward_mod.supported(device, dtype):
            if linear == "auto":
                linear = fast_forward_mod.best_linear()
            self.fast = FastForward(model, linear)
        # the decode block table is rebuilt only when some sequence's table changed
        self._table_key: tuple[tuple[int, int], ...] = ()
        self._table: Tensor | None = None

    @property
    def uses_kernel(self) -> bool:
        """True when decode attention runs in the compiled paged kernel."""
        return self.attn.kernel is not None

    # ------------------------------------------------------------------ KV transfer

    def gather_blocks(self, block_ids: list[int]) -> Tensor:
        """KV of some blocks, ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, idx)

    def scatter_blocks(self, block_ids: list[int], kv: Tensor) -> None:
        """Write ``kv`` (as returned by ``gather_blocks``) into ``block_ids``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, idx, kv.to(device=self.device, dtype=self.dtype))

    def kv_bytes_per_token(self) -> int:
        c = self.model.config
        per_layer = 2 * c.num_key_value_heads * c.head_dim * self.kv_cache.element_size()
        return c.num_hidden_layers * per_layer

    # ------------------------------------------------------------------ step

    def prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[Tensor, Tensor, Tensor, AttentionMetadata, list[Sequence]]:
        """Flat input ids, positions, logits indices, attention metadata, sampling order.

        Decode sequences go first, sorted by context length, so that each decode bucket is a
        contiguous slice of the flat batch.
        """
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        meta_decode: list[DecodeBucket] = []
        meta_prefill: list[PrefillChunk] = []
        decode = [s for s in batch if s.num_tokens == 1 and s.seq.num_computed > 0]
        if not self.uses_kernel:
            decode.sort(key=lambda s: s.seq.num_computed)
        order: list[Sequence] = [s.seq for s in decode]
        decode_set = {id(s) for s in decode}
        rest = [s for s in batch if id(s) not in decode_set]
        if rest:
            self._table_key = ()  # tables may have been replaced: rebuild the decode table
        for s in decode:
            seq = s.seq
            p = seq.num_computed
            logits_idx.append(len(ids))
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        kernel_decode = None
        if self.uses_kernel and decode:
            kernel_decode = self._kernel_decode(decode)
        else:
            meta_decode = self._buckets(decode)
        for s in rest:
            seq = s.seq
            c, n = seq.num_computed, s.num_tokens
            start = len(ids)
            ids.extend(seq.token_ids[c : c + n])
            pos.extend(range(c, c + n))
            used = -(-(c + n) // bs)
            table = seq.block_table[:used]
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            mask = None
            if c > 0:
                q_pos = torch.arange(c, c + n, device=self.device)
                mask = torch.arange(c + n, device=self.device)[None, :] <= q_pos[:, None]
            blocks = torch.tensor(table, dtype=torch.long, device=self.device)
            meta_prefill.append(PrefillChunk(start, n, c + n, blocks, mask))
            if s.samples:
                logits_idx.append(start + n - 1)
                order.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            kernel_decode=kernel_decode,
            decode=meta_decode,
            prefill=meta_prefill,
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(logits_idx, dtype=torch.long, device=dev),
            meta,
            order,
        )

    def _kernel_decode(self, decode: list[ScheduledSeq]) -> KernelDecode:
        """Block table and context lengths of the decode sequences for the compiled kernel.

        Between decode steps a running sequence's table only grows, so the tensor is cached
        on (sequence serial, blocks in use) and reused by most steps; any step with a prefill
        (admission, re-prefill after preemption) drops the cache, as does a new sequence.
        """
        bs = self.block_size
        lens = [s.seq.num_computed + 1 for s in decode]
        used = [-(-n // bs) for n in lens]
        key = tuple((s.seq.arrival, u) for s, u in zip(decode, used, strict=True))
        if key != self._table_key or self._table is None:
            width = max(used)
            rows = [
                s.seq.block_table[:u] + [0] * (width - u) for s, u in zip(decode, used, strict=True)
            ]
            self._table = torch.tensor(rows, dtype=torch.int32, device=self.device)
            self._table_key = key
        ctx = torch.tensor(lens, dtype=torch.int32, device=self.device)
        return KernelDecode(len(decode), self._table, ctx)

    def _buckets(self, decode: list[ScheduledSeq]) -> list[DecodeBucket]:
        """Group consecutive decode sequences (sorted by context) so padding stays bounded."""
        out: list[DecodeBucket] = []
        i = 0
        while i < len(decode):
            j = i + 1
            total = decode[i].seq.num_computed + 1
            while j < len(decode):
                ctx = decode[j].seq.num_computed + 1
                if (j - i + 1) * ctx > (1 + self.bucket_waste) * (total + ctx):
                    break
                total += ctx
                j += 1
            group = decode[i:j]
            max_ctx = max(s.seq.num_computed + 1 for s in group)
            max_blocks = -(-max_ctx // self.block_size)
            rows = [s.seq.block_table[:max_blocks] for s in group]
            rows = [r + [0] * (max_blocks - len(r)) for r in rows]
            table = torch.tensor(rows, dtype=torch.long, device=self.device)
            lens = [s.seq.num_computed + 1 for s in group]
            mask = None
            if min(lens) != max_ctx:
                lt = torch.tensor(lens, device=self.device)
                mask = torch.arange(max_ctx, device=self.device)[None, :] < lt[:, None]
                mask = mask[:, None, None, :]
            out.append(DecodeBucket(i, len(group), table.view(-1), max_ctx, mask))
            i = j
        return out

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[Tensor, list[Sequence]]:
        """Logits ``[num_sampling_seqs, vocab]`` (fp32) and the sequences they belong to."""
        input_ids, positions, logits_idx, meta, order = self.prepare(batch)
        self.attn.meta = meta
        try:
            if self.fast is not None:
                logits = self.fast(input_ids, positions, self.attn, logits_idx)
            else:
                logits = self.model.forward_tokens(input_ids, positions, self.attn, logits_idx)
        finally:
            self.attn.meta = None
        return logits.float(), order
