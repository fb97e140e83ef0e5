"""The tally task: a countdown beside a count-up, stopping at 0; long-tailed step counts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dora.models import CharTokenizer
from dora.tasks import TaskConfigError, make_task
from dora.tasks.tally import parse_problem


def test_lines_count_down_to_zero_while_the_value_counts_up() -> None:
    task = make_task("tally", seed=0, long_every=5)
    for prompt in task.prompts("train", 200):
        start, steps = parse_problem(prompt)
        *lines, last = task.solve(prompt).split("\n")
        pairs = [tuple(int(x) for x in line.split(" ")) for line in lines]
        assert pairs[0] == (steps, start)  # the first line restates the question
        assert pairs[-1] == (0, start + steps)
        assert all(b == (a[0] - 1, a[1] + 1) for a, b in itertools.pairwise(pairs))
        assert last == f"answer: {start + steps}" == f"answer: {prompt.answer}"


def test_long_stratum_gives_1000_token_answers_and_a_long_tail() -> None:
    task = make_task("tally", seed=0, long_every=8)
    tok = CharTokenizer.build()
    prompts = list(task.prompts("train", 800))
    lengths = np.array([len(tok.encode(task.solve(p))) + 1 for p in prompts])
    assert lengths[::8].min() >= 1000
    assert np.percentile(lengths, 99) >= 10 * np.median(lengths)


def test_config_errors_and_foreign_prompts() -> None:
    with pytest.raises(TaskConfigError, match="max_steps"):
        make_task("tally", min_steps=9, max_steps=3)
    with pytest.raises(ValueError, match="not a tally problem"):
        make_task("tally").solve(make_task("chain").prompt("train", 0))


def test_given_first_line_moves_the_starting_state_into_the_prompt() -> None:
    plain = make_task("tally", seed=0)
    given = make_task("tally", seed=0, given_first_line=True)
    for a, b in zip(plain.prompts("train", 50), given.prompts("train", 50), strict=True):
        first, rest = plain.solve(a).split("\n", 1)
        assert b.text == a.text + first + "\n"
        assert given.solve(b) == rest
        assert parse_problem(b) == parse_problem(a) and b.answer == a.answer
