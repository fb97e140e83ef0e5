"""Synthetic tasks: determinism, disjoint splits, long-tailed lengths, correct solutions."""

from __future__ import annotations

import numpy as np
import pytest

from dora.models import CharTokenizer
from dora.rewards import make_verifier
from dora.tasks import Task, TaskConfigError, make_task, task_names


@pytest.mark.parametrize("name", ["arithmetic", "chain", "tally", "countdown"])
def test_deterministic_by_seed(name: str) -> None:
    a = [p.text for p in make_task(name, seed=3).prompts("train", 50)]
    b = [p.text for p in make_task(name, seed=3).prompts("train", 50)]
    c = [p.text for p in make_task(name, seed=4).prompts("train", 50)]
    assert a == b
    assert a != c
    task = make_task(name, seed=3)
    assert task.prompt("eval", 7).text == make_task(name, seed=3).prompt("eval", 7).text


@pytest.mark.parametrize("name", ["arithmetic", "chain", "tally", "countdown"])
def test_splits_are_disjoint(name: str) -> None:
    task = make_task(name, seed=0)
    train = {p.text for p in task.prompts("train", 2000)}
    evals = [p for p in task.prompts("eval", 200)]
    assert all(p.split == "eval" for p in evals)
    assert not train & {p.text for p in evals}
    assert len({p.prompt_id for p in evals}) == 200


@pytest.mark.parametrize("name", ["arithmetic", "chain", "tally", "countdown"])
def test_solve_is_verified_correct(name: str) -> None:
    task = make_task(name, seed=1)
    verifier = make_verifier("countdown" if name == "countdown" else "exact_match")
    for prompt in task.prompts("train", 100):
        assert prompt.task == name
        result = verifier.verify(task.solve(prompt), prompt)
        assert result.correct and result.reward == 1.0, (prompt.text, result)


def test_arithmetic_format() -> None:
    task = make_task("arithmetic", seed=0, min_terms=3, max_terms=3)
    prompt = task.prompt("train", 0)
    terms = [int(t) for t in prompt.metadata["terms"].split("+")]  # type: ignore[union-attr]
    assert prompt.text == f"Q: {terms[0]}+{terms[1]}+{terms[2]}\nA:\n"
    s1 = terms[0] + terms[1]
    assert task.solve(prompt) == (
        f"{terms[0]}+{terms[1]}={s1}\n{s1}+{terms[2]}={sum(terms)}\nanswer: {sum(terms)}"
    )
    assert prompt.answer == str(sum(terms))


def test_arithmetic_rewrite_scratchpad_carries_the_remaining_sum() -> None:
    task = make_task("arithmetic", seed=0, min_terms=4, max_terms=4, scratchpad="rewrite")
    prompt = task.prompt("train", 0)
    a, b, c, d = (int(t) for t in prompt.metadata["terms"].split("+"))  # type: ignore[union-attr]
    lines = task.solve(prompt).split("\n")
    assert lines == [
        f"{a}+{b}={a + b}+{c}+{d}",
        f"{a + b}+{c}={a + b + c}+{d}",
        f"{a + b + c}+{d}={a + b + c + d}",
        f"answer: {a + b + c + d}",
    ]
    verifier = make_verifier("exact_match")
    assert all(verifier.verify(task.solve(p), p).correct for p in task.prompts("train", 50))


def test_arithmetic_modulus_keeps_every_running_sum_to_one_digit() -> None:
    task = make_task("arithmetic", seed=0, min_terms=4, max_terms=4, modulus=10)
    prompt = task.prompt("train", 0)
    a, b, c, d = (int(t) for t in prompt.metadata["terms"].split("+"))  # type: ignore[union-attr]
    s1, s2, s3 = (a + b) % 10, (a + b + c) % 10, (a + b + c + d) % 10
    assert task.solve(prompt).split("\n") == [
        f"{a}+{b}={s1}",
        f"{s1}+{c}={s2}",
        f"{s2}+{d}={s3}",
        f"answer: {s3}",
    ]
    assert prompt.answer == str(s3)
    verifier = make_verifier("exact_match")
    prompts = list(task.prompts("train", 200))
    assert all(verifier.verify(task.solve(p), p).correct for p in prompts)
    assert {p.answer for p in prompts} <= {str(i) for i in range(10)}
    with pytest.raises(ValueError, match="modulus"):
        make_task("arithmetic", modulus=1)


def test_arithmetic_lengths_are_long_tailed() -> None:
    task = make_task("arithmetic", seed=0)
    tok = CharTokenizer.build()
    lengths = np.array([len(tok.encode(task.solve(p))) + 1 for p in task.prompts("train", 3000)])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert p99 >= 6 * p50  # most short, a few very long
    assert p90 > p50
    assert lengths.max() <= 12 * 40 + 16  # bounded by max_terms


def test_registry_and_config_errors() -> None:
    assert {"arithmetic", "countdown", "jsonl"} <= set(task_names())
    with pytest.raises(TaskConfigError, match=r"unknown task 'nope'.*arithmetic"):
        make_task("nope")
    with pytest.raises(TaskConfigError, match="max_terms"):
        make_task("arithmetic", max_terms="many")
    with pytest.raises(TaskConfigError, match="bogus"):
        make_task("arithmetic", bogus=1)
    with pytest.raises(TaskConfigError, match="min_terms"):
        make_task("arithmetic", min_terms=5, max_terms=3)
    with pytest.raises(TaskConfigError, match="split"):
        next(make_task("countdown").prompts("test", 1))  # type: ignore[arg-type]
    assert isinstance(make_task("countdown"), Task)


def test_countdown_uses_all_numbers() -> None:
    task = make_task("countdown", seed=2, min_numbers=4, max_numbers=4)
    prompt = task.prompt("train", 0)
    numbers = prompt.metadata["numbers"].split(",")  # type: ignore[union-attr]
    assert len(numbers) == 4
    assert prompt.text.startswith("Numbers: ") and prompt.text.endswith("A:\n")
    assert int(prompt.answer) > 0


def test_long_stratum_every_nth_problem_gives_the_reasoning_long_tail() -> None:
    """``long_every``: every n-th problem is long, so any n consecutive prompts (a step's
    worth of groups) hold one, and lengths have a long tail (p99 >= 10x the median)."""
    task = make_task(
        "arithmetic", max_terms=36, scratchpad="rewrite", long_every=4, long_min_terms=30
    )
    tok = CharTokenizer.build()
    prompts = list(task.prompts("train", 400))
    terms = [int(p.metadata["num_terms"]) for p in prompts]
    assert all((n >= 30) == (i % 4 == 0) for i, n in enumerate(terms))
    lengths = np.array([len(tok.encode(task.solve(p))) + 1 for p in prompts])
    assert lengths[::4].min() >= 1000
    assert np.percentile(lengths, 99) >= 10 * np.median(lengths)


def test_long_stratum_must_fit_the_term_range() -> None:
    with pytest.raises(TaskConfigError, match="long_min_terms"):
        make_task("arithmetic", max_terms=20, long_every=4, long_min_terms=30)
