"""Synthetic multi-step addition with a written-out scratchpad and long-tailed lengths.

Each problem sums ``n`` numbers; the reference completion adds them one at a time, one line
per step, then states ``answer: <sum>``. The number of terms follows a truncated zipf law, so
most responses are short and a few are very long — the length profile of reasoning RL that
makes synchronous rollout wait on stragglers. The format is strictly regular so a ~3M
parameter character model can learn it; per-step errors compound with length, so longer
problems are harder and the RL signal is dense (some samples right, some wrong).

Example (prompt, then completion), ``scratchpad: running`` (the default)::

    Q: 3+5+9+2
    A:
    3+5=8
    8+9=17
    17+2=19
    answer: 19

``scratchpad: rewrite`` instead rewrites the whole remaining sum on each line (``3+5=8+9+2``,
``8+9=17+2``, ``17+2=19``): the two numbers to add are always the first two after the last
``=``, so a small model need not count terms to find the next one (it must copy the rest of
the previous line instead), and lengths grow quadratically with the term count (a longer tail).

``modulus: 10`` keeps every running sum (and the answer) to one digit (``8+9=7``): each line
is one of 100 single-digit facts, while the number of lines, and so the length of the
reasoning, still grows with the problem. Measured on the tiny preset, neither option trains
faster than the default: what limits a short warm start is learning to copy terms from the
prompt (~250K tokens), not the arithmetic.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field, model_validator

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, check_split, rng_for, split_of
from dora.tasks.sizes import LongTail

_PROBLEM = re.compile(r"Q: (\d+(?:\+\d+)+)\n")


class ArithmeticConfig(TaskConfig):
    """Problem-size distribution and number ranges."""

    min_terms: int = Field(default=2, ge=2, le=512)
    max_terms: int = Field(default=40, ge=2, le=512)
    zipf_alpha: float = Field(
        default=1.7, gt=1.0, le=10.0, description="Tail exponent of the extra-term count."
    )
    min_value: int = Field(default=1, ge=0)
    max_value: int = Field(default=9, ge=1, le=10**9)
    eval_percent: int = Field(default=10, ge=1, le=50, description="Share of problems in eval.")
    dev_percent: int = Field(
        default=5, ge=0, le=40, description="Share of problems in the dev split (for tuning)."
    )
    long_every: int = Field(
        default=0,
        ge=0,
        description="Every this many problems (index % long_every == 0) is drawn from the long "
        "stratum, [long_min_terms, max_terms] uniformly; the others from the zipf law below "
        "long_min_terms. 0: every problem from the zipf law over [min_terms, max_terms].",
    )
    long_min_terms: int = Field(default=24, ge=3, le=512)
    scratchpad: Literal["running", "rewrite"] = "running"
    modulus: int | None = Field(
        default=None,
        ge=2,
        le=10**9,
        description="Reduce every running sum (and the answer) modulo this; None: plain sums.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> ArithmeticConfig:
        if self.max_terms < self.min_terms:
            raise ValueError(f"max_terms ({self.max_terms}) < min_terms ({self.min_terms})")
        if self.max_value < self.min_value:
            raise ValueError(f"max_value ({self.max_value}) < min_value ({self.min_value})")
        if self.long_every and not self.min_terms < self.long_min_terms <= self.max_terms:
            raise ValueError(
                f"long_min_terms ({self.long_min_terms}) must be in (min_terms, max_terms]"
            )
        return self


def format_problem(terms: list[int]) -> str:
    """Prompt text of a problem; ends with the ``A:`` cue and a newline."""
    return f"Q: {'+'.join(map(str, terms))}\nA:\n"


def scratchpad(terms: list[int], style: str = "running", modulus: int | None = None) -> str:
    """The reference completion: one line per addition, then the answer line."""
    lines = []
    total = terms[0] % modulus if modulus else terms[0]
    for i, t in enumerate(terms[1:], start=2):
        new = (total + t) % modulus if modulus else total + t
        rest = "".join(f"+{x}" for x in terms[i:]) if style == "rewrite" else ""
        lines.append(f"{total}+{t}={new}{rest}")
        total = new
    lines.append(f"answer: {total}")
    return "\n".join(lines)


def identity(terms: list[int]) -> str:
    """One key for every ordering of the same terms: a permutation of a problem is the same
    problem (the split and the eval set's de-duplication key on this)."""
    return "+".join(map(str, sorted(terms)))


def parse_terms(prompt: Prompt) -> list[int]:
    """Terms of a problem, from metadata or (for foreign prompts) from the text."""
    raw = prompt.metadata.get("terms")
    if isinstance(raw, str) and raw:
        return [int(x) for x in raw.split("+")]
    match = _PROBLEM.search(prompt.text)
    if match is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} is not an arithmetic problem")
    return [int(x) for x in match.group(1).split("+")]


