"""Cost model of one inference replica: how long a decode step, a prefill, a weight load and a
KV migration take, from the model's shapes and the accelerator's datasheet.

Decode is memory-bandwidth bound: every step streams all weights once and every running
request's KV cache once, plus a compute term per sequence that matters only at large batch.
So one decode step over ``batch`` sequences holding ``context`` KV tokens in total costs

    t = a + b * batch + c * context
    a = overhead + weight_bytes / (hbm_bw * bw_efficiency)
    b = 2 * params / (peak_flops * decode_mfu)
    c = kv_bytes_per_token / (hbm_bw * bw_efficiency)

This linear form lets the timing engine jump straight to its next event: with the batch fixed,
the context grows by ``batch`` every step, so the time of ``k`` steps is a closed-form sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

H200_HBM_BYTES = 141e9
"""H200 SXM: 141 GB HBM3e (NVIDIA datasheet; MLCommons inference v4.1 system description
``H200-SXM-141GBx8``: accelerator_memory_capacity "141 GB", HBM3e)."""
H200_HBM_BW = 4.8e12
"""H200 SXM: 4.8 TB/s HBM3e bandwidth (NVIDIA H200 datasheet)."""
H200_BF16_FLOPS = 989.4e12
"""H200 SXM: 989.4 TFLOP/s dense BF16 (NVIDIA spec, quoted in the public MI300X-vs-H200
report, alpharomercoma/MI300X-vs-H200 REPORT.md)."""


@dataclass(frozen=True)
class CostModel:
    """Timing constants of one replica (one GPU) serving one dense model in bf16.

    Every derived number is a property, so a preset states only measurable inputs.
    """

    name: str
    params: float = field(metadata={"unit": "parameters"})
    num_layers: int
    num_kv_heads: int
    head_dim: int
    q_dim: int  # num_attention_heads * head_dim, for the attention term of prefill
    dtype_bytes: int = 2
    hbm_bytes: float = H200_HBM_BYTES
    hbm_bw: float = H200_HBM_BW
    peak_flops: float = H200_BF16_FLOPS
    bw_efficiency: float = 0.80  # achieved/peak HBM bandwidth of decode GEMV kernels
    decode_mfu: float = 0.50  # per-sequence compute term of decode
    prefill_mfu: float = 0.50  # chunked prefill at large token counts
    step_overhead_s: float = 0.003  # scheduler + sampling + launch per step (CUDA graphs on)
    gpu_memory_utilization: float = 0.90  # vLLM's default fraction of HBM it may use
    activation_reserve_bytes: float = 4e9  # activations, CUDA graphs, sampler buffers
    max_num_seqs: int = 256  # vLLM's default cap on running sequences
    weight_load_bw: float = 25e9  # bytes/s: trainer -> engine broadcast (NCCL over 400G IB)
    weight_load_fixed_s: float = 1.0  # pause, barrier, cache reset
    migration_bw: float = 25e9  # bytes/s engine -> engine KV transfer (RDMA, 400G IB)
    migration_fixed_s: float = 0.005  # per request: handshake and block-table setup

    # ---------------------------------------------------------------- sizes
    @cached_property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @cached_property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit next to the weights (what limits concurrency)."""
        free = (
            self.hbm_bytes * self.gpu_memory_utilization
            - self.weight_bytes
            - self.activation_reserve_bytes
        )
        if free <= 0:
            raise ValueError(f"{self.name}: weights do not fit in hbm_bytes={self.hbm_bytes:g}")
        return int(free // self.kv_bytes_per_token)

    # ---------------------------------------------------------------- decode
    @cached_property
    def a(self) -> float:
        """Seconds per step independent of the batch: overhead + streaming the weights."""
        return self.step_overhead_s + self.weight_bytes / (self.hbm_bw * self.bw_efficiency)

    @cached_property
    def b(self) -> float:
        """Seconds per step per running sequence (2 * params FLOPs each)."""
        return 2.0 * self.params / (self.peak_flops * self.decode_mfu)

    @cached_property
    def c(self) -> float:
        """Seconds per step per KV token held by the running sequences."""
        return self.kv_bytes_per_token / (self.hbm_bw * self.bw_efficiency)

    def step_time(self, batch: int, context: int) -> float:
        """One decode step over ``batch`` sequences with ``context`` KV tokens in total."""
        if batch <= 0:
            return 0.0
        return self.a + self.b * batch + self.c * context

    def steps_time(self, k: int, batch: int, context: int) -> float:
        """``k`` decode steps with a fixed batch; the context grows by ``batch`` each step."""
        if k <= 0 or batch <= 0:
            return 0.0
        base = self.a + self.b * batch + self.c * context
        return k * base + self.c * batch * k * (k - 1) / 2.0

    def steps_within(self, dt: float, batch: int, context: int) -> int:
        """Largest ``k`` with ``steps_time(k) <= dt`` (inverse of the quadratic sum)."""
        if dt <= 0 or batch <= 0:
            return 0
        base = self.a + self.b * batch + self.c * context
        q = self.c * batch / 2.0
        lin = base - q
        if q <= 0:
            k = int(dt / base)
        else:
            k = int((-lin + math.sqrt(lin * lin + 4.0 * q * dt)) / (2.0 * q))
        while k > 0 and self.steps_time(k, batch, context) > dt:
            k -= 1
        while self.steps_time(k + 1, batch, context) <= dt:
            k += 1
        return k

    def single_request_time(self, prompt: int, tokens: int) -> float:
        """Prefill + decode of one request alone on a replica (the long-tail floor)."""
        return self.prefill_time(prompt) + self.steps_time(tokens, 1, prompt)

    # ---------------------------------------------------------------- prefill, loads, moves
    def prefill_time(self, tokens: int, start: int = 0) -> float:
        """Prefill ``tokens`` new tokens after ``start`` cached ones: linear + attention FLOPs."""
        if tokens <= 0:
            return 0.0
        linear = 2.0 * self.params * tokens
        attention = 4.0 * self.num_layers * self.q_dim * tokens * (start + tokens / 2.0)
        return (linear + attention) / (self.peak_flops * self.prefill_mfu)

    @property
    def weight_load_time(self) -> float:
        """Receiving a new version's weights from the trainer."""
        return self.weight_load_fixed_s + self.weight_bytes / self.weight_load_bw

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def migration_time(self, tokens: int, bandwidth: float | None = None) -> float:
        """Moving one request's KV for ``tokens`` cached tokens to another replica."""
        bw = bandwidth if bandwidth is not None else self.migration_bw
        return self.migration_fixed_s + self.kv_bytes(tokens) / bw

    def peak_throughput(self, mean_context: float) -> float:
        """Decode tokens/s at the largest batch the KV capacity allows for that context."""
        n = max(1, min(self.max_num_seqs, int(self.kv_capacity_tokens / max(mean_context, 1.0))))
        return n / self.step_time(n, int(n * mean_context))

    def with_overrides(self, **changes: float | int | str) -> CostModel:
        return replace(self, **changes)  # type: ignore[arg-type]


DENSE_7B = CostModel(
    name="dense-7b",
    params=7.61e9,  # Qwen2.5-7B model card: 7.61B parameters
    num_layers=28,  # Qwen2.5-7B config.json: 28 layers, 4 KV heads, head_dim 128, 28 q heads
    num_kv_heads=4,
    head_dim=128,
    q_dim=28 * 128,
)
"""Qwen2.5-7B-shaped dense model, bf16, one H200.

Derived: 15.2 GB weights, 57,344 KV bytes/token, ~1.9M KV tokens, a = 7.0 ms, so one request
decodes at ~140 tokens/s and a full batch of 256 at ~8-12k tokens/s. Cross-check: public vLLM
throughput runs of 7-9B dense models on one H100/H200 report several thousand output tokens/s
at high concurrency (e.g. the MI300X-vs-H200 report, dense 8B at concurrency 256).
"""

DENSE_32B = CostModel(
    name="dense-32b",
    params=32.5e9,  # Qwen2.5-32B model card: 32.5B parameters
    num_layers=64,  # Qwen2.5-32B config.json: 64 layers, 8 KV heads, head_dim 128, 40 q heads
    num_kv_heads=8,
    head_dim=128,
    q_dim=40 * 128,
)
"""Qwen2.5-32B-shaped dense model, bf16, one H200.

Derived: 65 GB weights, 262,144 KV bytes/token (256 KiB), ~219k KV tokens (so ~30 requests
of 7k tokens), a = 20 ms: one request decodes at ~45-50 tokens/s; a KV-full batch at
~0.7-1k tokens/s. Cross-check: gpustack's performance lab (Qwen3-32B, a model of the same
shape, vLLM on H100 at 3.35 TB/s) reports mean TPOT 43-88 ms per token at high concurrency,
consistent with this model's 35-60 ms per step at KV-full batches on the faster H200.

Prefill is compute-bound: 2 * 32.5e9 FLOP/token at 50% of 989 TFLOP/s is ~7.6k tokens/s (plus
the attention term, ~7% at a 6k context), inside the 5-15k tokens/s that vLLM chunked prefill
reaches for 30B-class dense models on one H100/H200. So a partial-rollout update, which makes
an engine re-prefill every in-flight context (KV-full: ~51 requests of ~4.3k tokens, 220k
tokens), stalls it ~30 s plus the 3.6 s weight load; with steps of 7-12 minutes at 64-128
engines that is 3-6% of a step, which is why partial rollout stays close to dora here.
"""

PRESETS: dict[str, CostModel] = {m.name: m for m in (DENSE_7B, DENSE_32B)}


def cost_preset(name: str) -> CostModel:
    """A cost preset by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"preset: unknown cost preset {name!r}; known: {sorted(PRESETS)}"
        ) from None
