"""Configuration of a vLLM engine replica (``generator.engine`` when ``engine_kind: vllm``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KIND = "vllm"
"""``EngineStatus.engine_kind`` of these engines: requests migrate only within a kind."""


@dataclass(frozen=True)
class VllmEngineConfig:
    """Knobs of one vLLM replica; ``engine_args`` passes any other ``vllm.EngineArgs`` field.

    ``kv_cache_gib`` sizes the KV cache per replica (``kv_cache_memory_bytes``), so several
    replicas share a machine predictably. ``block_size`` None takes vLLM's platform default
    (the CPU backend needs a multiple of 32).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int | None = None
    kv_cache_gib: float = 1.0
    dtype: str = "float32"
    enable_prefix_caching: bool = True
    enforce_eager: bool = True  # no torch.compile / CUDA graphs: fast start, small models
    ignore_eos: bool = False  # benchmarks force lengths with max_tokens
    # the dora KV connector (migration with the KV); False: a migrated request is re-prefilled
    # on its target, and its trajectory counts those tokens (a vLLM build without connectors)
    kv_connector: bool = True
    export_timeout_s: float = 60.0  # how long an export waits for the worker to gather
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"VllmEngineConfig.{name} must be a positive int, got {value!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"VllmEngineConfig.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"VllmEngineConfig.block_size must be > 0, got {self.block_size}")
