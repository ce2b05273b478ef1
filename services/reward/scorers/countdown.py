"""The ``countdown`` scorer: does the response's equation reach the target from the given numbers?

The Countdown game (TinyZero's task): given ``numbers`` and a ``target``, write an arithmetic expression with
``+ - * /`` and parentheses, using each given number at most as often as it is given, that equals the target.

What it decides:

- The task: the reference, or ``payload_json`` when the reference is empty, is JSON
  ``{"target": int, "numbers": [int, ...]}``; anything else cannot be judged (``bad_reference``).
- The equation: the content of the last ``<answer>...</answer>`` (TinyZero's convention), else the last line of
  the response that holds a digit. ``×`` and ``÷`` are read as ``*`` and ``/``. When it holds ``=``, every side
  that is not just the target is checked (``(6+4)*5 = 50`` checks ``(6+4)*5``); there must be at least one.
- Checking never runs the text: it is parsed with ``ast.parse`` and walked here, allowing only integer
  literals, parentheses and binary ``+ - * /``, computed exactly with ``Fraction``. Unary minus, powers, names,
  calls and anything else make the equation invalid, as do a literal that is not a given number (or is used
  more often than given), division by zero, more than 1000 characters or a literal of more than 12 digits.
  So hostile text is rejected in time linear in its length.
- Value 1 iff the equation is valid and equals the target exactly; component ``valid_equation`` says
  whether it was a well-formed use of the given numbers at all.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeGuard

from services.reward.scorers.base import Score, ScoreInput, ScorerError, register

MAX_EXPRESSION_CHARS = 1000
MAX_LITERAL_DIGITS = 12

# Only these characters may appear; this keeps out names, attributes, strings, and literal spellings such as
# 0x10 or 1_0 that Python would read as a given number.
_ALLOWED = re.compile(r"[\d\s+\-*/()]*")
_LONG_LITERAL = re.compile(rf"\d{{{MAX_LITERAL_DIGITS + 1},}}")
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True)
class CountdownTask:
    target: int
    numbers: tuple[int, ...]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_task(item: ScoreInput) -> CountdownTask:
    """The target and numbers from the reference (or the payload); ``bad_reference`` names what is wrong."""
    source, text = (
        ("reference", item.reference) if item.reference.strip() else ("payload_json", item.payload_json)
    )

    def bad(what: str) -> ScorerError:
        return ScorerError(
            "bad_reference", f"task {item.task_id!r}: countdown {source} {text[:200]!r}: {what}"
        )

    if not text.strip():
        raise ScorerError(
            "bad_reference",
            f"task {item.task_id!r}: countdown needs a reference or payload_json; both are empty",
        )
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise bad('is not a JSON object {"target": int, "numbers": [int, ...]}')
    target, numbers = spec.get("target"), spec.get("numbers")
    if not _is_int(target):
        raise bad(f'"target" must be an integer, got {target!r}')
    if not isinstance(numbers, list) or not numbers or not all(_is_int(n) for n in numbers):
        raise bad(f'"numbers" must be a non-empty list of integers, got {numbers!r}')
    return CountdownTask(target=target, numbers=tuple(numbers))


def equation_text(response: str) -> str | None:
    """The equation the response gives: its last ``<answer>`` tag, else its last line holding a digit."""
    # rfind rather than a regex: a lazy regex over many unclosed "<answer>" tags is quadratic.
    close = response.rfind("</answer>")
    if close >= 0:
        open_ = response.rfind("<answer>", 0, close)
        if open_ >= 0:
            return response[open_ + len("<answer>") : close]
    for line in reversed(response.splitlines()):
        if any(char.isdigit() for char in line):
            return line
    return None


def _evaluate(node: ast.expr, allowed: Counter[int]) -> Fraction | None:
    """The exact value of ``node``, taking its literals out of ``allowed``; None when it is not allowed."""
    if isinstance(node, ast.Constant):
        literal = node.value
        if not _is_int(literal) or allowed[literal] <= 0:
            return None
        allowed[literal] -= 1
        return Fraction(literal)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, allowed)
        right = _evaluate(node.right, allowed) if left is not None else None
        if left is None or right is None or (isinstance(node.op, ast.Div) and right == 0):
            return None
        result: Fraction = _OPERATORS[type(node.op)](left, right)
        return result
    return None


def expression_value(expression: str, allowed: Counter[int]) -> Fraction | None:
    """The value of one side of the equation, or None when it is not a valid use of ``allowed``."""
    expression = expression.strip()
    if (
        not expression
        or len(expression) > MAX_EXPRESSION_CHARS
        or not _ALLOWED.fullmatch(expression)
        or _LONG_LITERAL.search(expression)
    ):
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    # Count literals before walking recursively: an expression can never hold more literals than there
    # are numbers, which bounds the recursion depth (ast.walk itself is iterative).
    literals = sum(isinstance(node, ast.Constant) for node in ast.walk(tree))
    if literals > sum(allowed.values()):
        return None
    try:
        return _evaluate(tree.body, allowed)
    except RecursionError:
        return None


def equation_values(equation: str, task: CountdownTask) -> list[Fraction] | None:
    """The values of the sides of ``equation`` that are not just the target; None when any is invalid."""
    if len(equation) > MAX_EXPRESSION_CHARS:
        return None
    equation = " ".join(equation.replace("×", "*").replace("÷", "/").split())
    sides = [side.strip() for side in equation.split("=")]
    sides = [side for side in sides if side and side != str(task.target)]
    values = []
    for side in sides:
        value = expression_value(side, Counter(task.numbers))
        if value is None:
            return None
        values.append(value)
    return values or None


@register("countdown")
def countdown(item: ScoreInput) -> Score:
    task = parse_task(item)
    equation = equation_text(item.response)
    values = equation_values(equation, task) if equation is not None else None
    if values is None:
        return Score(0.0, {"valid_equation": 0.0})
    reached = all(value == task.target for value in values)
    return Score(1.0 if reached else 0.0, {"valid_equation": 1.0})
