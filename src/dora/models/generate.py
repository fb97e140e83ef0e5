"""A simple, obviously-correct batched generator with a contiguous KV cache.

This is the reference the fast paged engine is checked against, and what the warm start uses
for evaluation. Prompts are left-padded into one ``[batch, slots]`` cache per layer; a boolean
``valid`` map hides the padding, and each row's positions count only its real tokens, so a
row's output does not depend on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dora.models.llama import LlamaModel


class ContiguousKVCache:
    """An ``AttentionBackend`` holding K/V of every layer in ``[layers, batch, slots, kv, d]``.

    Call ``begin(start, length)`` before each forward: the model's ``batch * length`` flat
    tokens are the cache slots ``[start, start + length)`` of every row.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        self.batch = batch
        self.slots = slots
        self.start = 0
        self.length = 0

    def begin(self, start: int, length: int) -> None:
        """Select the slots the next forward writes (and whose queries it computes)."""
        if start < 0 or start + length > self.slots:
            raise ValueError(f"slots [{start}, {start + length}) outside cache of {self.slots}")
        self.start, self.length = start, length

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, t, s0 = self.batch, self.length, self.start
        end = s0 + t
        q = q.view(b, t, *q.shape[1:])
        self.k[layer, :, s0:end] = k.view(b, t, *k.shape[1:])
        self.v[layer, :, s0:end] = v.view(b, t, *v.shape[1:])
        keys = self.k[layer, :, :end]
        values = self.v[layer, :, :end]
        slot = torch.arange(end, device=q.device)
        query_slot = torch.arange(s0, end, device=q.device)
        causal = slot[None, :] <= query_slot[:, None]  # [t, end]
        allowed = causal[None] & self.valid[:, None, :end]  # [b, t, end]
        # A padding query sees nothing valid; let it see itself so no NaN reaches real rows.
        allowed = allowed | (slot[None, :] == query_slot[:, None])[None]
        qh, kh, vh = (x.transpose(1, 2) for x in (q, keys, values))  # [b, heads, len, d]
        groups = qh.shape[1] // kh.shape[1]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=1)
            vh = vh.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None])
        return out.transpose(1, 2).reshape(b * t, *q.shape[2:])


def _sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: LlamaModel,
    tokenizer: object | None,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Completions of a batch of token-id prompts (greedy when ``temperature`` is 0).

    Each returned list stops at (and includes) the end-of-sequence token, or has
    ``max_new_tokens`` tokens. ``eos_token_id`` defaults to the tokenizer's, then the model's.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None) or model.config.eos_token_id
    cfg = model.config
    device = model.device
    b = len(prompts)
    width = max(len(p) for p in prompts)
    slots = width + max_new_tokens
    if slots > cfg.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens ({slots}) > {cfg.max_position_embeddings}")
    cache = ContiguousKVCache(
        cfg.num_hidden_layers, b, slots, cfg.num_key_value_heads, cfg.head_dim, model.dtype, device
    )
    pad = cfg.pad_token_id or 0
    ids = torch.full((b, width), pad, dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        cache.valid[row, width - len(p) : width] = True
    positions = (torch.arange(width, device=device)[None] - (width - lengths)[:, None]).clamp(min=0)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    cache.begin(0, width)
    last = torch.arange(b, device=device) * width + width - 1
    logits = model.forward_tokens(ids.reshape(-1), positions.reshape(-1), cache, last)
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = _sample(logits, temperature, generator)
        for row in range(b):
            if not done[row]:
                out[row].append(int(token[row]))
        if eos_token_id is not None:
            done |= token == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        slot = width + step
        cache.valid[:, slot] = True
        cache.begin(slot, 1)
        logits = model.forward_tokens(token, lengths + step, cache)
    return out
