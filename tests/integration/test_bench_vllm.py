"""vLLM side of ``dora bench engine``: our HF checkpoint loads in vLLM and lengths are honoured.

The vLLM case needs the ``vllm`` extra (a separate venv, see ``dora.bench.engine_vllm``) and
takes about a minute (vLLM's start); the settings case runs everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dora.bench.engine_vllm import _vllm_env


def test_vllm_env_sizes_kv_cache_and_keeps_caller_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 256,
        "num_hidden_layers": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = _vllm_env(tmp_path, [[1] * 32], [2016], threads=1)
    # 4 KiB/token x 64 seqs x 2048 tokens x 1.25 = 0.625 GiB -> 1 GiB
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert "VLLM_CPU_KVCACHE_SPACE" not in _vllm_env(tmp_path, [[1]], [1], threads=1)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_generates_requested_lengths_on_tiny_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from dora.bench.engine_vllm import generate_vllm
    from dora.models import build_model, save_pretrained

    model, tokenizer = build_model("tiny", seed=0)
    save_pretrained(model, tmp_path / "tiny", tokenizer)
    prompts = [[7 + i] * (8 + i) for i in range(4)]
    lengths = [1, 5, 17, 40]
    run = generate_vllm(tmp_path / "tiny", prompts, lengths, threads=1)
    assert run.output_lengths == lengths
    assert run.seconds > 0
