"""The built-in text scorers: exact match, math answer equivalence and Countdown."""

from __future__ import annotations

import json
import time

import pytest

from services.reward.scorers import Score, ScoreInput, ScorerError, get_scorer
from services.reward.scorers.math_answer import gold_answer, last_boxed, response_answer


def score(name: str, response: str, reference: str = "", payload_json: str = "") -> Score:
    item = ScoreInput(response=response, reference=reference, task_id="task-7", payload_json=payload_json)
    return get_scorer(name)(item)


def assert_bad_reference(name: str, reference: str, needle: str, payload_json: str = "") -> None:
    with pytest.raises(ScorerError) as caught:
        score(name, "42", reference, payload_json)
    assert caught.value.reason == "bad_reference"
    assert "task-7" in str(caught.value)
    assert needle in str(caught.value)


# --- exact_match ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "reference", "value"),
    [
        ("Paris", "Paris", 1.0),
        ("  paris \n", "PARIS", 1.0),
        ("New   York\tCity", "new york city", 1.0),
        ("STRASSE", "Straße", 1.0),
        ("paris, france", '["Paris", "Paris, France"]', 1.0),
        ("Lyon", '["Paris", "Paris, France"]', 0.0),
        ("Paris.", "Paris", 0.0),
        ("NewYork", "New York", 0.0),
        ("", "Paris", 0.0),
        ("[citation needed]", "[citation needed]", 1.0),  # starts with "[" but is not JSON: a literal
        ("[1, 2]", '["[1, 2]"]', 1.0),
    ],
)
def test_exact_match(response: str, reference: str, value: float) -> None:
    assert score("exact_match", response, reference).value == value


@pytest.mark.parametrize(
    ("reference", "needle"),
    [("", "empty"), ("   ", "empty"), ("[]", "array"), ('["a", 3]', "array"), ('["a", " "]', "array")],
)
def test_exact_match_bad_reference(reference: str, needle: str) -> None:
    assert_bad_reference("exact_match", reference, needle)


# --- math ----------------------------------------------------------------------------------------------

GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
MATH_REFERENCE = (
    "We have $\\frac{2}{4} = \\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$. "
    "Check: $\\boxed{3}$ was a wrong first try, so the final one is \\boxed{\\dfrac{1}{2}}."
)


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5"),
        ("So we get \\boxed{0.5}", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{1/2}", "0.5"),
        ("\\boxed{2x+1}", "1+2x"),
        ("\\boxed{1,234}", "1234"),
        ("The total is 1,234.", "#### 1234"),
        ("\\boxed{1234}", "#### 1,234"),
        ("She sold 48/2 = 24 clips in May, so 48 + 24 = 72", GSM8K_REFERENCE),
        ("Natalia sold 72 clips. #### 72", GSM8K_REFERENCE),
        ("Adding up, the answer is 72 clips.", GSM8K_REFERENCE),
        ("Answer: 72", "#### 72"),
        ("The answer is $\\frac{1}{2}$.", MATH_REFERENCE),
        ("Halving gives \\boxed{\\frac{1}{2}}", MATH_REFERENCE),
        ("It is 3/4", "\\frac{3}{4}"),
        ("The temperature fell to -5 degrees", "-5"),
        ("So x = 1,234,567", "1234567"),
        ("The answer is \\fbox{\\sqrt{2}}", "\\sqrt{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{\\frac{\\sqrt{3}}{2}}"),
        ("I think it is 2.50", "2.5"),
        ("\\boxed{72} but then I recheck: 73", "72"),  # the box wins over a later number
    ],
)
def test_math_equivalent_answers_score_one(response: str, reference: str) -> None:
    result = score("math", response, reference)
    assert result == Score(1.0, {"extracted": 1.0})


@pytest.mark.parametrize(
    ("response", "reference"),
    [
        ("\\boxed{3}", "4"),
        ("The total is 1,234.", "1243"),
        ("\\boxed{2x+1}", "2x-1"),
        ("She sold 24 clips in May and 71 in all", GSM8K_REFERENCE),
        ("\\boxed{3}", MATH_REFERENCE),  # an earlier box in the reference is not the gold answer
        ("5-3", "-3"),  # subtraction, not a negative number: the last number is 3
    ],
)
def test_math_wrong_answers_score_zero(response: str, reference: str) -> None:
    result = score("math", response, reference)
    assert result == Score(0.0, {"extracted": 1.0})


