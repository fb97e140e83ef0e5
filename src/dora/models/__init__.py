"""Tiny Llama-format models and the character tokenizer (HF-compatible checkpoints).

Stable API (other packages rely on these signatures):

- ``build_model(preset="tiny", seed=0, device="cpu", **config_overrides) -> (LlamaModel,
  CharTokenizer)``: deterministic random init; presets ``tiny`` and ``small``.
- ``LlamaModel(config)``: ``forward(input_ids [B,T], attention_mask=None, position_ids=None,
  segment_ids=None) -> logits [B,T,V]`` (differentiable; padding or packing);
  ``forward_tokens(input_ids [N], positions [N], backend, logits_indices=None)`` is the
  engine's paged path. ``model.config`` is a ``ModelConfig``.
- ``save_pretrained(model, directory, tokenizer=None)`` / ``load_pretrained(directory,
  device="cpu", dtype=None) -> LlamaModel``: HF directory (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json) that transformers and vLLM load.
- ``CharTokenizer.build()``, ``load_tokenizer(directory) -> CharTokenizer``:
  ``encode(text, add_bos=False, add_eos=False) -> list[int]``, ``decode(ids,
  skip_special_tokens=True) -> str``, ``pad_token_id``/``bos_token_id``/``eos_token_id``,
  ``tool_start_id``/``tool_end_id``, ``vocab_size``.
- ``ModelConfig`` (``to_hf_dict``/``from_hf_dict``/``save``/``load``/``fingerprint``),
  ``preset_config(preset, vocab_size, **overrides)``.
- ``read_state_dict(directory)``, ``load_state_dict_into(model, state)``,
  ``hf_state_dict(model)``: weights by HF key name (the learner publishes these).
"""

from dora.models.checkpoint import (
    CheckpointError,
    build_model,
    hf_state_dict,
    init_weights,
    load_pretrained,
    load_state_dict_into,
    read_state_dict,
    resolve_dtype,
    save_pretrained,
)
from dora.models.config import PRESETS, ModelConfig, ModelConfigError, preset_config
from dora.models.layers import AttentionBackend
from dora.models.llama import LlamaModel
from dora.models.tokenizer import CharTokenizer, TokenizerError, load_tokenizer

__all__ = [
    "PRESETS",
    "AttentionBackend",
    "CharTokenizer",
    "CheckpointError",
    "LlamaModel",
    "ModelConfig",
    "ModelConfigError",
    "TokenizerError",
    "build_model",
    "hf_state_dict",
    "init_weights",
    "load_pretrained",
    "load_state_dict_into",
    "load_tokenizer",
    "preset_config",
    "read_state_dict",
    "resolve_dtype",
    "save_pretrained",
]
