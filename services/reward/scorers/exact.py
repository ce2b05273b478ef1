"""The ``exact_match`` scorer: the response is right when it is one of the reference answers, as text.

What it decides:

- Both sides are normalised the same way before comparing: leading and trailing whitespace removed, runs of
  whitespace inside collapsed to one space, case folded (``str.casefold``, so ``"Straße"`` matches
  ``"STRASSE"``). Nothing else is forgiven: punctuation and number formats must match.
- The reference is one answer, or a JSON array of strings that lists several acceptable answers
  (``["Paris", "paris, france"]``); the response needs to match any one. A reference that is a JSON array
  but not a non-empty array of strings, or that is empty, cannot be judged (``bad_reference``): a literal
  answer that looks like a JSON array is written as a one-element array of strings.
"""

from __future__ import annotations

import json

from services.reward.scorers.base import Score, ScoreInput, ScorerError, register


def normalise(text: str) -> str:
    """The form two answers are compared in: stripped, whitespace collapsed, case folded."""
    return " ".join(text.split()).casefold()


def _acceptable(item: ScoreInput) -> list[str]:
    reference = item.reference.strip()
    if not reference:
        raise ScorerError(
            "bad_reference", f"task {item.task_id!r}: exact_match needs a reference; it is empty"
        )
    if not reference.startswith("["):
        return [reference]
    try:
        parsed = json.loads(reference)
    except json.JSONDecodeError:
        return [reference]  # a literal answer that merely starts with "["
    if (
        not isinstance(parsed, list)
        or not parsed
        or not all(isinstance(answer, str) and answer.strip() for answer in parsed)
    ):
        raise ScorerError(
            "bad_reference",
            f"task {item.task_id!r}: exact_match reference {reference[:200]!r} is a JSON array but not a "
            "non-empty array of non-empty strings",
        )
    return parsed


@register("exact_match")
def exact_match(item: ScoreInput) -> Score:
    response = normalise(item.response)
    matched = any(response == normalise(answer) for answer in _acceptable(item))
    return Score(1.0 if matched else 0.0)
