"""The Countdown scorers: does the response's equation reach the target from the given numbers?

The Countdown game (TinyZero's task): given ``numbers`` and a ``target``, write an arithmetic expression with
``+ - * /`` and parentheses that equals the target.

The task (both scorers): the reference, or ``payload_json`` when the reference is empty, is JSON
``{"target": int, "numbers": [int, ...]}`` (``target_number`` and ``nums`` are read too, as the seed reads
them); anything else cannot be judged (``bad_reference``).

``countdown`` is the paper's rule, as the authors' code (mit-han-lab/vcpo ``countdown.py``) scores:

- The equation: text before the response's first ``Assistant:`` (or ``<|im_start|>assistant``) is dropped;
  then the last ``\\boxed{...}`` (no nested braces: it ends at the first ``}``), else the last
  ``<answer>...</answer>`` within one line; neither is reward 0.
- It must use every given number exactly once: the integers in it (every run of digits) are, as a multiset,
  the given numbers; it may hold only digits, ``+ - * / ( ) .`` and white space (so ``=`` is not allowed).
- Value 1 iff its value is within 1e-5 of the target, else 0 (the seed's format score, 0 by default).
- The seed evaluates with ``eval``; here it is parsed with ``ast.parse`` and computed exactly with ``Fraction``
  (``+ - * / // **``, unary signs, decimal literals: what the seed's character set lets through), bounded: at
  most 1000 characters, literals of at most 12 digits, exponents of at most 64 and results of at most 1000
  digits, so hostile text is rejected in time linear in its length.

``countdown_lenient`` is this system's earlier rule, kept as an explicit option:

- The equation: the content of the last ``<answer>...</answer>``, else the last line of the response that holds
  a digit. ``×`` and ``÷`` are read as ``*`` and ``/``. When it holds ``=``, every side that is not just the
  target is checked (``(6+4)*5 = 50`` checks ``(6+4)*5``); there must be at least one.
- Integer literals, parentheses and binary ``+ - * /`` only; each given number at most as often as it is given
  (numbers may be left unused); exact equality with the target.

Both: component ``valid_equation`` says whether the response held a well-formed use of the numbers at all.
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
    target = spec.get("target") if spec.get("target") is not None else spec.get("target_number")
    numbers = spec.get("numbers") if spec.get("numbers") is not None else spec.get("nums")
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


@register("countdown_lenient")
def countdown_lenient(item: ScoreInput) -> Score:
    task = parse_task(item)
    equation = equation_text(item.response)
    values = equation_values(equation, task) if equation is not None else None
    if values is None:
        return Score(0.0, {"valid_equation": 0.0})
    reached = all(value == task.target for value in values)
    return Score(1.0 if reached else 0.0, {"valid_equation": 1.0})


# ------------------------------------------------------------------------------------ the paper's rule

_SEED_CHARS = re.compile(r"[\d+\-*/().\s]+")
_DIGITS = re.compile(r"\d+")
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 1000
TOLERANCE = Fraction(1, 100000)


def _last_enclosed(text: str, opening: str, closing: str) -> str | None:
    """What the last of the non-overlapping ``opening ... closing`` spans of ``text`` encloses, each closing at
    the first ``closing`` after its opening (a lazy regex's matches, found with str.find: linear, however many
    unclosed openings there are)."""
    last, at = None, 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        last, at = text[start + len(opening) : end], end + len(closing)
    return last


def seed_equation(response: str) -> str | None:
    """The equation as the seed extracts it: after the first ``Assistant:``, the last flat ``\\boxed{}``, else the
    last ``<answer>...</answer>`` that opens and closes on one line; None without either."""
    for marker in ("Assistant:", "<|im_start|>assistant"):
        if marker in response:
            response = response.split(marker, 1)[1]
            break
    last = _last_enclosed(response, "\\boxed{", "}")  # the seed's \\boxed\{([^}]*)\}
    if last is None:  # the seed's <answer>(.*?)</answer>, whose "." stops at a line's end
        tags = (_last_enclosed(line, "<answer>", "</answer>") for line in response.split("\n"))
        last = next((tag for tag in reversed(list(tags)) if tag is not None), None)
    return last.strip() if last is not None else None


def _seed_value(node: ast.expr) -> Fraction | None:
    """The exact value of the seed's arithmetic, or None where the seed's eval fails (or would be unbounded)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return Fraction(value) if isinstance(value, int) else Fraction(repr(value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        inner = _seed_value(node.operand)
        return None if inner is None else (inner if isinstance(node.op, ast.UAdd) else -inner)
    if not isinstance(node, ast.BinOp):
        return None
    left = _seed_value(node.left)
    right = _seed_value(node.right) if left is not None else None
    if left is None or right is None:
        return None
    op = node.op
    if isinstance(op, ast.Div | ast.FloorDiv) and right == 0:
        return None
    if type(op) in _OPERATORS:  # + - * /, as the lenient rule computes them
        result: Fraction = _OPERATORS[type(op)](left, right)
    elif isinstance(op, ast.FloorDiv):
        result = Fraction(left // right)
    elif isinstance(op, ast.Pow):
        # an integer exponent is exact; a fractional one (a root) is left out, as are huge powers
        if right.denominator != 1 or abs(right) > MAX_EXPONENT or (left == 0 and right < 0):
            return None
        result = left ** int(right)
    else:
        return None
    if max(len(str(result.numerator)), len(str(result.denominator))) > MAX_RESULT_DIGITS:
        return None
    return result


def seed_uses_every_number_once(equation: str, numbers: tuple[int, ...]) -> bool:
    found = _DIGITS.findall(equation)
    if any(len(n) > MAX_LITERAL_DIGITS for n in found):
        return False
    return sorted(int(n) for n in found) == sorted(numbers)


def seed_value(equation: str) -> Fraction | None:
    if len(equation) > MAX_EXPRESSION_CHARS or not _SEED_CHARS.fullmatch(equation):
        return None
    try:
        tree = ast.parse(equation.strip(), mode="eval")
        return _seed_value(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError, ZeroDivisionError):
        return None


@register("countdown")
def countdown(item: ScoreInput) -> Score:
    task = parse_task(item)
    equation = seed_equation(item.response)
    if equation is None or not seed_uses_every_number_once(equation, task.numbers):
        return Score(0.0, {"valid_equation": 0.0})
    value = seed_value(equation)
    if value is None:
        return Score(0.0, {"valid_equation": 0.0})
    return Score(1.0 if abs(value - task.target) < TOLERANCE else 0.0, {"valid_equation": 1.0})
