"""Math answers checked by ``math-verify`` (boxed answers, fractions, equivalent forms).

math-verify parses LaTeX/expressions with sympy and can hang on hostile input. It guards
itself with SIGALRM, which only works in a main thread; the reward service therefore runs this
verifier in worker processes (main thread, alarms on) and adds its own per-item timeout.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import Field

from dora.events import Prompt
from dora.rewards.base import VerifierConfig, VerifierResult, last_answer_line


class MathVerifierConfig(VerifierConfig):
    """Timeouts (seconds, main thread only) and the optional DAPO ``Answer:`` line."""

    parsing_timeout: int = Field(default=5, ge=1, le=600)
    verify_timeout: int = Field(default=5, ge=1, le=600)
    answer_marker: str = Field(default="answer:", description="Also try the last such line.")
    float_rounding: int = Field(default=6, ge=0, le=20)


def _gold_text(answer: str) -> str:
    answer = answer.strip()
    if "$" in answer or "\\boxed" in answer or "\\(" in answer:
        return answer
    return f"${answer}$"


class MathVerifier:
    """Reward 1 when the completion's final answer equals the ground truth mathematically."""

    name = "math"
    heavy = True  # CPU-heavy and hang-prone: the reward service runs it in a process pool

    def __init__(self, config: MathVerifierConfig | None = None) -> None:
        self.config = config or MathVerifierConfig()

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        """Try the boxed/last expression of the whole completion, then an ``Answer:`` line."""
        from math_verify import parse, verify

        c = self.config
        alarms = threading.current_thread() is threading.main_thread()
        p_timeout: Any = c.parsing_timeout if alarms else None
        v_timeout: Any = c.verify_timeout if alarms else None
        gold = parse(_gold_text(prompt.answer), parsing_timeout=p_timeout)
        if not gold:
            raise ValueError(f"cannot parse ground truth {prompt.answer!r}")
        candidates = [completion]
        line = last_answer_line(completion, c.answer_marker)
        if line:
            candidates.append(_gold_text(line))
        parsed_any = ""
        for text in candidates:
            pred = parse(text, parsing_timeout=p_timeout)
            if not pred:
                continue
            parsed_any = parsed_any or str(pred[-1])[:200]
            ok = verify(gold, pred, float_rounding=c.float_rounding, timeout_seconds=v_timeout)
            if ok:
                return VerifierResult(
                    1.0, True, {"parsed": str(pred[-1])[:200], "expected": prompt.answer}
                )
        reason = "mismatch" if parsed_any else "no parsable answer"
        return VerifierResult(
            0.0, False, {"parsed": parsed_any, "expected": prompt.answer, "reason": reason}
        )
