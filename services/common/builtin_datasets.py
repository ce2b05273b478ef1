"""The builtin datasets (``builtin:<name>``): small task sets generated from a seed, for runs with no data.

- ``builtin:arith`` is generated from the seed: 2000 distinct ``a+b`` / ``a-b`` problems for ``train`` and
  200 more for the held-out split (``test``, ``eval`` or ``eval:<name>``), disjoint from the train ones.
- ``builtin:digit_add`` is single-digit addition (``What is 3+4?`` -> ``7``): the 100 problems in a seeded
  order, the first 80 ``train``, the last 20 held out. It exists for the tiny built-in model, which after a
  short supervised warm start answers it in the right format with modest accuracy and then learns it with RL
  in minutes on a CPU; on ``builtin:arith`` a randomly initialised model earns reward 0 everywhere, so RL has
  nothing to learn from. The tiny model learns digit_add's train problems by heart: its held-out ones do not
  improve.
- ``builtin:tail_add`` is the sum of a number's last two digits (``... of 4729?`` -> ``11``): 2000 train and
  200 held-out numbers of 3-4 digits. Held-out numbers are unseen but made of the same digit-pair sums, so RL
  on the train split raises held-out accuracy too (what the local preset's evaluation shows).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

TRAIN_SPLIT = "train"
HELD_OUT_SPLITS = ("test", "eval")
"""Split names that select a builtin dataset's held-out rows (``eval:<name>`` too)."""

ARITH_TRAIN_SIZE = 2000
ARITH_TEST_SIZE = 200
_ARITH_MAX_OPERAND = 99
_ARITH_OPS = "+-"
DIGIT_ADD_TEST_SIZE = 20
"""Held-out problems of ``builtin:digit_add``; the other 80 of the 100 are the train split."""


RowGenerator = Callable[[str, int], Iterator[dict[str, Any]]]
"""A builtin dataset: ``(split, seed) -> rows`` with ``id``, ``prompt`` and ``answer`` fields."""


def _is_held_out(split: str) -> bool:
    if split == TRAIN_SPLIT:
        return False
    if split in HELD_OUT_SPLITS or split.startswith("eval:"):
        return True
    raise ValueError(
        f"unknown split {split!r} for a builtin dataset; use {TRAIN_SPLIT!r} or a held-out split: "
        f"{', '.join(repr(s) for s in HELD_OUT_SPLITS)} or 'eval:<name>'"
    )


def arith_rows(split: str, seed: int) -> Iterator[dict[str, Any]]:
    """Single-step ``a+b`` / ``a-b`` problems (``a, b`` in 0..99), deterministic from ``seed``.

    One seeded draw of distinct problems is cut in two: the first ``ARITH_TRAIN_SIZE`` are ``train``, the
    next ``ARITH_TEST_SIZE`` the held-out split, so the two never share a problem.
    """
    held_out = _is_held_out(split)
    operands = _ARITH_MAX_OPERAND + 1
    space = operands * len(_ARITH_OPS) * operands
    drawn = random.Random(seed).sample(range(space), ARITH_TRAIN_SIZE + ARITH_TEST_SIZE)
    chosen = drawn[ARITH_TRAIN_SIZE:] if held_out else drawn[:ARITH_TRAIN_SIZE]
    prefix = "arith:test" if held_out else "arith"
    for i, code in enumerate(chosen):
        a, rest = divmod(code, len(_ARITH_OPS) * operands)
        op_index, b = divmod(rest, operands)
        op = _ARITH_OPS[op_index]
        result = a + b if op == "+" else a - b
        yield {"id": f"{prefix}:{i}", "prompt": f"What is {a}{op}{b}?", "answer": str(result)}


def digit_add_rows(split: str, seed: int) -> Iterator[dict[str, Any]]:
    """Single-digit addition ``a+b`` (``a, b`` in 0..9, answers 0..18), deterministic from ``seed``.

    The 100 problems in one seeded order are cut in two: the last ``DIGIT_ADD_TEST_SIZE`` are the held-out
    split, the rest ``train``, so the two never share a problem.
    """
    held_out = _is_held_out(split)
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(problems)
    cut = len(problems) - DIGIT_ADD_TEST_SIZE
    chosen = problems[cut:] if held_out else problems[:cut]
    prefix = "digit_add:test" if held_out else "digit_add"
    for i, (a, b) in enumerate(chosen):
        yield {"id": f"{prefix}:{i}", "prompt": f"What is {a}+{b}?", "answer": str(a + b)}


TAIL_ADD_TRAIN_SIZE = 2000
TAIL_ADD_TEST_SIZE = 200


def tail_add_rows(split: str, seed: int) -> Iterator[dict[str, Any]]:
    """The sum of a number's last two digits (``What is the sum of the last two digits of 4729?`` -> ``11``),
    numbers of 3 or 4 digits, deterministic from ``seed``. One seeded draw of distinct numbers is cut in two:
    ``TAIL_ADD_TRAIN_SIZE`` train, ``TAIL_ADD_TEST_SIZE`` held out. Held-out numbers are unseen, but they are
    built from the same 100 digit-pair sums as the train ones, so what RL teaches on the train numbers carries
    over to them (on ``digit_add`` each held-out problem is a fact never trained, which a tiny model does not
    infer)."""
    held_out = _is_held_out(split)
    drawn = random.Random(seed).sample(range(100, 10_000), TAIL_ADD_TRAIN_SIZE + TAIL_ADD_TEST_SIZE)
    chosen = drawn[TAIL_ADD_TRAIN_SIZE:] if held_out else drawn[:TAIL_ADD_TRAIN_SIZE]
    prefix = "tail_add:test" if held_out else "tail_add"
    for i, number in enumerate(chosen):
        answer = number % 10 + number // 10 % 10
        yield {
            "id": f"{prefix}:{i}",
            "prompt": f"What is the sum of the last two digits of {number}?",
            "answer": str(answer),
        }


BUILTIN_DATASETS: dict[str, RowGenerator] = {
    "arith": arith_rows,
    "digit_add": digit_add_rows,
    "tail_add": tail_add_rows,
}
