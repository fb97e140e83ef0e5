"""Take ``n`` unit steps from ``a``: a scratchpad of ``n + 1`` lines that a tiny model learns.

The main job's task (``pipelines/quickstart.yaml``). What a ~3M parameter character model
learns fast in a short warm start is a rule that looks only at the line before (increment,
decrement); what it learns slowly is fetching a number from the prompt (the arithmetic task's
terms, the ``chain`` task's step and bound). So here every line but the first is local: the
left column counts the steps still to take down to 0 (stopping is local too), the right
column counts the value up. The first line restates the question, the one copy from the
prompt; with ``given_first_line`` the prompt ends with it (the problem is stated as its
starting state) and the completion has no copy at all. With ``counter_width: 3`` the left
column is zero-padded, so a long problem's counter ("187") differs from a short one's ("007")
only in a hundreds digit that is copied down like the value's.

Example (``given_first_line``, ``counter_width: 3``; prompt, then completion)::

    Q: 569+3
    A:
    003 569
    002 570
    001 571
    000 572
    answer: 572

The number of steps follows a truncated zipf law, and every ``long_every``-th problem is drawn
from a long stratum (e.g. 200-260 steps, 1,600+ tokens worked out in full): the long tail.

Measured warm starts (2 threads; greedy and temperature-1 accuracy on 8 held-out problems per
n; ``/tmp``-style experiments recorded in the README):

- plain format, 460 steps on n <= 60: 88% at n = 1, 25% at n = 8, 0% from n = 20, almost
  every error in the first line's copy of ``a``;
- ``given_first_line``, 300 steps on n <= 60: 100% / 100% / 75% at n = 1 / 3 / 8, but a
  3-digit counter never seen stops it at once (30-token answers to 150-step problems);
- with a long stratum mixed in from the start, or long problems after a curriculum without
  zero padding, short problems fall to 0-25%: the new 3-digit counter costs the steps;
- ``counter_width: 3``, 250 steps on n <= 60 then 200 mixed with truncated long problems:
  62-88% at n <= 8 and 50% at n = 40 (greedy); long problems are worked at length but not
  to the end (500-750 tokens for n = 150-190, the tens digit of the counter drifts);
- the same with long demonstrations as windows (``long_examples: windows``: the prompt and a
  run of lines from anywhere in the solution, at their true positions) on the RL task's long
  stratum (200-260): 70% greedy on the dev split (33% with them cut to their first 512
  tokens), and long problems worked at length (1,636 tokens on average, greedy), though none
  to the right answer; with the long stratum from 150, half the long answers stop at the
  ``200`` line, read as the short problems' ``000``.
"""

from __future__ import annotations

import random
import re

from pydantic import Field, model_validator

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, check_split, rng_for, split_of
from dora.tasks.sizes import LongTail

_PROBLEM = re.compile(r"Q: (\d+)\+(\d+)\n")


class TallyConfig(TaskConfig):
    """Step-count distribution and start range."""

    min_steps: int = Field(default=1, ge=1, le=999)
    max_steps: int = Field(default=60, ge=1, le=999)
    zipf_alpha: float = Field(default=1.3, gt=1.0, le=10.0)
    long_every: int = Field(
        default=0,
        ge=0,
        description="Every this many problems (index % long_every == 0) takes a step count "
        "drawn uniformly from [long_min_steps, long_max_steps]; 0: none.",
    )
    long_min_steps: int = Field(default=150, ge=1, le=999)
    long_max_steps: int = Field(default=190, ge=1, le=999)
    max_start: int = Field(default=699, ge=0, le=10**9)
    counter_width: int = Field(
        default=0,
        ge=0,
        le=3,
        description="Zero-pad the left column to this many digits: a long problem's 3-digit "
        "counter then differs from a short one's only in its copied hundreds digit.",
    )
    given_first_line: bool = Field(
        default=False,
        description="The prompt ends with the scratchpad's first line (the starting state), so "
        "every completion line follows from the line before: no copy from the question.",
    )
    eval_percent: int = Field(default=10, ge=1, le=50)
    dev_percent: int = Field(default=5, ge=0, le=40)

    @model_validator(mode="after")
    def _ranges(self) -> TallyConfig:
        if self.max_steps < self.min_steps:
            raise ValueError(f"max_steps ({self.max_steps}) < min_steps ({self.min_steps})")
        if self.long_every and self.long_max_steps < self.long_min_steps:
            raise ValueError(
                f"long_max_steps ({self.long_max_steps}) < long_min_steps ({self.long_min_steps})"
            )
        return self


