"""Deterministic per-request sampling with the logprob of the distribution actually used.

The random draw for completion token ``t`` of a request is a uniform number derived from
``(seed, t)`` by a counter-based hash (splitmix64), and a token is picked by inverse CDF over
the filtered distribution. Nothing depends on the batch, the engine or the step at which the
token is produced, so a migrated or batched request samples exactly what it would alone.

Logprobs: for temperature > 0 the logprob is under the distribution sampled from (after
temperature, top-k, then top-p, renormalised); for greedy (temperature 0) it is the logprob
of the chosen token under the raw softmax of the logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from dora.events import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One round of splitmix64: a well-mixed 64-bit hash of a 64-bit counter."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, t: int) -> float:
    """The uniform in [0, 1) used for token ``t`` of a request seeded with ``seed``."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ (t & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` on a uint64 array (numpy wraps modulo 2**64 like the masks above)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """``uniform(seed, t)`` for a whole batch at once (float64, bit-identical to the scalar)."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    t = np.array([x & _MASK64 for x in positions], dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64_np(_splitmix64_np(s) ^ t)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(
    logits: Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> tuple[list[int], list[float]]:
    """Token id and logprob for each row of ``logits [B, V]``.

    ``positions[i]`` is the completion index of the token row ``i`` produces (its counter).
    """
    logits = logits.float()
    rows = logits.shape[0]
    tokens: list[int] = [0] * rows
    logprobs: list[float] = [0.0] * rows
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if greedy:
        g = logits[greedy]
        ids = g.argmax(dim=-1)
        lp = torch.log_softmax(g, dim=-1).gather(1, ids[:, None])[:, 0]
        for row, tok, val in zip(greedy, ids.tolist(), lp.tolist(), strict=True):
            tokens[row], logprobs[row] = tok, val
    if sampled:
        ps = [params[i] for i in sampled]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=logits.device)
        scaled = logits[sampled] / temp[:, None]
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        vocab = scaled.shape[-1]
        dev = logits.device
        ranks = torch.arange(vocab, device=dev)[None, :]
        # top-k / top-p are applied per row; rows where they are off (0 / 1.0) keep every
        # token, and the whole pass is skipped when they are off for every row (same result)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        if min(ks) < vocab:
            top_k = torch.tensor(ks, device=dev)
            sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        if any(p.top_p < 1.0 for p in ps):
            tp = [p.top_p if p.top_p < 1.0 else float("inf") for p in ps]
            top_p = torch.tensor(tp, dtype=torch.float32, device=dev)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
            keep = ((before < top_p[:, None]) | (ranks == 0)) & (probs > 0)
        else:
            keep = probs > 0
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
        cdf = torch.cumsum(probs, dim=-1)
        draws = uniforms([p.seed for p in ps], [positions[i] for i in sampled])
        u = torch.from_numpy(draws).to(device=dev, dtype=torch.float32)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        kept = keep.sum(dim=-1) - 1
        idx = torch.minimum(idx, kept)
        chosen = sorted_ids.gather(1, idx[:, None])[:, 0]
        lp = torch.log(probs.gather(1, idx[:, None])[:, 0])
        for row, tok, val in zip(sampled, chosen.tolist(), lp.tolist(), strict=True):
            tokens[row], logprobs[row] = tok, val
    return tokens, logprobs
