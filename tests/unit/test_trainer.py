"""The optimisation step on the tiny model (2 layers, CPU, seconds)."""

from __future__ import annotations

import math

import pytest
import torch

from dora.learner.batching import Group, GroupBuffer
from dora.learner.grpo import GRPOConfig
from dora.learner.synthetic import behaviour_logprobs, make_scored, score_completions
from dora.learner.trainer import OptimConfig, Trainer, lr_factor
from dora.models import build_model


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def tiny(seed: int = 0):
    return build_model(
        "tiny", seed=seed, num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )


def as_groups(samples_by_group: list[list]) -> list[Group]:
    buf = GroupBuffer(staleness_bound=10)
    for samples in samples_by_group:
        for s in samples:
            buf.add(s, step=0)
    return list(buf.ready.values())


def prob_of(model, prompt: list[int], token: int) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    return float(torch.softmax(logits.float(), -1)[token])


def test_rewarded_first_token_becomes_more_likely() -> None:
    model, tok = tiny()
    prompt = tok.encode("q:", add_bos=True)
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    tail = tok.encode("xy")
    trainer = Trainer(model, GRPOConfig(), OptimConfig(lr=3e-3))
    before = prob_of(model, prompt, a)
    for step in range(4):
        completions = [[a, *tail], [b, *tail]] * 2
        rewards = [1.0, 0.0] * 2
        group = score_completions(
            model, group_id=f"g{step}", prompt_ids=prompt, completions=completions, rewards=rewards
        )
        metrics = trainer.step(as_groups([group]), step=step)
        assert metrics["groups/skipped_all_equal"] == 0.0
        assert metrics["is/mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy data
    after = prob_of(model, prompt, a)
    assert after > 2 * before
    assert prob_of(model, prompt, b) < prob_of(model, prompt, a)


STEP_KEYS = (
    "reward/mean",
    "reward/correct_frac",
    "loss/pg",
    "grad/norm",
    "staleness/mean",
    "staleness/max",
    "lengths/mean",
    "throughput/tokens_per_s",
    "entropy/mean",
    "clip/frac_low",
    "clip/frac_high",
    "is/mean",
    "is/truncated_frac",
    "lr",
)


def test_step_metrics() -> None:
    model, tok = tiny()
    prompt = tok.encode("q:", add_bos=True)
    groups = [
        make_scored(
            group_id="g",
            group_index=i,
            group_size=2,
            version=1,
            reward=float(i),
            prompt_ids=prompt,
            completion_ids=[5 + i] * (i + 2),
        )
        for i in range(2)
    ]
    flat = [make_scored(group_id="f", group_index=i, group_size=2, reward=1.0) for i in range(2)]
    trainer = Trainer(model)
    m = trainer.step(as_groups([groups, flat]), step=3)
    for key in STEP_KEYS:
        assert key in m and math.isfinite(m[key]), key
    assert m["groups/skipped_all_equal"] == 1.0
    assert m["groups/trained"] == 1.0
    assert m["reward/mean"] == pytest.approx(0.75)
    assert m["reward/correct_frac"] == pytest.approx(0.75)
    assert m["staleness/max"] == 3.0  # version 0 group at step 3
    assert m["staleness/mean"] == pytest.approx(2.5)
    assert m["lengths/mean"] == pytest.approx((2 + 3 + 2 + 2) / 4)


def test_all_groups_equal_skips_the_update_but_counts() -> None:
    model, _ = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    flat = [make_scored(group_id="f", group_index=i, group_size=2, reward=0.0) for i in range(2)]
    m = Trainer(model, optim=OptimConfig(lr=1e-2)).step(as_groups([flat]))
    assert m["groups/skipped_all_equal"] == 1.0
    assert all(torch.equal(x, y) for x, y in zip(before, model.parameters(), strict=True))


def test_gradient_accumulation_matches_one_microbatch() -> None:
    results = []
    for budget in (10_000, 6):  # one micro-batch vs one row per micro-batch
        model, tok = tiny(seed=3)
        prompt = tok.encode("ab", add_bos=True)
        comps = [[7], [8, 9, 10], [11, 12], [13]]
        group = score_completions(
            model, group_id="g", prompt_ids=prompt, completions=comps, rewards=[1, 0, 0.5, 0]
        )
        trainer = Trainer(model, optim=OptimConfig(lr=1e-2, max_tokens_per_microbatch=budget))
        grads: list[torch.Tensor] = []

        def record(opt: torch.optim.Optimizer, *_: object, grads: list = grads) -> None:
            grads.extend(p.grad.clone() for g in opt.param_groups for p in g["params"])

        trainer.optimizer.register_step_pre_hook(record)
        m = trainer.step(as_groups([group]))
        results.append((m, grads))
    (m1, g1), (m2, g2) = results
    assert m1["loss/pg"] == pytest.approx(m2["loss/pg"], abs=1e-6)
    assert m1["grad/norm"] == pytest.approx(m2["grad/norm"], rel=1e-4)
    assert len(g1) == len(g2) > 0
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-4) for x, y in zip(g1, g2, strict=True))


