"""Countdown: combine the given numbers with + - * / to reach a target.

Problems are built backwards (combine random numbers, the final value is the target), so
every problem has a known solution. The reference completion shows each combination on its
own line, then ``answer: <expression>``; the verifier evaluates the expression safely and
checks which numbers it used.

Example::

    Numbers: 3 5 2 1
    Target: 15
    A:
    3+5=8
    8*2=16
    16-1=15
    answer: ((3+5)*2)-1
"""

from __future__ import annotations

from pydantic import Field, model_validator

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, check_split, rng_for, split_of


class CountdownConfig(TaskConfig):
    """How many numbers, how large, and whether all must be used."""

    min_numbers: int = Field(default=3, ge=2, le=8)
    max_numbers: int = Field(default=4, ge=2, le=8)
    max_number: int = Field(default=25, ge=2, le=1000)
    use_all: bool = Field(default=True, description="The answer must use every number once.")
    eval_percent: int = Field(default=10, ge=1, le=50)

    @model_validator(mode="after")
    def _ranges(self) -> CountdownConfig:
        if self.max_numbers < self.min_numbers:
            raise ValueError(f"max_numbers ({self.max_numbers}) < min_numbers ({self.min_numbers})")
        return self


def format_problem(numbers: list[int], target: int) -> str:
    """Prompt text; ends with the ``A:`` cue and a newline."""
    return f"Numbers: {' '.join(map(str, numbers))}\nTarget: {target}\nA:\n"


class CountdownTask(BaseTask):
    """Reach a target from 2-8 numbers; solutions combine every number once."""

    name = "countdown"

    def __init__(self, config: CountdownConfig | None = None) -> None:
        self.config = config or CountdownConfig()

    def _build(self, split: Split, index: int) -> tuple[list[int], int, list[str], str]:
        c = self.config
        for attempt in range(10_000):
            rng = rng_for(self.name, c.seed, split, index, attempt)
            n = rng.randint(c.min_numbers, c.max_numbers)
            numbers = [rng.randint(1, c.max_number) for _ in range(n)]
            pool: list[tuple[int, str]] = [(v, str(v)) for v in numbers]
            steps: list[str] = []
            while len(pool) > 1:
                i, j = rng.sample(range(len(pool)), 2)
                (a, ea), (b, eb) = pool[i], pool[j]
                op = rng.choice("+-*/")
                if op == "-" and a < b:
                    (a, ea), (b, eb) = (b, eb), (a, ea)
                if op == "/" and (b == 0 or a % b):
                    op = "+"
                value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
                steps.append(f"{a}{op}{b}={value}")
                wrap = [e if e.isdigit() else f"({e})" for e in (ea, eb)]
                pool = [p for k, p in enumerate(pool) if k not in (i, j)]
                pool.append((value, f"{wrap[0]}{op}{wrap[1]}"))
            target, expression = pool[0]
            if target <= 0:
                continue
            key = f"{sorted(numbers)}->{target}"
            if split_of(key, c.eval_percent) == split:
                return numbers, target, steps, expression
        raise RuntimeError("could not draw a countdown problem")  # pragma: no cover

    def prompt(self, split: Split, index: int) -> Prompt:
        """Problem ``index`` of ``split`` (deterministic by seed, split and index)."""
        check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        numbers, target, steps, expression = self._build(split, index)
        return Prompt(
            prompt_id=self.prompt_id(self.config.seed, split, index),
            text=format_problem(numbers, target),
            answer=str(target),
            task=self.name,
            split=split,
            metadata={
                "numbers": ",".join(map(str, numbers)),
                "target": target,
                "use_all": self.config.use_all,
                "steps": "\n".join(steps),
                "solution": expression,
            },
        )

    def solve(self, prompt: Prompt) -> str:
        """The construction steps, then the expression."""
        steps = prompt.metadata.get("steps")
        solution = prompt.metadata.get("solution")
        if not isinstance(solution, str) or not isinstance(steps, str):
            raise ValueError(f"prompt {prompt.prompt_id!r} carries no countdown solution")
        return f"{steps}\nanswer: {solution}" if steps else f"answer: {solution}"
