"""The chain task: every line one addition, lengths long-tailed, problems split by identity."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dora.models import CharTokenizer
from dora.tasks import TaskConfigError, make_task
from dora.tasks.chain import lines_of, parse_problem
from dora.tasks.evalset import EvalSetSpec, build_eval_set

_LINE = re.compile(r"(\d+)\+(\d+)=(\d+)")


def test_scratchpad_adds_the_step_until_the_value_passes_the_bound() -> None:
    task = make_task("chain", seed=0, long_every=4)
    for prompt in task.prompts("train", 300):
        start, step, bound = parse_problem(prompt)
        *lines, last = task.solve(prompt).split("\n")
        values = [start]
        for line in lines:
            a, d, b = (int(x) for x in _LINE.fullmatch(line).groups())  # type: ignore[union-attr]
            assert (a, d, b) == (values[-1], step, values[-1] + step)
            values.append(b)
        assert values[-1] > bound >= values[-2]  # stops on the first value past the bound
        assert last == f"answer: {values[-1]}" == f"answer: {prompt.answer}"
        assert len(lines) == lines_of(start, step, bound) == prompt.metadata["num_terms"]


def test_every_long_every_th_problem_is_long_and_lengths_have_the_reasoning_tail() -> None:
    task = make_task("chain", seed=0, long_every=8)
    tok = CharTokenizer.build()
    prompts = list(task.prompts("train", 800))
    lines = [int(p.metadata["num_terms"]) for p in prompts]
    assert all((n >= 110) == (i % 8 == 0) for i, n in enumerate(lines))
    lengths = np.array([len(tok.encode(task.solve(p))) + 1 for p in prompts])
    assert lengths[::8].min() >= 1000  # any 8 consecutive prompts hold a 1,000+ token answer
    assert np.percentile(lengths, 99) >= 10 * np.median(lengths)
    assert max(int(p.answer) for p in prompts) <= task.config.max_value


def test_bounds_that_stop_on_the_same_line_are_one_problem() -> None:
    task = make_task("chain")
    same = [
        task.identity(task.prompt("train", 0).model_copy(update={"text": t}))
        for t in ("Q: 10+3>13\nA:\n", "Q: 10+3>14\nA:\n", "Q: 10+3>15\nA:\n")
    ]
    assert len(set(same)) == 1
    assert (
        task.identity(task.prompt("train", 0).model_copy(update={"text": "Q: 10+3>16\nA:\n"}))
        != same[0]
    )


def test_eval_set_is_stratified_by_line_count_and_held_out() -> None:
    task = make_task("chain", seed=0, long_every=8)
    spec = EvalSetSpec(strata=((1, 2), (3, 8), (100, 140)), per_stratum=40)
    evalset = build_eval_set(task, spec)
    assert evalset.stratum_sizes() == {"1-2": 40, "3-8": 40, "100-140": 40}
    train = {task.identity(p) for p in task.prompts("train", 3000)}
    assert not train & {task.identity(p) for p in evalset.prompts}
    assert len({task.identity(p) for p in evalset.prompts}) == 120
    assert build_eval_set(task, spec).fingerprint == evalset.fingerprint


def test_bad_config_and_foreign_prompts_fail_clearly() -> None:
    with pytest.raises(TaskConfigError, match="max_lines"):
        make_task("chain", min_lines=5, max_lines=3)
    with pytest.raises(TaskConfigError, match="max_value"):
        make_task("chain", max_value=100, long_every=4, long_max_lines=200)
    foreign = make_task("arithmetic").prompt("train", 0)
    with pytest.raises(ValueError, match="not a chain problem"):
        make_task("chain").solve(foreign)