class ArithmeticTask(BaseTask):
    """Sums of ``n`` numbers, ``n - min_terms + 1 ~ zipf(alpha)`` truncated at ``max_terms``."""

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config or ArithmeticConfig()
        c = self.config
        # P(n) ~ (n - min_terms + 1) ** -alpha below the long stratum, if there is one
        top = c.long_min_terms - 1 if c.long_every else c.max_terms
        self._sizes = LongTail(
            c.min_terms, top, c.zipf_alpha, c.long_every, c.long_min_terms, c.max_terms
        )

    def _draw(self, split: Split, index: int, num_terms: int | None = None) -> list[int]:
        c = self.config
        for attempt in range(10_000 if num_terms is None else 1_000):
            rng = rng_for(self.name, c.seed, split, index, attempt, num_terms)
            n = num_terms if num_terms is not None else self._sizes.draw(rng, index)
            terms = [rng.randint(c.min_value, c.max_value) for _ in range(n)]
            if split_of(identity(terms), c.eval_percent, c.dev_percent) == split:
                return terms
        # few problems of a small size exist (45 two-term sums of one-digit numbers), and a
        # split may hold none of them
        size = "" if num_terms is None else f" with {num_terms} terms"
        raise LookupError(f"no {split} problem{size} found")

    def prompt(self, split: Split, index: int) -> Prompt:
        """Problem ``index`` of ``split`` (deterministic by seed, split and index)."""
        return self._prompt(split, index, None)

    def prompt_with_terms(self, split: Split, num_terms: int, index: int) -> Prompt:
        """Problem ``index`` of ``split`` among those of exactly ``num_terms`` terms (what a
        difficulty-stratified eval set draws from). ``LookupError`` when the split seems to
        hold no such problem."""
        if not 2 <= num_terms <= 512:
            raise ValueError(f"num_terms must be in [2, 512], got {num_terms}")
        return self._prompt(split, index, num_terms)

    def expression(self, prompt: Prompt) -> str:
        """The sum as a calculator expression (``3+5+9+2``), for tool demonstrations."""
        return "+".join(map(str, parse_terms(prompt)))

    def identity(self, prompt: Prompt) -> str:
        """The problem's identity (its sorted terms)."""
        return identity(parse_terms(prompt))

    def _prompt(self, split: Split, index: int, num_terms: int | None) -> Prompt:
        check_split(split)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        terms = self._draw(split, index, num_terms)
        suffix = "" if num_terms is None else f"-n{num_terms}"
        return Prompt(
            prompt_id=self.prompt_id(self.config.seed, split, index) + suffix,
            text=format_problem(terms),
            answer=str(self.answer_of(terms)),
            task=self.name,
            split=split,
            metadata={"terms": "+".join(map(str, terms)), "num_terms": len(terms)},
        )

    def answer_of(self, terms: list[int]) -> int:
        """The sum of ``terms``, reduced by the modulus when one is set."""
        total = sum(terms)
        return total % self.config.modulus if self.config.modulus else total

    def guess(self, prompt: Prompt, rng: random.Random) -> str:
        """An answer line with a made-up total drawn uniformly from the possible ones: what a
        warm-start teacher that answers without working writes (see ``shortcut: guess``)."""
        c = self.config
        n = len(parse_terms(prompt))
        low, high = (0, c.modulus - 1) if c.modulus else (n * c.min_value, n * c.max_value)
        return f"answer: {rng.randint(low, high)}"

    def solve(self, prompt: Prompt) -> str:
        """The reference scratchpad completion (without the end-of-sequence token)."""
        return scratchpad(parse_terms(prompt), self.config.scratchpad, self.config.modulus)
