"""A calculator tool: exact integer and decimal arithmetic on + - * / // % ** and brackets.

Evaluated by walking the parsed expression (``ast``), never by ``eval``: names, calls,
attributes and huge powers are refused with a message the model can read.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from dora.envs.tools import Tool

MAX_EXPONENT = 64
MAX_LENGTH = 200

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
        return Fraction(_BINARY[type(node.op)](left, right))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / // % ** and brackets, e.g. "3 * (4 + 5)".
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        return _format(_value(tree.body))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


CALCULATOR = Tool.from_function(calculator, timeout_s=2.0)