@pytest.mark.parametrize("response", ["", "I do not know.", "\\boxed{}"])
def test_math_no_answer_scores_zero_not_extracted(response: str) -> None:
    assert score("math", response, "72") == Score(0.0, {"extracted": 0.0})


@pytest.mark.parametrize("reference", ["", "   ", "#### ", "\\boxed{}"])
def test_math_bad_reference(reference: str) -> None:
    assert_bad_reference("math", reference, "could not be parsed")


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("\\boxed{x^{2^{3}}} end", "x^{2^{3}}"),
        ("\\fbox{5}", "5"),
        ("\\boxed{5} and an unclosed \\boxed{6", "5"),
        ("no box", None),
    ],
)
def test_last_boxed_handles_nesting(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("reference", "gold"),
    [
        (GSM8K_REFERENCE, "72"),
        ("Total cost.\n#### 1,234", "1234"),
        (MATH_REFERENCE, "\\dfrac{1}{2}"),
        ("$\\frac{1}{2}$", "\\frac{1}{2}"),
        (" 42 ", "42"),
    ],
)
def test_gold_answer_conventions(reference: str, gold: str) -> None:
    assert gold_answer(reference) == gold


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("blah #### 1,234\nmore", "1234"),
        ("The answer is $x^2$. Then 5.", "x^2"),
        ("The final answer is 42. I hope it is correct.", "42"),
        ("Answer: 2x+1", "2x+1"),
        ("The answer is 72 apples", "72"),
        ("we have 3 and 12 and 1,234,567 total", "1234567"),
        ("ratio 3/4", "3/4"),
        ("so x = -7.5.", "-7.5"),
        ("1,2,3", "3"),
        ("#### \nso the answer is 5", "5"),  # nothing after the hashes: look further
        ("no digits", None),
    ],
)
def test_response_answer_conventions(response: str, answer: str | None) -> None:
    assert response_answer(response) == answer


def test_math_long_hostile_responses_are_fast() -> None:
    started = time.perf_counter()
    for response in ["\\boxed{" * 20_000, "1" * 200_000, "answer is " * 20_000, "1,000" * 20_000]:
        assert score("math", response, "72").value == 0.0
    assert time.perf_counter() - started < 5.0


# --- countdown ----------------------------------------------------------------------------------------
# ``countdown_lenient`` (this system's earlier rule, kept as an option) here; the paper's rule (``countdown``)
# against the seed's own results in tests/test_reward_verl_rules.py

TASK = json.dumps({"target": 50, "numbers": [6, 4, 5, 2]})


@pytest.mark.parametrize(
    ("response", "value", "valid"),
    [
        ("<answer>(6+4)*5</answer>", 1.0, 1.0),
        ("<answer> (6 + 4) * 5 = 50 </answer>", 1.0, 1.0),
        ("<answer>50 = 5*(6+4)</answer>", 1.0, 1.0),
        ("<answer>(6+4)\n*5</answer>", 1.0, 1.0),
        ("Let me think.\n(6+4)*5 = 50\nDone.", 1.0, 1.0),  # no tag: the last line that holds a digit
        ("<answer>1</answer> ... <answer>(6+4)*5</answer>", 1.0, 1.0),  # the last tag counts
        ("<answer>(6 × 4 + 2 - 6) ÷ 2 * 5</answer>", 0.0, 0.0),  # 6 used twice
        ("<answer>(6+4)*5 + 2 - 2</answer>", 0.0, 0.0),  # 2 given once, used twice
        ("<answer>(6+4)*5*1</answer>", 0.0, 0.0),  # 1 is not given
        ("<answer>6*4+5*2</answer>", 0.0, 1.0),  # valid, equals 34
        ("<answer>(6+4)*5 = 51</answer>", 0.0, 0.0),  # 51 is not the target and not a given number
        ("<answer>6/(4-4)</answer>", 0.0, 0.0),
        ("<answer>5/(6-4-2)*50</answer>", 0.0, 0.0),
        ("<answer>-6+4*5</answer>", 0.0, 0.0),  # unary minus
        ("<answer>(6+4)*5**1</answer>", 0.0, 0.0),
        ("<answer>2**999999999</answer>", 0.0, 0.0),
        ("<answer>__import__('os').system('x')</answer>", 0.0, 0.0),
        ("<answer>(6+4)*5 and print(1)</answer>", 0.0, 0.0),
        ("<answer>0x6+4</answer>", 0.0, 0.0),
        ("<answer>(6+4)//2*5</answer>", 0.0, 0.0),
        ("<answer>50</answer>", 0.0, 0.0),  # only the target: nothing to check
        ("<answer></answer>", 0.0, 0.0),
        ("I cannot solve this.", 0.0, 0.0),
        ("<answer>" + "(" * 300 + "6" + ")" * 300 + "</answer>", 0.0, 0.0),
        ("<answer>" + "6+" * 600 + "6</answer>", 0.0, 0.0),
        ("<answer>1234567890123*0+50</answer>", 0.0, 0.0),
    ],
)
def test_countdown_lenient(response: str, value: float, valid: float) -> None:
    assert score("countdown_lenient", response, TASK) == Score(value, {"valid_equation": valid})


