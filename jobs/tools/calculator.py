"""Example tool for multi-turn rollouts: exact arithmetic on a safe subset of Python syntax.

Name it in a job as `rollout.multi_turn.tools = ["jobs/tools/calculator.py:calculator"]`; the
model calls it as `<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>`.
The expression is parsed with `ast` and only numbers, + - * / // % ** and parentheses are
evaluated (no names, calls or attributes), so it cannot run code.
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000  # 9 ** 9 ** 9 would otherwise take forever
MAX_LENGTH = 500


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError("exponents must be integers of at most 1000")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, e.g. "2 * (3 + 4) / 7" -> "2"."""
    if not isinstance(expression, str) or len(expression) > MAX_LENGTH:
        raise ValueError(f"expression must be a string of at most {MAX_LENGTH} characters")
    return _format(_eval(ast.parse(expression.strip(), mode="eval")))
