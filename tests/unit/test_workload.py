"""Workload presets: deterministic, and their statistics match what the docstrings claim."""

from __future__ import annotations

import numpy as np
import pytest

from dora.engines.sim.workload import AGENTIC, DAPO_16K, DAPO_32K, workload_preset


def _lengths(w, groups: int = 1000, size: int = 16) -> np.ndarray:
    return np.array([s.decode_tokens for g in range(groups) for s in w.group(0, g, size)])


def test_deterministic_per_seed() -> None:
    assert DAPO_16K.group(3, 7, 16) == DAPO_16K.group(3, 7, 16)
    assert DAPO_16K.group(3, 7, 16) != DAPO_16K.group(4, 7, 16)
    assert DAPO_16K.request(1, 2, 3) == DAPO_16K.request(1, 2, 3)


def test_dapo_16k_statistics() -> None:
    lengths = _lengths(DAPO_16K)
    assert np.median(lengths) == pytest.approx(3000, rel=0.1)
    assert lengths.mean() == pytest.approx(4500, rel=0.1)
    assert lengths.max() == 16384
    assert 0.02 < (lengths == 16384).mean() < 0.08  # a few percent truncated
    prompts = [DAPO_16K.group(0, g, 1)[0].prompt_len for g in range(500)]
    assert 100 <= np.mean(prompts) <= 300


def test_dapo_32k_has_a_longer_tail() -> None:
    a, b = _lengths(DAPO_16K, 400), _lengths(DAPO_32K, 400)
    assert b.max() > 16384 and b.max() <= 32768
    assert np.percentile(b, 99) > np.percentile(a, 99)


def test_samples_of_a_prompt_are_correlated() -> None:
    groups = [[s.decode_tokens for s in DAPO_16K.group(0, g, 16)] for g in range(300)]
    logs = np.log(np.array(groups, dtype=float))
    within = logs.var(axis=1).mean()
    total = logs.var()
    assert within < 0.8 * total  # the per-prompt effect explains part of the variance


def test_agentic_multi_turn() -> None:
    specs = [s for g in range(100) for s in AGENTIC.group(0, g, 4)]
    turns = [len(s.segments) for s in specs]
    assert min(turns) >= 1 and max(turns) <= 10 and np.mean(turns) > 3
    for s in specs:
        assert len(s.tool_tokens) == len(s.tool_latency) == len(s.segments) - 1
        assert all(0 <= lat <= 60 for lat in s.tool_latency)
        assert s.prompt_len + s.total_tokens <= 32768 + 3000


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="workload"):
        workload_preset("gsm9k")
