"""Exact match of the final ``answer:`` line, for synthetic tasks with canonical answers."""

from __future__ import annotations

from pydantic import Field

from dora.events import Prompt
from dora.rewards.base import VerifierConfig, VerifierResult, last_answer_line


class ExactMatchConfig(VerifierConfig):
    """Reward values and the answer marker."""

    marker: str = Field(default="answer:", min_length=1)
    correct_reward: float = 1.0
    wrong_reward: float = 0.0
    numeric: bool = Field(default=True, description="Compare integers by value (007 == 7).")


class ExactMatchVerifier:
    """Reward 1 when the last ``answer:`` line equals ``prompt.answer``, else 0."""

    name = "exact_match"

    def __init__(self, config: ExactMatchConfig | None = None) -> None:
        self.config = config or ExactMatchConfig()

    def _same(self, parsed: str, expected: str) -> bool:
        if parsed == expected:
            return True
        if self.config.numeric:
            try:
                return int(parsed.replace(",", "")) == int(expected.replace(",", ""))
            except ValueError:
                return False
        return False

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        """Parse the final answer line; malformed output is wrong, never an exception."""
        c = self.config
        expected = prompt.answer.strip()
        parsed = last_answer_line(completion, c.marker)
        if parsed is None:
            return VerifierResult(
                c.wrong_reward,
                False,
                {"parsed": "", "expected": expected, "reason": "no answer line"},
            )
        ok = self._same(parsed, expected)
        return VerifierResult(
            c.correct_reward if ok else c.wrong_reward,
            ok,
            {"parsed": parsed[:200], "expected": expected, "reason": "match" if ok else "mismatch"},
        )
