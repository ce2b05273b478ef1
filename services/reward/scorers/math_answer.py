"""The ``math`` scorer: is the response's final answer mathematically equal to the reference's?

Equivalence is ``math-verify``'s (``\\frac{1}{2}`` equals ``0.5``, ``2x+1`` equals ``1+2x``); this module
decides which part of each text is *the answer*, following the GSM8K and MATH conventions.

- The gold answer: after the last ``####`` (GSM8K), else the content of the last ``\\boxed{}`` or ``\\fbox{}``
  (MATH solutions), else the whole reference. A reference that yields nothing math-verify can parse cannot be
  judged (``bad_reference``).
- The response's answer: the last ``\\boxed{}``/``\\fbox{}``, else the text after the last ``####``, else the
  last "answer is X" / "Answer: X" phrase (to the end of its line), else the last number in the text
  (integers, decimals, negatives, fractions ``3/4``; ``1,234,567`` is one number). No answer found, or one
  math-verify cannot parse, is a wrong answer (value 0, component ``extracted`` 0), not an error.
- Thousands separators in a plain number are dropped before parsing (``1,234`` is ``1234``), and the answer
  is handed to math-verify as inline LaTeX (``$...$``), which parses plain numbers and expressions as well.
- math-verify's own timeouts use ``signal.alarm``, which fails outside a process's main thread, so they are
  switched off (``parsing_timeout=None``, ``timeout_seconds=None``); the scoring pool enforces the time limit
  from outside.
"""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

from services.reward.scorers.base import Score, ScoreInput, ScorerError, register

# math-verify warns (once per process) that its timeouts are off; that is deliberate here, see above.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_ANSWER_PHRASE = re.compile(r"(?i)\banswer(?:\s+is\s*:?|\s*:)[ \t]*([^\n]+)")
# A number not preceded by a digit, dot or letter (so "x2" and the "3" of "1.3" are not numbers); a minus
# counts only when it is not a subtraction ("5-3" ends in 3, "= -3" ends in -3).
_NUMBER = re.compile(
    r"(?:(?<![\w.)\]}])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
)
_MATH_SPAN = re.compile(r"\$+(?P<dollars>[^$]+)\$|\\\((?P<parens>.+?)\\\)")
# "72 apples" -> "72", but "2x+1" stays an expression: the number must end at a space, punctuation or the end.
_LEADING_NUMBER = re.compile(r"\$?(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?)(?=\s|[.,;:!?)]|$)")
_SENTENCE_END = re.compile(r"(?<!\d)\.(?!\d)|[;!?]|\.\s")
_PLAIN_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_MAX_ANSWER_CHARS = 1000


def last_boxed(text: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, braces nested."""
    box_starts = {match.end() for match in _BOX.finditer(text)}
    if not box_starts:
        return None
    # One pass over the braces, so many unclosed boxes cost linear time, not quadratic.
    open_braces: list[int] = []
    last: tuple[int, int] | None = None
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            open_braces.append(brace.end())
        elif open_braces:
            start = open_braces.pop()
            if start in box_starts and (last is None or start > last[0]):
                last = (start, brace.start())
    return text[last[0] : last[1]] if last is not None else None


def _after_hashes(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K puts the answer there), or None without one."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].split("\n", 1)[0].strip()


def _clean(answer: str) -> str:
    """Strip the delimiters and sentence punctuation around an answer; drop thousands separators."""
    answer = answer.strip().rstrip(".").strip()
    stripped = True
    while stripped:
        stripped = False
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
                answer = answer[len(left) : len(answer) - len(right)].strip()
                stripped = True
    if _PLAIN_NUMBER.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def _phrase_answer(phrase: str) -> str:
    """The answer in "the answer is ...": a leading math span, else a leading number, else the sentence."""
    phrase = phrase.strip()
    span = _MATH_SPAN.match(phrase)
    if span is not None:
        return _clean(span.group("dollars") or span.group("parens") or "")
    number = _LEADING_NUMBER.match(phrase)
    if number is not None:
        return _clean(number.group(1))
    return _clean(_SENTENCE_END.split(phrase, maxsplit=1)[0])


def gold_answer(reference: str) -> str:
    """The reference's answer text: after the last ``####``, else the last boxed, else all of it."""
    hashed = _after_hashes(reference)
    if hashed is not None:
        return _clean(hashed)
    boxed = last_boxed(reference)
    return _clean(boxed if boxed is not None else reference)


def response_answer(response: str) -> str | None:
    """The response's final answer text, or None when it states none (see the module docstring)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return _clean(boxed)
    hashed = _after_hashes(response)
    if hashed:
        return _clean(hashed)
    phrases = _ANSWER_PHRASE.findall(response)
    if phrases:
        return _phrase_answer(phrases[-1])
    numbers = _NUMBER.findall(response)
    if numbers:
        return _clean(numbers[-1])
    return None


def _parse(answer: str) -> list[object]:
    if not answer or len(answer) > _MAX_ANSWER_CHARS:
        return []
    return list(parse(f"${answer}$", parsing_timeout=None))


@register("math")
def math_answer(item: ScoreInput) -> Score:
    gold_text = gold_answer(item.reference)
    gold = _parse(gold_text)
    if not gold:
        raise ScorerError(
            "bad_reference",
            f"task {item.task_id!r}: math reference answer {gold_text[:200]!r} (from reference "
            f"{item.reference[:200]!r}) could not be parsed as math",
        )
    answer = response_answer(item.response)
    parsed = _parse(answer) if answer is not None else []
    if not parsed:
        return Score(0.0, {"extracted": 0.0})
    correct = verify(gold, parsed, timeout_seconds=None)
    return Score(1.0 if correct else 0.0, {"extracted": 1.0})
