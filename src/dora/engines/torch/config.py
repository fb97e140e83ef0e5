"""Configuration of the built-in torch engine (one dataclass, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine replica.

    ``num_blocks`` KV blocks of ``block_size`` tokens are allocated once, in one tensor, when
    the engine starts; ``max_num_batched_tokens`` caps the tokens of one forward (prefill is
    chunked under it); ``max_num_seqs`` caps the running set (continuous batching).
    """

    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    ignore_eos: bool = False  # benchmarks force lengths with max_tokens
    device: str = "cpu"
    dtype: str | None = None  # None: the model's dtype
    decode_bucket_waste: float = 0.5  # extra padded KV allowed per decode attention bucket
    # decode attention in the compiled CPU paged kernel (fp32) when it builds; else torch
    paged_kernel: bool = True
    # inference forward on fused q|k|v and gate|up weights with compiled row-wise ops
    # (``fast_forward``; fp32 CPU when they build), else the model's own forward_tokens
    fast_forward: bool = True
    # matmuls of the fast forward: "torch" (F.linear), "mkldnn" (weights prepacked for oneDNN
    # at every weight load), "avx2" (weights packed for the engine's own AVX2/FMA kernel) or
    # "auto" (the first of avx2, mkldnn that runs here and matches F.linear)
    linear: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be > 0, got {self.max_model_len}")
        if self.linear not in ("auto", "torch", "mkldnn", "avx2"):
            raise ValueError(
                "EngineConfig.linear must be 'auto', 'torch', 'mkldnn' or 'avx2', "
                f"got {self.linear!r}"
            )
        if self.decode_bucket_waste < 0:
            raise ValueError("EngineConfig.decode_bucket_waste must be >= 0")
