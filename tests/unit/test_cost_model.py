"""Cost model: units from model shapes, monotone step times, a case worked by hand."""

from __future__ import annotations

import pytest

from dora.engines.sim.cost import DENSE_7B, DENSE_32B, H200_HBM_BW, cost_preset


def test_kv_bytes_per_token_from_shapes() -> None:
    assert DENSE_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144
    assert DENSE_7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344


def test_weights_and_capacity() -> None:
    assert DENSE_32B.weight_bytes == pytest.approx(65e9)
    # 141 GB * 0.9 - 65 GB weights - 4 GB reserve, in 256 KiB tokens
    assert DENSE_32B.kv_capacity_tokens == int((141e9 * 0.9 - 65e9 - 4e9) // 262_144)
    assert DENSE_7B.kv_capacity_tokens > 8 * DENSE_32B.kv_capacity_tokens


def test_decode_step_grows_with_batch_and_context() -> None:
    c = DENSE_32B
    assert c.step_time(2, 1000) > c.step_time(1, 1000)
    assert c.step_time(1, 2000) > c.step_time(1, 1000)
    assert c.step_time(0, 1000) == 0.0


def test_decode_step_by_hand() -> None:
    c = DENSE_32B
    bw = H200_HBM_BW * 0.8
    # batch 10, 50k KV tokens: overhead + weights/bw + 10 * 2P/(peak*mfu) + 50k * 256KiB/bw
    want = 0.003 + 65e9 / bw + 10 * 2 * 32.5e9 / (989.4e12 * 0.5) + 50_000 * 262_144 / bw
    assert c.step_time(10, 50_000) == pytest.approx(want)
    assert 0.02 < want < 0.04  # ~25 ms: memory-bound decode of a 32B model on one H200


def test_steps_time_is_the_sum_of_steps_and_inverts() -> None:
    c = DENSE_7B
    n, ctx, k = 7, 12_345, 500
    by_step = sum(c.step_time(n, ctx + n * i) for i in range(k))
    assert c.steps_time(k, n, ctx) == pytest.approx(by_step)
    dt = c.steps_time(k, n, ctx)
    assert c.steps_within(dt, n, ctx) == k
    assert c.steps_within(dt * 0.999, n, ctx) == k - 1


def test_prefill_migration_and_load() -> None:
    c = DENSE_32B
    assert c.prefill_time(2000) > 2 * c.prefill_time(1000) * 0.99  # attention term grows
    assert c.prefill_time(1000, start=5000) > c.prefill_time(1000)
    # moving 10k tokens of KV (2.6 GB) over 25 GB/s is much cheaper than re-prefilling them
    assert c.migration_time(10_000) == pytest.approx(0.005 + 10_000 * 262_144 / 25e9)
    assert c.migration_time(10_000) * 5 < c.prefill_time(10_000)
    assert c.weight_load_time == pytest.approx(1.0 + 65e9 / 25e9)


def test_unknown_preset_names_the_field() -> None:
    with pytest.raises(ValueError, match="preset"):
        cost_preset("dense-1t")
    assert cost_preset("dense-7b") is DENSE_7B


def test_prefill_rate_and_partial_rollout_reprefill_volume() -> None:
    """32B prefill on one H200 is compute-bound: 2 * 32.5e9 FLOP/token at 50% of 989 TFLOP/s
    is ~7.6k tokens/s (the 5-15k range of published vLLM prefill rates); re-prefilling a
    KV-full engine after a partial-rollout update (~51 requests of the workload's mean 4.3k
    context) costs ~30 s of that engine's time, plus the weight load."""
    c = DENSE_32B
    rate = 1.0 / c.prefill_time(1)
    assert rate == pytest.approx(989.4e12 * 0.5 / (2 * 32.5e9), rel=1e-3)  # + attention
    assert 5_000 < rate < 15_000
    n = c.kv_capacity_tokens // 4325
    assert 45 <= n <= 55
    stall = n * c.prefill_time(4325)
    assert 25.0 < stall < 35.0  # seconds per engine per update
    assert c.weight_load_time == pytest.approx(3.6)
