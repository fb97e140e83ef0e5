"""dora.models: HF-format checkpoints, parity with transformers, learner forward semantics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dora.models import (
    CheckpointError,
    ModelConfig,
    ModelConfigError,
    build_model,
    load_pretrained,
    save_pretrained,
)

transformers = pytest.importorskip("transformers")


def _randomize_biases(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True},
        {"attention_bias": True, "model_type": "qwen2"},
        {"tie_word_embeddings": True},
    ],
    ids=["llama", "llama-bias", "qwen2-bias", "tied"],
)
def test_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    model, tok = build_model(
        "tiny", seed=3, num_hidden_layers=2, initializer_range=0.1, **overrides
    )
    _randomize_biases(model)
    save_pretrained(model, tmp_path, tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("Hello, world! 12+34=46\n", add_bos=True)] * 2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        assert (ours - theirs).abs().max().item() < 1e-4
        ours_m = model(ids, attention_mask=mask)
        theirs_m = hf(ids, attention_mask=mask).logits
        assert (ours_m - theirs_m)[mask.bool()].abs().max().item() < 1e-4


def test_save_load_roundtrip_and_hf_files(tmp_path: Path) -> None:
    model, tok = build_model("tiny", seed=0, num_hidden_layers=1)
    save_pretrained(model, tmp_path, tok)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).is_file()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert ModelConfig.from_hf_dict(cfg) == model.config
    loaded = load_pretrained(tmp_path)
    for (k1, v1), (k2, v2) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k1 == k2 and torch.equal(v1, v2)
    keys = set(model.state_dict())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"} <= keys
    assert {"model.norm.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight"} <= keys


def test_build_model_is_deterministic() -> None:
    a, _ = build_model("tiny", seed=7, num_hidden_layers=1)
    b, _ = build_model("tiny", seed=7, num_hidden_layers=1)
    c, _ = build_model("tiny", seed=8, num_hidden_layers=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_presets_have_documented_shapes() -> None:
    tiny, _ = build_model("tiny", num_hidden_layers=1)
    cfg = tiny.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 4, 2)
    assert cfg.head_dim == 64 and cfg.max_position_embeddings >= 4096
    from dora.models import preset_config

    small = preset_config("small", vocab_size=103)
    assert small.hidden_size == 768 and small.num_hidden_layers == 12
    with pytest.raises(ModelConfigError, match="unknown preset"):
        preset_config("huge", vocab_size=103)


def test_padding_and_packing_match_separate_sequences() -> None:
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    a = tok.encode("abc+12=", add_bos=True)
    b = tok.encode("xy", add_bos=True)
    with torch.no_grad():
        la = model(torch.tensor([a]))[0]
        lb = model(torch.tensor([b]))[0]
        # right padding
        padded = torch.tensor([a, b + [tok.pad_token_id] * (len(a) - len(b))])
        mask = (torch.arange(len(a))[None] < torch.tensor([[len(a)], [len(b)]])).long()
        out = model(padded, attention_mask=mask)
        assert torch.allclose(out[0], la, atol=1e-5)
        assert torch.allclose(out[1, : len(b)], lb, atol=1e-5)
        # left padding (the causal kernel alone would let b see the padding before it)
        pad = len(a) - len(b)
        left = torch.tensor([a, [tok.pad_token_id] * pad + b])
        out = model(left, attention_mask=torch.stack([mask[0], mask[1].flip(0)]))
        assert torch.allclose(out[0], la, atol=1e-5)
        assert torch.allclose(out[1, pad:], lb, atol=1e-5)
        # packing two sequences in one row
        packed = torch.tensor([a + b])
        seg = torch.tensor([[0] * len(a) + [1] * len(b)])
        out = model(packed, segment_ids=seg)[0]
        assert torch.allclose(out[: len(a)], la, atol=1e-5)
        assert torch.allclose(out[len(a) :], lb, atol=1e-5)


def test_forward_is_differentiable() -> None:
    model, tok = build_model("tiny", seed=1, num_hidden_layers=1)
    ids = torch.tensor([tok.encode("hello", add_bos=True)])
    loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_pretrained(tmp_path)
    model, tok = build_model("tiny", seed=0, num_hidden_layers=1)
    save_pretrained(model, tmp_path, tok)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing"):
        load_pretrained(tmp_path)
    cfg["num_hidden_layers"] = 1
    cfg["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match="multiple"):
        ModelConfig(vocab_size=10, num_attention_heads=3, num_key_value_heads=2)


def test_position_beyond_context_is_refused() -> None:
    model, _ = build_model("tiny", seed=0, num_hidden_layers=1, max_position_embeddings=8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))
