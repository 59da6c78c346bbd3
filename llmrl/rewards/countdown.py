"""The Countdown reward (rule-based, as in TinyZero / DeepSeek-R1-Zero style setups).

The answer is the last ``<answer>...</answer>``; 1 if it is an expression over exactly the given
numbers (each used once) whose value is the target, `format_reward` if the tags are there but the
expression is wrong, invalid or uses other numbers, and 0 without tags. A trailing ``= target`` is
allowed.

The expression is never `eval`-ed: it is parsed with `ast` and only integer literals, + - * / and
parentheses are accepted, computed exactly with fractions.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from llmrl.rewards.answers import last_tagged

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression and the integers it uses; None if not allowed or invalid."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            return _OPERATORS[type(node.op)](left, right)  # Fraction / 0 raises ZeroDivisionError
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"{type(node).__name__} is not allowed")

    try:
        return value(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def countdown_reward(
    text: str, numbers: tuple[int, ...], target: int, *, format_reward: float = 0.1
) -> float:
    """1 for a correct equation in <answer> tags, `format_reward` for a wrong one, 0 without tags."""
    marked = last_tagged(text, "answer")
    if marked is None:
        return 0.0
    evaluated = evaluate_expression(marked[0].split("=")[0])
    if evaluated is None:
        return format_reward
    value, used = evaluated
    return 1.0 if sorted(used) == sorted(numbers) and value == target else format_reward
