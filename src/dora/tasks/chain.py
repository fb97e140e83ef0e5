"""Repeated addition up to a bound: a scratchpad whose length is the problem's size.

The main job needs the response-length profile of reasoning RL — most answers short, a few
hundred times longer — with work that grows with the problem and that a ~3M parameter
character model can learn in a few minutes. Every scratchpad line here depends only on the
line before it and on the two numbers of the question: copy the last value, add the step,
stop once the value passes the bound. Nothing has to be fetched from a far position (the
arithmetic task's term lookup is what a short warm start fails to learn), and per-line
errors compound with length, so long chains are hard and RL has signal at every size.

Example (prompt, then completion)::

    Q: 85+7>107
    A:
    85+7=92
    92+7=99
    99+7=106
    106+7=113
    answer: 113

The number of lines follows a truncated zipf law, and every ``long_every``-th problem is drawn
from a long stratum (hundreds of lines, 1,000+ tokens), so every batch of a run has a tail.
There is a shortcut (``start + lines * step``), but it needs a division and a product that a
tiny model cannot do in one token; the scratchpad is the way to be right.
"""

from __future__ import annotations

import random
import re

from pydantic import Field, model_validator

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, check_split, rng_for, split_of
from dora.tasks.sizes import LongTail

_PROBLEM = re.compile(r"Q: (\d+)\+(\d+)>(\d+)\n")


class ChainConfig(TaskConfig):
    """Chain-length distribution, step and start ranges."""

    min_lines: int = Field(default=1, ge=1, le=400)
    max_lines: int = Field(default=40, ge=1, le=400)
    zipf_alpha: float = Field(
        default=1.5, gt=1.0, le=10.0, description="Tail exponent of the line count."
    )
    long_every: int = Field(
        default=0,
        ge=0,
        description="Every this many problems (index % long_every == 0) has a line count drawn "
        "uniformly from [long_min_lines, long_max_lines]; 0: none.",
    )
    long_min_lines: int = Field(default=110, ge=1, le=400)
    long_max_lines: int = Field(default=140, ge=1, le=400)
    max_step: int = Field(default=9, ge=1, le=9)
    max_start: int = Field(default=99, ge=0, le=499)
    max_value: int = Field(
        default=999, ge=10, le=10**6, description="Largest value a chain may reach."
    )
    eval_percent: int = Field(default=10, ge=1, le=50, description="Share of problems in eval.")
    dev_percent: int = Field(
        default=5, ge=0, le=40, description="Share of problems in the dev split (for tuning)."
    )

    @model_validator(mode="after")
    def _ranges(self) -> ChainConfig:
        if self.max_lines < self.min_lines:
            raise ValueError(f"max_lines ({self.max_lines}) < min_lines ({self.min_lines})")
        if self.long_every and self.long_max_lines < self.long_min_lines:
            raise ValueError(
                f"long_max_lines ({self.long_max_lines}) < long_min_lines ({self.long_min_lines})"
            )
        longest = max(self.max_lines, self.long_max_lines if self.long_every else 0)
        if self.max_start + longest > self.max_value:
            raise ValueError(
                f"max_value ({self.max_value}) cannot hold a chain of {longest} lines from "
                f"max_start ({self.max_start}) with step 1"
            )
        return self


def format_problem(start: int, step: int, bound: int) -> str:
    """Prompt text; ends with the ``A:`` cue and a newline."""
    return f"Q: {start}+{step}>{bound}\nA:\n"


def lines_of(start: int, step: int, bound: int) -> int:
    """Additions until the value passes ``bound`` (at least one)."""
    return max(0, bound - start) // step + 1


def scratchpad(start: int, step: int, bound: int) -> str:
    """The reference completion: one addition per line, then the answer line."""
    lines, value = [], start
    for _ in range(lines_of(start, step, bound)):
        lines.append(f"{value}+{step}={value + step}")
        value += step
    lines.append(f"answer: {value}")
    return "\n".join(lines)


def identity(start: int, step: int, bound: int) -> str:
    """One key per distinct scratchpad: bounds that stop the chain on the same line are the
    same problem (the split and the eval set's de-duplication key on this)."""
    return f"{start}+{step}x{lines_of(start, step, bound)}"


def parse_problem(prompt: Prompt) -> tuple[int, int, int]:
    """``(start, step, bound)`` of a chain prompt."""
    match = _PROBLEM.search(prompt.text)
    if match is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} is not a chain problem")
    start, step, bound = (int(x) for x in match.groups())
    if step < 1:
        raise ValueError(f"prompt {prompt.prompt_id!r} has step {step}; it must be >= 1")
    return start, step, bound


class ChainTask(BaseTask):
    """``start + step + step + ...`` until the value passes a bound."""

    name = "chain"

    def __init__(self, config: ChainConfig | None = None) -> None:
        self.config = config or ChainConfig()
        c = self.config
        self._sizes = LongTail(
            c.min_lines,
            c.max_lines,
            c.zipf_alpha,
            c.long_every,
            c.long_min_lines,
            c.long_max_lines,
        )

    def _draw(self, split: Split, index: int, lines: int | None) -> tuple[int, int, int]:
        c = self.config
        for attempt in range(10_000 if lines is None else 1_000):
            rng = rng_for(self.name, c.seed, split, index, attempt, lines)
            n = lines if lines is not None else self._sizes.draw(rng, index)
            start = rng.randint(0, c.max_start)
            step = rng.randint(1, max(1, min(c.max_step, (c.max_value - start) // n)))
            # every bound in [start + (n-1)*step, start + n*step - 1] stops after n lines
            bound = start + (n - 1) * step + rng.randint(0, step - 1)
            if split_of(identity(start, step, bound), c.eval_percent, c.dev_percent) == split:
                return start, step, bound
        size = "" if lines is None else f" with {lines} lines"
        raise LookupError(f"no {split} problem{size} found")

    def prompt(self, split: Split, index: int) -> Prompt:
        """Problem ``index`` of ``split`` (deterministic by seed, split and index)."""
        return self._prompt(split, index, None)

    def prompt_with_terms(self, split: Split, num_terms: int, index: int) -> Prompt:
        """Problem ``index`` of ``split`` among those of exactly ``num_terms`` lines (what a
        difficulty-stratified eval set draws from)."""
        if not 1 <= num_terms <= self.config.max_value:
            raise ValueError(f"num_terms must be in [1, {self.config.max_value}], got {num_terms}")
        return self._prompt(split, index, num_terms)

    def identity(self, prompt: Prompt) -> str:
        """The problem's identity (start, step and line count)."""
        return identity(*parse_problem(prompt))

    def _prompt(self, split: Split, index: int, lines: int | None) -> Prompt:
        check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        start, step, bound = self._draw(split, index, lines)
        n = lines_of(start, step, bound)
        suffix = "" if lines is None else f"-n{lines}"
        return Prompt(
            prompt_id=self.prompt_id(self.config.seed, split, index) + suffix,
            text=format_problem(start, step, bound),
            answer=str(start + n * step),
            task=self.name,
            split=split,
            metadata={"num_terms": n},
        )

    def guess(self, prompt: Prompt, rng: random.Random) -> str:
        """An answer line with a made-up value past the bound (rarely right): what a warm-start
        teacher that answers without working writes (see ``shortcut: guess``)."""
        bound = parse_problem(prompt)[2]
        return f"answer: {bound + rng.randint(1, 99)}"

    def solve(self, prompt: Prompt) -> str:
        """The reference scratchpad completion (without the end-of-sequence token)."""
        return scratchpad(*parse_problem(prompt))
