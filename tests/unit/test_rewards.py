"""Verifiers: exact match, countdown and math on right, wrong and malformed answers."""

from __future__ import annotations

import pytest

from dora.events import Prompt
from dora.rewards import OverlongShaping, VerifierError, make_verifier, verifier_names


def _prompt(answer: str, task: str = "arithmetic", **metadata: str | int | bool) -> Prompt:
    return Prompt(prompt_id="p", text="q", answer=answer, task=task, metadata=metadata)


def test_exact_match() -> None:
    v = make_verifier("exact_match")
    p = _prompt("19")
    right = v.verify("3+5=8\n8+11=19\nanswer: 19", p)
    assert (right.reward, right.correct, right.details["parsed"]) == (1.0, True, "19")
    wrong = v.verify("3+5=8\nanswer: 18", p)
    assert (wrong.reward, wrong.correct, wrong.details["reason"]) == (0.0, False, "mismatch")
    missing = v.verify("3+5=8\n8+11=", p)
    assert missing.reward == 0.0 and missing.details["reason"] == "no answer line"
    assert v.verify("answer: 7\nanswer: 19", p).correct  # the last answer line counts
    assert v.verify("answer: 019", p).correct  # integers by value
    assert not v.verify("answer: nineteen", p).correct


def test_countdown_verifier() -> None:
    v = make_verifier("countdown")
    p = _prompt("15", task="countdown", numbers="3,5,2,1", target=15, use_all=True)
    assert v.verify("answer: (3+5)*2-1", p).correct
    assert v.verify("answer: ((3+5)*2)-1", p).reward == 1.0
    cases = {
        "answer: (3+5)*2": "unused",  # 1 not used
        "answer: (3+5)*2-1+1": "not given",  # 1 used twice
        "answer: 15": "not given",
        "answer: (3+5)*2+1": "wrong value",
        "answer: __import__('os').system('x')": "not allowed",
        "answer: 3**5-2-1": "not allowed",
        "answer: (3+5)*2-": "not an expression",
        "answer: 3/(5-5)*2*1": "not given",
        "no answer here": "no answer line",
    }
    for completion, reason in cases.items():
        result = v.verify(completion, p)
        assert not result.correct and result.reward == 0.0, completion
        assert reason in str(result.details["reason"]), (completion, result.details)
    q = _prompt("2", task="countdown", numbers="4,2,0", target=2, use_all=True)
    assert "division by zero" in str(v.verify("answer: 4/0+2", q).details["reason"])
    loose = _prompt("8", task="countdown", numbers="3,5,2", target=8, use_all=False)
    assert v.verify("answer: 3+5", loose).correct


@pytest.mark.parametrize(
    ("answer", "completion", "correct"),
    [
        ("\\frac{1}{2}", "So the result is \\boxed{\\frac{1}{2}}.", True),
        ("\\frac{1}{2}", "Thus $\\boxed{0.5}$", True),
        ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", True),
        ("\\frac{1}{2}", "Answer: 1/2", True),
        ("5\\sqrt{2}", "we get \\boxed{\\sqrt{50}}", True),
        ("34", "Answer: 34", True),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
        ("34", "Answer: 35", False),
        ("34", "I do not know", False),
        ("34", "\\boxed{", False),
    ],
)
def test_math_verifier(answer: str, completion: str, correct: bool) -> None:
    result = make_verifier("math").verify(completion, _prompt(answer, task="math"))
    assert result.correct is correct, result
    assert result.reward == (1.0 if correct else 0.0)


def test_registry_errors() -> None:
    assert {"exact_match", "countdown", "math"} <= set(verifier_names())
    with pytest.raises(VerifierError, match=r"unknown verifier 'x'.*exact_match"):
        make_verifier("x")
    with pytest.raises(VerifierError, match="marker"):
        make_verifier("exact_match", marker="")
    with pytest.raises(VerifierError, match="nope"):
        make_verifier("math", nope=1)


def test_overlong_shaping_values() -> None:
    s = OverlongShaping(max_length=100, buffer=20, factor=0.5)
    assert s.penalty(50) == 0.0
    assert s.penalty(80) == 0.0
    assert s.penalty(90) == pytest.approx(0.25)
    assert s.penalty(100) == pytest.approx(0.5)
    assert s.penalty(150) == pytest.approx(0.5)
    reward, details = s.apply(1.0, 95)
    assert reward == pytest.approx(1.0 - 0.375)
    assert details == {"overlong_penalty": pytest.approx(0.375), "length": 95, "raw_reward": 1.0}
    with pytest.raises(ValueError, match="buffer"):
        OverlongShaping(max_length=10, buffer=20)
