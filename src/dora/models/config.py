"""Model configuration that round-trips Hugging Face ``config.json`` (LlamaConfig field names).

One dataclass describes every model dora builds: the same fields load in transformers
(``LlamaForCausalLM``) and vLLM, so a checkpoint written here is a normal HF directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"

_DTYPES = ("float32", "bfloat16", "float16")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class ModelConfigError(ValueError):
    """A config.json or preset that dora cannot build a model from."""


@dataclass(frozen=True)
class ModelConfig:
    """Llama-architecture hyper-parameters; field names are LlamaConfig's."""

    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0
    torch_dtype: str = "float32"
    initializer_range: float = 0.02
    model_type: str = "llama"
    architectures: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.architectures and self.model_type in _ARCHITECTURES:
            object.__setattr__(self, "architectures", (_ARCHITECTURES[self.model_type],))
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.torch_dtype not in _DTYPES:
            raise ModelConfigError(f"torch_dtype must be one of {_DTYPES}, got {self.torch_dtype}")
        if self.model_type not in _ARCHITECTURES:
            raise ModelConfigError(f"unsupported model_type {self.model_type!r}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ModelConfigError("qwen2 models always have q/k/v bias (attention_bias=True)")

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF json

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content; written for both transformers 4.x and 5.x readers."""
        out: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["hidden_act"] = "silu"
        out["mlp_bias"] = False
        out["attention_dropout"] = 0.0
        out["rope_scaling"] = None
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        out["dtype"] = self.torch_dtype
        out["use_cache"] = True
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Parse a HF ``config.json`` dict; refuse architectures this model does not implement."""
        data = dict(data)
        act = data.pop("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
        if data.pop("mlp_bias", False):
            raise ModelConfigError("mlp_bias=True is not supported")
        rope_params = data.pop("rope_parameters", None) or {}
        scaling = data.pop("rope_scaling", None)
        rope_type = rope_params.get("rope_type", "default")
        if scaling or rope_type != "default":
            raise ModelConfigError(f"rope scaling {scaling or rope_params} is not supported")
        if "rope_theta" not in data and "rope_theta" in rope_params:
            data["rope_theta"] = rope_params["rope_theta"]
        dtype = data.pop("dtype", None)
        if "torch_dtype" not in data and dtype is not None:
            data["torch_dtype"] = dtype
        if data.get("model_type") == "qwen2":
            data["attention_bias"] = True
        if "head_dim" not in data and "hidden_size" in data and "num_attention_heads" in data:
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if isinstance(data.get(key), list):
                data[key] = data[key][0] if data[key] else None
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in names}
        if "vocab_size" not in kwargs:
            raise ModelConfigError("config.json has no vocab_size")
        if "architectures" in kwargs:
            kwargs["architectures"] = tuple(kwargs["architectures"] or ())
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**kwargs, extra=extra)

    def save(self, directory: Path) -> Path:
        """Write ``config.json`` into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CONFIG_FILE
        path.write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory."""
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise ModelConfigError(f"no {CONFIG_FILE} in {directory}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(data)

    def fingerprint(self) -> str:
        """Stable hash of the architecture (what must match for a KV cache to be valid)."""
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "tie_word_embeddings",
            "attention_bias",
            "model_type",
        )
        canon = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}


def preset_config(preset: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The config of a named preset (``tiny``/``small``) for a tokenizer's vocab size."""
    if preset not in PRESETS:
        raise ModelConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(vocab_size=vocab_size, **{**PRESETS[preset], **overrides})
