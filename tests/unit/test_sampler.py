"""Sampler: greedy, top-k/top-p filtering, logprobs of the used distribution, determinism."""

from __future__ import annotations

import math

import torch

from dora.engines.torch.sampler import sample, uniform, uniforms
from dora.events import SamplingParams


def test_uniform_depends_only_on_seed_and_position() -> None:
    assert uniform(7, 3) == uniform(7, 3)
    values = {uniform(7, t) for t in range(1000)}
    assert len(values) == 1000 and all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / 1000 - 0.5) < 0.05
    assert uniform(7, 3) != uniform(8, 3)


def test_batched_uniforms_equal_the_scalar_draws() -> None:
    seeds = [0, 1, 7, 2**63 + 5, 2**64 - 1, -3, 123456789]
    positions = [0, 5, 3, 2**40, 1, 7, 2**64 - 1]
    got = uniforms(seeds, positions)
    assert got.tolist() == [uniform(s, t) for s, t in zip(seeds, positions, strict=True)]


def test_greedy_returns_raw_softmax_logprob() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lps = sample(logits, [SamplingParams(temperature=0.0)], [0])
    assert tokens == [1]
    assert lps[0] == torch.log_softmax(logits, -1)[0, 1].item()


def test_top_k_and_top_p_restrict_support_and_renormalise() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen: set[int] = set()
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    for t in range(300):
        (tok,), (lp,) = sample(logits, [p], [t])
        seen.add(tok)
        expected = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[tok]  # top-p keeps {0, 1}, renormalised
        assert math.isclose(lp, math.log(expected), rel_tol=1e-5)
    assert seen == {0, 1}
    k = SamplingParams(temperature=1.0, top_k=1, seed=2)
    toks = {sample(logits, [k], [t])[0][0] for t in range(50)}
    assert toks == {0}
    assert sample(logits, [k], [0])[1][0] == 0.0


def test_temperature_changes_logprob() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=2.0, seed=5)
    (tok,), (lp,) = sample(logits, [p], [0])
    assert math.isclose(lp, torch.log_softmax(logits / 2.0, -1)[0, tok].item(), rel_tol=1e-5)


def test_rows_are_independent_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i)
        if i % 3
        else SamplingParams(temperature=0.0)
        for i in range(8)
    ]
    positions = list(range(8))
    tokens, lps = sample(logits, params, positions)
    for i in range(8):
        (tok,), (lp,) = sample(logits[i : i + 1], [params[i]], [positions[i]])
        assert tok == tokens[i] and lp == lps[i]


def test_empirical_distribution_matches_probabilities() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs)[None]
    counts = [0, 0, 0]
    for t in range(3000):
        (tok,), _ = sample(logits, [SamplingParams(temperature=1.0, seed=9)], [t])
        counts[tok] += 1
    for c, p in zip(counts, probs.tolist(), strict=True):
        assert abs(c / 3000 - p) < 0.03
