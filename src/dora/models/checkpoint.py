"""Build, save and load models as Hugging Face checkpoint directories.

A directory holds ``config.json``, ``model.safetensors`` (HF key names) and the tokenizer
files, so transformers' ``AutoModelForCausalLM``/``AutoTokenizer`` and vLLM load it as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from dora.models.config import ModelConfig, ModelConfigError, preset_config
from dora.models.llama import LlamaModel
from dora.models.tokenizer import CharTokenizer

log = structlog.get_logger(__name__)

WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint directory or state dict that does not fit the model."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` (a torch.dtype passes through)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def init_weights(model: LlamaModel, seed: int) -> None:
    """Deterministic random init: the same seed gives the same weights on any device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                values = torch.ones(param.shape)
            elif name.endswith(".bias"):
                values = torch.zeros(param.shape)
            else:
                values = torch.randn(param.shape, generator=gen) * std
            param.copy_(values.to(param.dtype))


def build_model(
    preset: str = "tiny",
    seed: int = 0,
    device: str | torch.device = "cpu",
    **overrides: object,
) -> tuple[LlamaModel, CharTokenizer]:
    """A randomly initialised preset model (``tiny``/``small``) and the character tokenizer.

    ``overrides`` change config fields, e.g. ``num_hidden_layers=2`` for a faster test.
    """
    tokenizer = CharTokenizer.build()
    config = preset_config(
        preset,
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    model = LlamaModel(config)
    init_weights(model, seed)
    model.to(device=device, dtype=resolve_dtype(config.torch_dtype))
    model.eval()
    return model, tokenizer


def hf_state_dict(model: LlamaModel) -> dict[str, Tensor]:
    """Parameters under HF key names, tied head omitted (as transformers saves it)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_pretrained(
    model: LlamaModel, directory: Path, tokenizer: CharTokenizer | None = None
) -> Path:
    """Write config, weights (and tokenizer) as a HF checkpoint directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(torch_dtype=_dtype_name(model.dtype))
    config.save(directory)
    state = {k: v.cpu() for k, v in hf_state_dict(model).items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if config.pad_token_id is not None:
        gen["pad_token_id"] = config.pad_token_id
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory, model_max_length=config.max_position_embeddings)
    log.info("checkpoint_saved", path=str(directory), params=model.num_parameters())
    return directory


def read_state_dict(directory: Path) -> dict[str, Tensor]:
    """Tensors of ``model.safetensors`` (or a sharded index) in a directory."""
    directory = Path(directory)
    try:
        if (directory / WEIGHTS_FILE).is_file():
            return load_file(str(directory / WEIGHTS_FILE))
        if (directory / _INDEX_FILE).is_file():
            index = json.loads((directory / _INDEX_FILE).read_text())
            state: dict[str, Tensor] = {}
            for shard in sorted(set(index["weight_map"].values())):
                state.update(load_file(str(directory / shard)))
            return state
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read weights in {directory}: {exc}") from exc
    raise CheckpointError(f"no {WEIGHTS_FILE} in {directory}")


def load_state_dict_into(model: LlamaModel, state: Mapping[str, Tensor]) -> None:
    """Copy HF-named tensors into ``model`` in place; raise naming missing/unknown/bad keys."""
    own = model.state_dict()
    given = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if model.config.tie_word_embeddings:
        given.pop("lm_head.weight", None)
        own.pop("lm_head.weight", None)
    missing = sorted(set(own) - set(given))
    unknown = sorted(set(given) - set(own))
    if missing or unknown:
        raise CheckpointError(f"state dict mismatch: missing={missing[:5]} unknown={unknown[:5]}")
    with torch.no_grad():
        for key, target in own.items():
            value = given[key]
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{key}: shape {tuple(value.shape)} != expected {tuple(target.shape)}"
                )
            target.copy_(value.to(device=target.device, dtype=target.dtype))


def load_pretrained(
    directory: Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LlamaModel:
    """A model from a HF checkpoint directory (dtype defaults to the config's)."""
    directory = Path(directory)
    try:
        config = ModelConfig.load(directory)
    except ModelConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    supported = ("LlamaForCausalLM", "Qwen2ForCausalLM")
    if not set(config.architectures) & set(supported):
        raise CheckpointError(f"architectures {config.architectures} is not one of {supported}")
    target = resolve_dtype(dtype or config.torch_dtype)
    model = LlamaModel(config.replace(torch_dtype=_dtype_name(target)))
    model.to(device=device, dtype=target)
    load_state_dict_into(model, read_state_dict(directory))
    model.eval()
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise CheckpointError(f"unsupported dtype {dtype}")