def test_behaviour_logprobs_match_learner_logprobs_with_padding() -> None:
    model, tok = tiny()
    prompt = tok.encode("hi", add_bos=True)
    comps = [[5, 6, 7], [8]]
    group = score_completions(
        model, group_id="g", prompt_ids=prompt, completions=comps, rewards=[1.0, 0.0]
    )
    m = Trainer(model).step(as_groups([group]))
    assert m["is/mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert behaviour_logprobs(model, prompt, [8])[0] < 0


def test_lr_schedules() -> None:
    const = OptimConfig(schedule="constant", warmup_steps=5)
    assert lr_factor(const, 0) == 1.0
    warm = OptimConfig(schedule="warmup", warmup_steps=4)
    assert [lr_factor(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert lr_factor(cos, 0) == 0.5
    assert lr_factor(cos, 2) == pytest.approx(1.0)
    assert lr_factor(cos, 4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(cos, 6) == pytest.approx(0.1)
    assert lr_factor(cos, 100) == pytest.approx(0.1)


def test_kl_needs_a_reference_model() -> None:
    model, _ = tiny()
    with pytest.raises(ValueError, match="ref_model"):
        Trainer(model, GRPOConfig(kl_coef=0.1))
    ref, _ = tiny()
    trainer = Trainer(model, GRPOConfig(kl_coef=0.1), ref_model=ref)
    group = [make_scored(group_id="g", group_index=i, group_size=2, reward=i) for i in range(2)]
    m = trainer.step(as_groups([group]))
    assert m["loss/kl"] == pytest.approx(0.0, abs=1e-9)  # same weights before the step


def _cut_off(scored):
    """The same sample, stopped by the length limit instead of a stop token."""
    trajectory = scored.trajectory.model_copy(update={"finish_reason": "length"})
    return scored.model_copy(update={"trajectory": trajectory})


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_overlong_filtering_masks_cut_off_responses(mask_truncated: bool) -> None:
    model, tok = tiny()
    prompt = tok.encode("q:", add_bos=True)
    before = [p.detach().clone() for p in model.parameters()]
    completions = [tok.encode("ab"), tok.encode("ba")]
    group = score_completions(
        model, group_id="g", prompt_ids=prompt, completions=completions, rewards=[1.0, 0.0]
    )
    trainer = Trainer(model, GRPOConfig(mask_truncated=mask_truncated), OptimConfig(lr=1e-2))
    m = trainer.step(as_groups([[_cut_off(s) for s in group]]))
    unchanged = all(torch.equal(x, y) for x, y in zip(before, model.parameters(), strict=True))
    assert m["groups/trained"] == 1.0  # the group still has its advantages ...
    assert m["samples/masked_truncated"] == (2.0 if mask_truncated else 0.0)
    assert unchanged == mask_truncated  # ... but cut-off samples add no loss when filtered


def _errored(scored):
    """The same sample from an episode whose environment failed twice."""
    trajectory = scored.trajectory.model_copy(
        update={"error": "environment lost", "loss_mask": (0,) * len(scored.trajectory.loss_mask)}
    )
    return scored.model_copy(update={"trajectory": trajectory, "reward": 0.0})


def test_errored_members_leave_the_group_baseline_and_the_loss() -> None:
    """A group [1, 0, errored]: trained exactly as the group [1, 0]; all errored: skipped."""
    results = []
    for with_error in (False, True):
        model, tok = tiny()
        prompt = tok.encode("q:", add_bos=True)
        completions = [tok.encode("ab"), tok.encode("ba"), tok.encode("bb")]
        n = 3 if with_error else 2
        group = score_completions(
            model,
            group_id="g",
            prompt_ids=prompt,
            completions=completions[:n],
            rewards=[1, 0, 0][:n],
        )
        if with_error:
            group[2] = _errored(group[2])
        trainer = Trainer(model, GRPOConfig(), OptimConfig(lr=1e-2))
        m = trainer.step(as_groups([group]))
        results.append(([p.detach().clone() for p in model.parameters()], m))
    (plain, m_plain), (mixed, m_mixed) = results
    assert all(torch.equal(x, y) for x, y in zip(plain, mixed, strict=True))
    assert m_mixed["samples/errored"] == 1.0 and m_plain["samples/errored"] == 0.0
    model, tok = tiny()
    group = score_completions(
        model, group_id="g", prompt_ids=tok.encode("q:"), completions=[[5], [6]], rewards=[1, 0]
    )
    m = Trainer(model, GRPOConfig()).step(as_groups([[_errored(s) for s in group]]))
    assert m["samples/errored"] == 2.0 and m["groups/skipped_all_equal"] == 1.0


def test_environment_tokens_add_nothing_to_the_loss_or_its_gradient() -> None:
    """Tokens the environment wrote (mask 0) are context, never targets: what they say after
    the model's last turn changes neither the loss nor its gradient (the same Adam update
    from the same start means the same gradient)."""
    grads, losses = [], []
    for reply in ("<r>42</r>", "<r>no</r>"):
        model, tok = tiny()
        prompt = tok.encode("q:", add_bos=True)
        sampled, written = tok.encode("ab"), tok.encode(reply)
        group = []
        for i, reward in enumerate((1.0, 0.0)):
            completion = [*sampled, *written] if i == 0 else tok.encode("ba")
            mask = [1] * len(sampled) + [0] * len(written) if i == 0 else None
            group.append(
                make_scored(
                    group_id="g",
                    group_index=i,
                    group_size=2,
                    reward=reward,
                    prompt_ids=prompt,
                    completion_ids=completion,
                    logprobs=behaviour_logprobs(model, prompt, completion),
                    loss_mask=mask,
                )
            )
        trainer = Trainer(model, GRPOConfig(kl_coef=0.0), OptimConfig(lr=1e-3))
        m = trainer.step(as_groups([group]))
        losses.append(m["loss/total"] if "loss/total" in m else m["loss/pg"])
        grads.append([p.detach().clone() for p in model.parameters()])  # after the update
    assert losses[0] == losses[1]
    initial = [p.detach() for p in tiny()[0].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(initial, grads[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))  # the same update
