"""Warm start: a tiny run writes a loadable HF directory, and the cache is reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.models import load_pretrained, load_tokenizer
from dora.models.generate import generate
from dora.training.warmstart import WarmstartConfig, read_result, warmstart

FAST = dict(
    steps=3,
    batch_tokens=256,
    row_tokens=128,
    warmup_steps=1,
    eval_prompts=4,
    group_prompts=1,
    group_size=2,
    model_overrides={"num_hidden_layers": 1},
    task_config={"max_terms": 4},
)


def test_warmstart_writes_and_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = WarmstartConfig(**FAST)  # type: ignore[arg-type]
    cache = tmp_path / "warmstart"
    directory = warmstart(config, cache_dir=cache, progress=False)
    assert directory == cache / config.key()
    result = read_result(directory)
    assert result["train"]["steps"] == 3
    curve = result["train"]["loss_curve"]  # one mean per 10 steps: 3 steps -> one point
    assert len(curve) == 1 and curve[0] == pytest.approx(result["train"]["final_loss"], abs=1e-4)
    assert 0.0 <= result["eval"]["accuracy"] <= 1.0 and result["eval"]["n"] == 4
    assert {"p50", "p90", "p99"} <= set(result["lengths"])
    model = load_pretrained(directory)
    tok = load_tokenizer(directory)
    assert model.config.num_hidden_layers == 1
    assert len(generate(model, tok, [tok.encode("Q: 1+2\nA:\n", add_bos=True)], 3)[0]) <= 3

    import dora.training.warmstart as ws

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached warm start must not train again")

    monkeypatch.setattr(ws, "train", no_training)
    assert warmstart(config, cache_dir=cache, progress=False) == directory
    out = tmp_path / "copy"
    assert warmstart(config, cache_dir=cache, out=out, progress=False) == out
    assert (out / "model.safetensors").is_file()
    monkeypatch.setenv("DORA_CACHE", str(tmp_path))
    assert warmstart(config, progress=False) == directory  # $DORA_CACHE/warmstart
    assert WarmstartConfig(**{**FAST, "steps": 4}).key() != config.key()  # type: ignore[arg-type]