def test_countdown_exact_fractions_and_repeated_numbers() -> None:
    task = json.dumps({"target": 24, "numbers": [3, 3, 8, 8]})
    assert score("countdown_lenient", "<answer>8/(3-8/3)</answer>", task).value == 1.0  # 8/(1/3), exactly
    assert score("countdown_lenient", "<answer>8*3</answer>", task).value == 1.0  # need not use all numbers
    assert score("countdown_lenient", "<answer>8/3*3*3</answer>", task).value == 0.0  # 3 given twice, used 3x
    # the paper's rule: every number exactly once, the same exact arithmetic
    assert score("countdown", "\\boxed{8/(3-8/3)}", task).value == 1.0
    assert score("countdown", "<answer>8*3</answer>", task).value == 0.0  # a 3 and an 8 left unused


@pytest.mark.parametrize("scorer", ["countdown", "countdown_lenient"])
def test_countdown_reads_payload_when_reference_is_empty(scorer: str) -> None:
    task = json.dumps({"target": 24, "numbers": [2, 3, 4]})
    assert score(scorer, "<answer>2*3*4</answer>", "", payload_json=task).value == 1.0


@pytest.mark.parametrize("scorer", ["countdown", "countdown_lenient"])
def test_countdown_hostile_input_is_rejected_fast(scorer: str) -> None:
    started = time.perf_counter()
    nines = json.dumps({"target": 50, "numbers": [9, 9, 9, 9]})  # lets the power tower past the number check
    for response, task in [
        ("<answer>9**9**9**9</answer>", nines),
        ("<answer>(9**9)**(9**9)</answer>", nines),
        ("\\boxed{" + "-" * 50_000 + "9*9*9*9}", nines),
        ("(" * 100_000, TASK),
        ("1" * 1_000_000, TASK),
        ("<answer>" * 10_000, TASK),
        ("<answer>" * 10_000 + "</answer>", TASK),
        ("\\boxed{" * 10_000, TASK),
    ]:
        assert score(scorer, response, task).value == 0.0, response[:40]
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    ("reference", "payload", "needle"),
    [
        ("", "", "both are empty"),
        ("not json", "", "not JSON"),
        ("[50, [1, 2]]", "", "not a JSON object"),
        ('{"numbers": [1, 2]}', "", '"target"'),
        ('{"target": "50", "numbers": [1, 2]}', "", '"target"'),
        ('{"target": true, "numbers": [1, 2]}', "", '"target"'),
        ('{"target": 50}', "", '"numbers"'),
        ('{"target": 50, "numbers": []}', "", '"numbers"'),
        ('{"target": 50, "numbers": [1, 2.5]}', "", '"numbers"'),
        ("", "{oops", "payload_json"),
    ],
)
def test_countdown_bad_reference(reference: str, payload: str, needle: str) -> None:
    for scorer in ("countdown", "countdown_lenient"):
        assert_bad_reference(scorer, reference, needle, payload_json=payload)
