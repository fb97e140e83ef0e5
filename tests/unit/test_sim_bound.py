"""The ideal step each mode is compared with: sync pays generation then training; a streaming
mode overlaps them and may spread the longest trajectory over K+1 steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dora.sim.config import SimConfig
from dora.sim.metrics import StepRecord, ideal_step_time, step_bounds


def record(tokens: int, longest: int) -> StepRecord:
    return StepRecord(
        step=0,
        train_start=0.0,
        train_end=1.0,
        groups=1,
        completion_tokens=tokens,
        prompt_tokens=0,
        rollout_s=0.0,
        wait_s=0.0,
        longest_tokens=longest,
        longest_prompt=100,
    )


@pytest.mark.parametrize("k", [1, 2])
def test_streaming_modes_get_the_k_plus_one_bound_and_sync_pays_both(k: int) -> None:
    fleet = SimpleNamespace(stats=SimpleNamespace(mean_context=2000.0))
    records = [record(2_000_000, 16_000), record(1_000_000, 4_000)]
    train = [120.0, 80.0]
    bounds = []
    for mode in ("sync", "dora", "partial"):
        cfg = SimConfig(engines=64, mode=mode, staleness=k)
        bounds.append(ideal_step_time(cfg, fleet, records, train))  # type: ignore[arg-type]
    sync, dora, partial = bounds
    cfg = SimConfig(engines=64, staleness=k)
    expected_sync, expected_stream = [], []
    for r, t in zip(records, train, strict=True):
        work, alone = step_bounds(cfg, fleet, r)  # type: ignore[arg-type]
        expected_sync.append(max(work, alone) + t)
        expected_stream.append(max(work, t, (alone + t) / (k + 1)))
    assert sync == pytest.approx(sum(expected_sync) / 2)
    assert dora == partial == pytest.approx(sum(expected_stream) / 2)
    assert dora < sync  # overlapping is what a streaming mode can gain
