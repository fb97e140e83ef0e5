"""Countdown verifier: evaluate the answer expression safely (ast, exact fractions, no eval)."""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction

from pydantic import Field

from dora.events import Prompt
from dora.rewards.base import VerifierConfig, VerifierResult, last_answer_line

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: None}
_NUMBERS = re.compile(r"Numbers:([\d ]+)")


class ExpressionError(ValueError):
    """An answer that is not an arithmetic expression of integers with + - * /."""


def literals(tree: ast.AST) -> list[int]:
    """Integer constants of an expression tree (refuses every other kind of node)."""
    out: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ExpressionError(f"only integers are allowed, got {node.value!r}")
            out.append(node.value)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        elif not isinstance(node, ast.Expression | ast.operator):
            raise ExpressionError(f"{type(node).__name__} is not allowed")
    return out


def evaluate(node: ast.AST) -> Fraction:
    """Exact value of a checked expression tree; division by zero raises ExpressionError."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ExpressionError("division by zero")
            return left / right
        return _OPS[type(node.op)](left, right)  # type: ignore[misc]
    raise ExpressionError(f"{type(node).__name__} is not allowed")  # pragma: no cover


def parse_expression(text: str, max_chars: int = 200) -> ast.Expression:
    """Parse and check an answer expression (bounded length, integers and + - * / only)."""
    if len(text) > max_chars:
        raise ExpressionError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(text.replace("\u00d7", "*").replace("\u00f7", "/"), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an expression: {exc.msg}") from exc
    literals(tree)
    return tree


class CountdownVerifierConfig(VerifierConfig):
    """Answer marker and the length bound of an expression."""

    marker: str = Field(default="answer:", min_length=1)
    max_chars: int = Field(default=200, ge=1, le=10_000)


class CountdownVerifier:
    """Reward 1 when the expression hits the target using only the given numbers."""

    name = "countdown"

    def __init__(self, config: CountdownVerifierConfig | None = None) -> None:
        self.config = config or CountdownVerifierConfig()

    @staticmethod
    def _problem(prompt: Prompt) -> tuple[list[int], int, bool]:
        raw = prompt.metadata.get("numbers")
        if isinstance(raw, str) and raw:
            numbers = [int(x) for x in raw.split(",")]
        else:
            match = _NUMBERS.search(prompt.text)
            if match is None:
                raise ValueError(f"prompt {prompt.prompt_id!r} lists no numbers")
            numbers = [int(x) for x in match.group(1).split()]
        target = int(prompt.metadata.get("target", prompt.answer))
        return numbers, target, bool(prompt.metadata.get("use_all", True))

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        """Malformed, disallowed or wrong expressions get reward 0 with the reason."""
        numbers, target, use_all = self._problem(prompt)
        expr = last_answer_line(completion, self.config.marker)
        base: dict[str, str | int | float | bool] = {"target": target, "parsed": (expr or "")[:200]}
        if expr is None:
            return VerifierResult(0.0, False, {**base, "reason": "no answer line"})
        try:
            tree = parse_expression(expr, self.config.max_chars)
            used = Counter(literals(tree))
            given = Counter(numbers)
            if used - given:
                extra = sorted((used - given).elements())
                return VerifierResult(0.0, False, {**base, "reason": f"numbers not given {extra}"})
            if use_all and used != given:
                missing = sorted((given - used).elements())
                return VerifierResult(0.0, False, {**base, "reason": f"numbers unused {missing}"})
            value = evaluate(tree)
        except ExpressionError as exc:
            return VerifierResult(0.0, False, {**base, "reason": str(exc)})
        ok = value == target
        return VerifierResult(
            1.0 if ok else 0.0,
            ok,
            {**base, "value": str(value), "reason": "match" if ok else "wrong value"},
        )
