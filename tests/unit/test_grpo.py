"""GRPO loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from dora.learner.grpo import (
    GRPOConfig,
    aggregate,
    all_equal,
    group_advantages,
    grpo_loss,
    loss_denominator,
)

PPO = GRPOConfig(ratio_against="behaviour", is_correction="none")


def lp(values: list[list[float]], grad: bool = True) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


# --------------------------------------------------------------------------- advantages


def test_advantages_scaled_by_unbiased_std() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    assert group_advantages(torch.tensor([1.0, 2.0, 3.0])).tolist() == pytest.approx(
        [-1.0, 0.0, 1.0], rel=1e-5
    )


def test_advantages_without_std_dr_grpo() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), scale_by_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(torch.tensor([3.0]), scale_by_std=True).tolist() == [0.0]


def test_all_equal_detects_groups_without_signal() -> None:
    assert all_equal(torch.tensor([1.0, 1.0, 1.0]))
    assert not all_equal(torch.tensor([1.0, 0.0, 1.0]))


# --------------------------------------------------------------------------- clipping


@pytest.mark.parametrize(
    ("adv", "ratio", "loss", "grad_zero", "low", "high"),
    [
        (1.0, 1.5, -1.28, True, 0.0, 1.0),  # A>0, ratio above 1+eps_high: clipped
        (1.0, 0.5, -0.5, False, 0.0, 0.0),  # A>0, ratio below 1-eps_low: not clipped
        (-1.0, 0.5, 0.8, True, 1.0, 0.0),  # A<0, ratio below 1-eps_low: clipped
        (-1.0, 1.5, 1.5, False, 0.0, 0.0),  # A<0, ratio above 1+eps_high: not clipped
        (1.0, 1.1, -1.1, False, 0.0, 0.0),  # inside the trust region
    ],
)
def test_clip_higher_both_sides(
    adv: float, ratio: float, loss: float, grad_zero: bool, low: float, high: float
) -> None:
    behaviour = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = lp([[-1.0 + math.log(ratio)]])
    out, m = grpo_loss(logp, behaviour, torch.tensor([adv]), torch.ones(1, 1), PPO)
    out.backward()
    assert out.item() == pytest.approx(loss, rel=1e-6)
    assert logp.grad is not None
    if grad_zero:
        assert float(logp.grad) == 0.0
    else:  # d(-ratio * A)/dlogp = -ratio * A
        assert float(logp.grad) == pytest.approx(-ratio * adv, rel=1e-6)
    assert m["clip/frac_low"] == low
    assert m["clip/frac_high"] == high


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    cfg = GRPOConfig(ratio_against="behaviour", is_correction="none", dual_clip=3.0)
    behaviour = torch.zeros(1, 1, dtype=torch.float64)
    out, _ = grpo_loss(
        lp([[math.log(5.0)]]), behaviour, torch.tensor([-1.0]), torch.ones(1, 1), cfg
    )
    assert out.item() == pytest.approx(3.0)


# --------------------------------------------------------------------------- aggregation


def test_token_mean_vs_sequence_mean() -> None:
    # seq 0: one token with A=+1 -> -1; seq 1: three tokens with A=-1 -> +1 each (ratio 1)
    logp = lp([[-1.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    behaviour = logp.detach().clone()
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    token_mean, _ = grpo_loss(logp, behaviour, adv, mask, PPO)
    assert token_mean.item() == pytest.approx((-1 + 3) / 4)
    seq = GRPOConfig(
        ratio_against="behaviour", is_correction="none", aggregation="seq-mean-token-mean"
    )
    seq_mean, _ = grpo_loss(logp, behaviour, adv, mask, seq)
    assert seq_mean.item() == pytest.approx((-1 + 1) / 2)
    norm = GRPOConfig(
        ratio_against="behaviour",
        is_correction="none",
        aggregation="seq-mean-token-sum-norm",
        norm_length=4,
    )
    summed, _ = grpo_loss(logp, behaviour, adv, mask, norm)
    assert summed.item() == pytest.approx((-1 + 3) / (2 * 4))


def test_microbatch_shares_sum_to_full_batch_loss() -> None:
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    for agg in ("token-mean", "seq-mean-token-mean"):
        denom = loss_denominator(mask, agg)
        full = aggregate(per_token, mask, agg, denom)
        parts = sum(aggregate(per_token[i : i + 1], mask[i : i + 1], agg, denom) for i in range(2))
        assert float(parts) == pytest.approx(float(full))
    assert float(
        aggregate(per_token, mask, "token-mean", loss_denominator(mask, "token-mean"))
    ) == (pytest.approx(15 / 5))


def test_loss_mask_excludes_tool_tokens() -> None:
    behaviour = torch.zeros(1, 3, dtype=torch.float64)
    logp = lp([[0.0, 5.0, 0.0]])  # the middle (tool) token has a wild ratio
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    out, m = grpo_loss(logp, behaviour, torch.tensor([1.0]), mask, PPO)
    out.backward()
    assert out.item() == pytest.approx(-1.0)
    assert logp.grad is not None and float(logp.grad[0, 1]) == 0.0
    assert m["tokens"] == 2.0
    assert m["clip/frac_high"] == 0.0


# --------------------------------------------------------------------------- off-policy


def test_truncated_importance_weights() -> None:
    behaviour = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    logp = lp([[-2.0 + math.log(3.0), -2.0 + math.log(0.5)]])  # weights 3 (-> cap 2) and 0.5
    cfg = GRPOConfig(is_correction="truncate", is_cap=2.0)
    out, m = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), cfg)
    out.backward()
    # ratio vs proximal (the model itself) is 1: per-token loss = -w * A
    assert out.item() == pytest.approx((-2.0 - 0.5) / 2)
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])
    assert m["is/mean"] == pytest.approx((3.0 + 0.5) / 2)
    assert m["is/truncated_frac"] == 0.5
    assert m["is/max"] == pytest.approx(3.0)


def test_masked_importance_weights_drop_tokens_above_cap() -> None:
    behaviour = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    logp = lp([[-2.0 + math.log(3.0), -2.0 + math.log(0.5)]])
    cfg = GRPOConfig(is_correction="mask", is_cap=2.0)
    out, m = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), cfg)
    assert out.item() == pytest.approx((0.0 - 0.5) / 2)
    assert m["is/masked_frac"] == 0.5


def test_decoupled_ratio_uses_given_proximal_policy() -> None:
    behaviour = torch.tensor([[-1.0]], dtype=torch.float64)
    proximal = torch.tensor([[-1.0 + math.log(1.5)]], dtype=torch.float64)  # weight 1.5
    logp = lp([[-1.0 + math.log(1.5 * 1.5)]])  # ratio vs proximal 1.5 -> clipped at 1.28
    cfg = GRPOConfig(is_correction="truncate", is_cap=2.0)
    out, m = grpo_loss(
        logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1), cfg, proximal_logprobs=proximal
    )
    assert out.item() == pytest.approx(-1.28 * 1.5)
    assert m["clip/frac_high"] == 1.0


def test_k3_kl_to_reference() -> None:
    logp = lp([[-1.0]])
    ref = torch.tensor([[-1.0 + math.log(2.0)]], dtype=torch.float64)
    cfg = GRPOConfig(kl_coef=0.5)
    out, m = grpo_loss(
        logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), cfg, ref_logprobs=ref
    )
    k3 = 2.0 - math.log(2.0) - 1.0
    assert m["loss/kl"] == pytest.approx(k3)
    assert out.item() == pytest.approx(0.5 * k3)


def test_config_rejects_contradictions() -> None:
    with pytest.raises(ValueError, match="is_correction"):
        GRPOConfig(ratio_against="behaviour", is_correction="truncate")
    with pytest.raises(ValueError, match="eps_low"):
        GRPOConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(lp([[0.0]]), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 2), PPO)