def scratchpad(start: int, steps: int, width: int = 0) -> str:
    """The reference completion: ``steps + 1`` lines ``left value``, then the answer line."""
    lines = [f"{steps - i:0{width}d} {start + i}" for i in range(steps + 1)]
    return "\n".join([*lines, f"answer: {start + steps}"])


def parse_problem(prompt: Prompt) -> tuple[int, int]:
    """``(start, steps)`` of a tally prompt."""
    match = _PROBLEM.search(prompt.text)
    if match is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} is not a tally problem")
    start, steps = (int(x) for x in match.groups())
    return start, steps


class TallyTask(BaseTask):
    """``a + n`` worked out one unit step per line."""

    name = "tally"

    def __init__(self, config: TallyConfig | None = None) -> None:
        self.config = config or TallyConfig()
        c = self.config
        self._sizes = LongTail(
            c.min_steps,
            c.max_steps,
            c.zipf_alpha,
            c.long_every,
            c.long_min_steps,
            c.long_max_steps,
        )

    def _draw(self, split: Split, index: int, steps: int | None) -> tuple[int, int]:
        c = self.config
        for attempt in range(10_000 if steps is None else 1_000):
            rng = rng_for(self.name, c.seed, split, index, attempt, steps)
            n = steps if steps is not None else self._sizes.draw(rng, index)
            start = rng.randint(0, c.max_start)
            if split_of(f"{start}+{n}", c.eval_percent, c.dev_percent) == split:
                return start, n
        raise LookupError(f"no {split} problem found")

    def prompt(self, split: Split, index: int) -> Prompt:
        """Problem ``index`` of ``split`` (deterministic by seed, split and index)."""
        return self._prompt(split, index, None)

    def prompt_with_terms(self, split: Split, num_terms: int, index: int) -> Prompt:
        """Problem ``index`` of ``split`` among those of exactly ``num_terms`` steps."""
        if not 1 <= num_terms <= 999:
            raise ValueError(f"num_terms must be in [1, 999], got {num_terms}")
        return self._prompt(split, index, num_terms)

    def identity(self, prompt: Prompt) -> str:
        start, steps = parse_problem(prompt)
        return f"{start}+{steps}"

    def _prompt(self, split: Split, index: int, steps: int | None) -> Prompt:
        check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        start, n = self._draw(split, index, steps)
        width = self.config.counter_width
        given = f"{n:0{width}d} {start}\n" if self.config.given_first_line else ""
        suffix = "" if steps is None else f"-n{steps}"
        return Prompt(
            prompt_id=self.prompt_id(self.config.seed, split, index) + suffix,
            text=f"Q: {start}+{n}\nA:\n{given}",
            answer=str(start + n),
            task=self.name,
            split=split,
            metadata={"num_terms": n},
        )

    def guess(self, prompt: Prompt, rng: random.Random) -> str:
        """A made-up answer near the start (rarely right): a teacher that does not work."""
        start, _ = parse_problem(prompt)
        return f"answer: {start + rng.randint(1, 200)}"

    def solve(self, prompt: Prompt) -> str:
        """The reference scratchpad completion (without the end-of-sequence token)."""
        full = scratchpad(*parse_problem(prompt), self.config.counter_width)
        return full.split("\n", 1)[1] if self.config.given_first_line else full
