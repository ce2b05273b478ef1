"""The paper's own reward rules, as the authors' code (mit-han-lab/vcpo, built on veRL) scores its datasets.

The seed picks a rule per row by its ``data_source`` (veRL's ``default_compute_score``); a run reproduces
that with ``sampler.scorer_by_source`` = :data:`VERL_SCORERS` (what the paper presets set):

    openai/gsm8k                                     ─► gsm8k       the last "#### <number>" of the response's
                                                                    last 300 characters, commas and $ dropped,
                                                                    equal as a string to the ground truth; 1/0
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, math-500, deepscaler,
    test-math-aime24, test-math-aime25, dapo_filter  ─► math_verl   the last \\boxed{} (or "\\boxed x", \\fbox{}),
                                                                    equal to the ground truth after the
                                                                    Hendrycks MATH normalisation; 1/0
    math_dapo, math, math_dapo_reasoning, aime*      ─► math_dapo   the last "Answer: x" line of the last 300
                                                                    characters, equal after the Minerva
                                                                    normalisation; +1/−1 (the seed's values)
    countdown                                        ─► countdown   (countdown.py: the seed's rule)

Where the seed's ground truth is already the bare answer (its preprocessors extract it), a reference that
holds a whole solution is reduced the way those preprocessors do: GSM8K's text after its last ``####``
(commas dropped), a MATH solution's last ``\\boxed{}``. So a file with full solutions scores as the seed
scores the preprocessed one.

The ``math`` scorer (math_answer.py, math-verify's equivalence with lenient extraction) stays the system's
own; docs/guides/reproducing-the-paper.md says where the two differ. These rules compare strings after
normalisation, so ``0.50`` is not ``\\frac12`` for ``math_verl`` and ``18.00`` is not ``18`` for ``gsm8k``,
exactly as in the seed.
"""

from __future__ import annotations

import re

from services.reward.scorers.base import Score, ScoreInput, ScorerError, register

VERL_SCORERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    **dict.fromkeys(
        (
            "lighteval/MATH",
            "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500",
            "math-500",
            "deepscaler",
            "test-math-aime24",
            "test-math-aime25",
            "dapo_filter",
        ),
        "math_verl",
    ),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning", "aime*"), "math_dapo"),
    "countdown": "countdown",
}
"""veRL's data sources and the scorer of each, as the seed dispatches them (``aime*``: any name that starts
with "aime"; the seed tests the MATH list first, so ``test-math-aime25`` is ``math_verl``)."""

_TAIL_CHARS = 300  # both the GSM8K and the DAPO rule read only the response's last 300 characters
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


# ------------------------------------------------------------------------------------------------ GSM8K


def gsm8k_gold(reference: str) -> str:
    """The ground truth: the reference, or its text after the last ``####`` (commas dropped) when it is a whole
    GSM8K solution, as veRL's preprocessor extracts it."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip().replace(",", "")
    return reference.strip()


def gsm8k_answer(response: str) -> str | None:
    """The seed's strict extraction: the last ``#### <number>`` in the last 300 characters, commas dropped."""
    found = _GSM8K_ANSWER.findall(response[-_TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


@register("gsm8k")
def gsm8k(item: ScoreInput) -> Score:
    gold = gsm8k_gold(item.reference)
    if not gold:
        raise ScorerError(
            "bad_reference", f"task {item.task_id!r}: gsm8k needs a reference answer; it is empty"
        )
    answer = gsm8k_answer(item.response)
    if answer is None:
        return Score(0.0, {"extracted": 0.0})
    return Score(1.0 if answer == gold else 0.0, {"extracted": 1.0})


# ------------------------------------------------------------------------------------------ MATH (Hendrycks)


def last_boxed(text: str) -> str | None:
    """The seed's last boxed expression, box included: ``\\boxed x`` (up to a ``$``) whenever the text has one,
    else the last ``\\boxed{...}`` (or ``\\fbox{...}`` without any ``\\boxed``) to its matching brace."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def unbox(boxed: str) -> str | None:
    """The content of ``\\boxed x`` or ``\\boxed{x}``; None for anything else (the seed's assertion fails there,
    e.g. on ``\\fbox{x}``, and it scores 0)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed ") :] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


def _units_removed(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one unit")  # the seed asserts here; is_equiv falls back to raw equality
    return parts[0]


def _sqrt_braced(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise ValueError("\\sqrt at the end")  # as the seed's index error
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _fracs_braced(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if not part:
            raise IndexError("\\frac at the end")  # as the seed's index error
        if part[0] == "{":
            out.append(part)
            continue
        if len(part) < 2:
            return s  # the seed gives up on the whole string
        a, b, tail = part[0], part[1], part[2:]
        out.append("{" + a + "}" + (b if b == "{" else "{" + b + "}") + tail)
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def hendrycks_normalise(s: str) -> str:
    """The MATH answer normalisation of the seed (lm-eval-harness' Hendrycks MATH ``strip_string``). Raises
    where the seed's raises (then the two strings are compared as they are)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        s = s.replace(old, new)
    s = _units_removed(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> " 3"
        s = sides[1]
    s = _sqrt_braced(s).replace(" ", "")
    s = _fracs_braced(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def hendrycks_equal(a: str, b: str) -> bool:
    try:
        return hendrycks_normalise(a) == hendrycks_normalise(b)
    except (ValueError, IndexError):
        return a == b


def math_gold(reference: str) -> str:
    """The ground truth: the reference, or the content of its last box when it is a whole MATH solution."""
    if "\\boxed" in reference:
        boxed = last_boxed(reference)
        inner = unbox(boxed) if boxed is not None else None
        if inner is not None:
            return inner
    return reference


@register("math_verl")
def math_verl(item: ScoreInput) -> Score:
    gold = math_gold(item.reference)
    if not gold.strip():
        raise ScorerError("bad_reference", f"task {item.task_id!r}: math_verl needs a reference; it is empty")
    boxed = last_boxed(item.response)
    answer = unbox(boxed) if boxed is not None else None
    if answer is None:
        return Score(0.0, {"extracted": 0.0})
    return Score(1.0 if hendrycks_equal(answer, gold) else 0.0, {"extracted": 1.0})


# ------------------------------------------------------------------------------------------- DAPO (Minerva)

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_LATEX_SPAN = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP = tuple(
    re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})")
)
_UNBOX_GREEDY = re.compile(r"(\\boxed\{)(.*)(\})")
_FRAC_SHORT = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORT = re.compile(r"(sqrt)([^{])")


def minerva_normalise(answer: str) -> str:
    """The final-answer normalisation of the seed's DAPO rule (Minerva's): the text after the last ``=``,
    words and units removed, LaTeX wrappers unwrapped, shorthand ``\\frac12``/``\\sqrt2`` braced."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in _REMOVED:
        answer = answer.replace(removed, "")
    answer = _LATEX_SPAN.sub("$\\3$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub("\\2", answer)
    answer = _UNBOX_GREEDY.sub("\\2", answer)
    answer = _FRAC_SHORT.sub("frac{\\2}{\\3}", answer)
    answer = _SQRT_SHORT.sub("sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


@register("math_dapo")
def math_dapo(item: ScoreInput) -> Score:
    if not item.reference.strip():
        raise ScorerError("bad_reference", f"task {item.task_id!r}: math_dapo needs a reference; it is empty")
    found = _DAPO_ANSWER.findall(item.response[-_TAIL_CHARS:])
    answer = minerva_normalise(found[-1] if found else "[INVALID]")
    correct = answer == minerva_normalise(item.reference)
    return Score(1.0 if correct else -1.0, {"extracted": float(bool(found)), "correct": float(correct)})
