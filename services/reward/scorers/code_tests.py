"""The ``code`` scorer: the response's program, run in the sandbox against the task's tests.

What it decides:

- The program is the last fenced ```python block of the response (a plain ``` block after it is more likely
  its sample output), else the last plain ``` block, else the whole response if it parses as Python; otherwise
  there is nothing to run: value 0 with ``no_code``.
- The reference is either JSON ``{"inputs": [...], "outputs": [...]}`` (stdin/stdout cases, one sandboxed run
  each, outputs compared after stripping trailing whitespace from every line and from the end), or Python test
  code (e.g. asserts) run after the program in the same run. A reference that is empty, or JSON without
  equally long lists of strings, is :class:`ScorerError` ``bad_reference``: the task is broken, not the response.
- Value 1.0 iff every case passes, else 0.0. Components: ``tests_passed`` and ``tests_total``, and
  ``sandbox_<status>`` = 1 for each non-ok sandbox status among failing cases. A wrong answer or an error
  lets the next case run (they are cheap and ``tests_passed`` stays informative); a timeout, a limit or a
  guard violation stops the run there (the rest would cost as much, and the verdict is already 0).
- The sandbox's limits come from :func:`configure`, which the service calls in each scoring worker.
"""

from __future__ import annotations

import ast
import json
import re

from services.common.sandbox import SandboxLimits, SandboxResult, SandboxSetupError, run_python
from services.reward.scorers.base import Score, ScoreInput, ScorerError, register

_FENCE = re.compile(r"```(python3?|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_CHEAP_FAILURES = frozenset({"ok", "error"})

_limits = SandboxLimits()


def configure(limits: SandboxLimits) -> None:
    """Set the sandbox limits this process's ``code`` scorer uses (from the service's ``[reward.sandbox]``)."""
    global _limits
    _limits = limits


def extract_program(response: str) -> str | None:
    """The program in ``response``, or None when it has none.

    Its last ```python block, else its last plain ``` block (a block may be left open at the end of the
    response), else all of it if it parses as Python.
    """
    blocks = [(tag, body) for tag, body in _FENCE.findall(response) if body.strip()]
    tagged = [body for tag, body in blocks if tag]
    if tagged or blocks:
        return (tagged or [body for _, body in blocks])[-1]
    if not response.strip():
        return None
    try:
        ast.parse(response)
    except (SyntaxError, ValueError):
        return None
    return response


def same_output(actual: str, expected: str) -> bool:
    """Outputs compared line by line, ignoring trailing whitespace on each line and at the end."""
    return _normalise(actual) == _normalise(expected)


def _normalise(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _io_cases(reference: dict[str, object], task_id: str) -> list[tuple[str, str]]:
    inputs, outputs = reference.get("inputs"), reference.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ScorerError(
            "bad_reference", f"task {task_id!r}: JSON reference needs 'inputs' and 'outputs' lists"
        )
    if len(inputs) != len(outputs) or not inputs:
        raise ScorerError(
            "bad_reference",
            f"task {task_id!r}: {len(inputs)} inputs and {len(outputs)} outputs (need as many, at least one)",
        )
    for index, (stdin, expected) in enumerate(zip(inputs, outputs, strict=True)):
        if not isinstance(stdin, str) or not isinstance(expected, str):
            raise ScorerError("bad_reference", f"task {task_id!r}: case {index} is not a pair of strings")
    return list(zip(inputs, outputs, strict=True))


def _run(program: str, stdin: str, task_id: str) -> SandboxResult:
    try:
        return run_python(program, stdin, _limits)
    except SandboxSetupError as exc:
        raise ScorerError("sandbox_failed", f"task {task_id!r}: {exc}") from exc


@register("code")
def code_tests(item: ScoreInput) -> Score:
    reference = item.reference.strip()
    if not reference:
        raise ScorerError("bad_reference", f"task {item.task_id!r}: the reference (the tests) is empty")
    try:
        parsed = json.loads(reference)
    except json.JSONDecodeError:
        parsed = None
    if parsed is not None and not isinstance(parsed, dict):
        raise ScorerError("bad_reference", f"task {item.task_id!r}: JSON reference is not an object")
    cases = _io_cases(parsed, item.task_id) if parsed is not None else None
    if cases is None:
        try:
            ast.parse(reference)
        except (SyntaxError, ValueError) as exc:
            raise ScorerError(
                "bad_reference",
                f"task {item.task_id!r}: the reference is neither JSON cases nor Python: {exc}",
            ) from exc
    program = extract_program(item.response)
    if program is None:
        return Score(0.0, {"no_code": 1.0})

    components: dict[str, float] = {}
    if cases is None:  # Python tests, after the program, in one run
        result = _run(program.rstrip() + "\n\n" + reference + "\n", "", item.task_id)
        passed, total = int(result.ok), 1
        if not result.ok:
            components[f"sandbox_{result.status}"] = 1.0
    else:
        passed, total = 0, len(cases)
        for stdin, expected in cases:
            result = _run(program, stdin, item.task_id)
            if result.ok and same_output(result.stdout, expected):
                passed += 1
                continue
            if not result.ok:
                components[f"sandbox_{result.status}"] = 1.0
            if result.status not in _CHEAP_FAILURES:
                break
    components["tests_passed"] = float(passed)
    components["tests_total"] = float(total)
    return Score(1.0 if passed == total else 0.0, components)
