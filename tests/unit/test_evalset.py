"""The frozen eval set: distinct held-out problems by identity, stratified, reproducible; and
its statistics (means with standard errors clustered by problem, paired gains)."""

from __future__ import annotations

import numpy as np
import pytest

from dora.tasks import make_task
from dora.tasks.arithmetic import identity, parse_terms
from dora.tasks.evalset import EvalSetSpec, build_eval_set
from dora.training.evaluate import clustered_mean, compare_scores, summarize_scores


def test_eval_set_is_distinct_stratified_held_out_and_frozen() -> None:
    task = make_task("arithmetic", max_terms=16)
    spec = EvalSetSpec(strata=((2, 3), (4, 6), (11, 16)), per_stratum=120)
    eval_set = build_eval_set(task, spec)
    keys = [identity(parse_terms(p)) for p in eval_set.prompts]
    assert len(keys) == len(set(keys)), "a problem (or a permutation of it) appears twice"
    sizes = eval_set.stratum_sizes()
    # few distinct 2-3 term problems exist (45 + 165 multisets, ~10% held out): all of them,
    # no repeats; the longer strata fill up
    assert 5 < sizes["2-3"] < 120 and sizes["4-6"] == 120 and sizes["11-16"] == 120
    for p, label in zip(eval_set.prompts, eval_set.strata, strict=True):
        lo, hi = (int(x) for x in label.split("-"))
        assert lo <= len(parse_terms(p)) <= hi
        assert p.split == "eval"
    again = build_eval_set(make_task("arithmetic", max_terms=16), spec)
    assert again.fingerprint == eval_set.fingerprint
    assert [p.text for p in again.prompts] == [p.text for p in eval_set.prompts]
    dev = build_eval_set(task, spec.model_copy(update={"split": "dev"}))
    assert not set(keys) & {identity(parse_terms(p)) for p in dev.prompts}


def test_no_permutation_of_a_training_problem_is_held_out() -> None:
    task = make_task("arithmetic", max_terms=6)
    train = {identity(parse_terms(p)) for p in task.prompts("train", 3000)}
    held_out = {identity(parse_terms(p)) for p in task.prompts("eval", 500)}
    held_out |= {identity(parse_terms(p)) for p in task.prompts("dev", 500)}
    assert train and held_out and not train & held_out


def test_clustered_standard_error_is_over_problems_not_samples() -> None:
    # 4 problems x 4 samples: two always right, two always wrong. Counting the 16 samples as
    # independent gives sqrt(.25/16) = .125; clustered by problem it is sqrt(1/3)/2 = .289
    mean, se = clustered_mean(np.array([1.0, 1.0, 0.0, 0.0]))
    assert mean == 0.5 and se == pytest.approx(np.sqrt(1 / 3) / 2)


def test_summary_per_stratum_and_paired_gain() -> None:
    task = make_task("arithmetic", max_terms=6)
    eval_set = build_eval_set(task, EvalSetSpec(strata=((4, 4), (5, 6)), per_stratum=4))
    assert eval_set.strata == ("4",) * 4 + ("5-6",) * 4
    start = {"greedy": [0, 0, 1, 0, 0, 0, 0, 1], "greedy_length": [5.0] * 8}
    final = {"greedy": [1, 1, 1, 0, 0, 1, 0, 1], "greedy_length": [9.0] * 8}
    summary = summarize_scores(eval_set, final)
    assert summary["greedy"]["mean"] == 5 / 8
    assert summary["greedy"]["strata"]["4"] == pytest.approx({"mean": 0.75, "se": 0.25, "n": 4})
    gain = compare_scores(eval_set, start, final)
    assert "greedy_length" not in gain
    diffs = np.array([1, 1, 0, 0, 0, 1, 0, 0], dtype=float)
    assert gain["greedy"]["mean"] == pytest.approx(3 / 8)
    assert gain["greedy"]["se"] == pytest.approx(diffs.std(ddof=1) / np.sqrt(8))


def test_per_stratum_counts_may_differ_and_must_match_the_strata() -> None:
    task = make_task("chain", seed=0)
    spec = EvalSetSpec(strata=((1, 2), (110, 140)), per_stratum=(30, 5))
    assert build_eval_set(task, spec).stratum_sizes() == {"1-2": 30, "110-140": 5}
    with pytest.raises(ValueError, match="per_stratum"):
        EvalSetSpec(strata=((1, 2), (3, 4)), per_stratum=(30,))
