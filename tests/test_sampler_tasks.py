"""Sampler tasks: dataset files and builtins become Tasks, the shuffled epoch order, prompt encoding."""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from services.common.builtin_datasets import (
    ARITH_TEST_SIZE,
    ARITH_TRAIN_SIZE,
    BUILTIN_DATASETS,
    DIGIT_ADD_TEST_SIZE,
    TAIL_ADD_TEST_SIZE,
    TAIL_ADD_TRAIN_SIZE,
)
from services.common.datasets import load_dataset
from services.common.prompts import PromptEncoder, TaskError
from services.common.tiny_model import build_tokenizer
from services.sampler.tasks import DatasetTasks
from vcpo.v1 import common_pb2, rollout_pb2

ROWS: list[dict[str, Any]] = [
    {"prompt": "What is 1+2?", "answer": 3, "difficulty": "easy", "weight": 0.5},
    {"prompt": "What is 5-7?", "answer": -2, "difficulty": None, "tags": ["a", "b"]},
    {"prompt": "Say hi.", "source": "manual", "flag": True},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _task(task_id: str = "t:0", prompt: str = "What is 1+2?", **kwargs: Any) -> rollout_pb2.Task:
    return rollout_pb2.Task(task_id=task_id, prompt=prompt, **kwargs)


def _check_rows(tasks: list[rollout_pb2.Task], stem: str, split: str = "train") -> None:
    assert [t.task_id for t in tasks] == [f"{stem}:0", f"{stem}:1", f"{stem}:2"]
    assert [t.prompt for t in tasks] == ["What is 1+2?", "What is 5-7?", "Say hi."]
    assert [t.reference for t in tasks] == ["3", "-2", ""]
    assert {t.split for t in tasks} == {split}
    assert dict(tasks[0].metadata) == {"difficulty": "easy", "weight": "0.5"}
    assert dict(tasks[1].metadata) == {"tags": '["a", "b"]'}  # None left out, lists as JSON
    assert dict(tasks[2].metadata) == {"source": "manual", "flag": "True"}
    assert not any(t.messages for t in tasks)


# ------------------------------------------------------------------------------------------- loading


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", ROWS)
    path.write_text(path.read_text() + "\n   \n")  # blank lines are skipped
    _check_rows(load_dataset(str(path), split="eval:mine"), "data", split="eval:mine")


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    columns = {key: [row.get(key) for row in ROWS] for row in ROWS for key in row}
    pq.write_table(pa.Table.from_pydict(columns), path)  # from_pylist takes the columns of row 0 only
    _check_rows(load_dataset(str(path)), "data")


def test_parquet_messages_and_ids(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "chat.parquet"
    rows = [{"id": 7, "q": [{"role": "user", "content": "hi"}], "a": "hello"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    (task,) = load_dataset(str(path), prompt_field="q", answer_field="a")
    assert task.task_id == "7"
    assert [(m.role, m.content) for m in task.messages] == [("user", "hi")]
    assert task.reference == "hello"


def test_messages_list_prompt_fills_messages(tmp_path: Path) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"question": conversation, "solution": {"x": 4}}])
    (task,) = load_dataset(str(path), prompt_field="question", answer_field="solution")
    assert task.prompt == ""
    assert list(task.messages) == [common_pb2.ChatMessage(**m) for m in conversation]
    assert json.loads(task.reference) == {"x": 4}
    assert not task.metadata


def test_id_columns_give_the_task_id(tmp_path: Path) -> None:
    rows = [
        {"id": 17, "prompt": "a"},
        {"task_id": "q-2", "id": "ignored", "prompt": "b"},
        {"id": None, "prompt": "c"},
        {"id": "", "prompt": "d"},
    ]
    tasks = load_dataset(str(_write_jsonl(tmp_path / "ids.jsonl", rows)))
    assert [t.task_id for t in tasks] == ["17", "q-2", "ids:2", "ids:3"]
    assert all(not t.metadata for t in tasks)  # id columns are not metadata


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dataset file .*nope\.jsonl.* does not exist"):
        load_dataset(str(tmp_path / "nope.jsonl"))


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"data\.csv.*unknown extension '\.csv'.*\.jsonl or \.parquet"):
        load_dataset(str(path))


def test_unknown_builtin_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown builtin dataset 'nope'.*known: arith"):
        load_dataset("builtin:nope")


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    with pytest.raises(TaskError, match=r"bad\.jsonl line 3: malformed JSON") as info:
        load_dataset(str(path))
    assert (info.value.reason, info.value.task_id) == ("bad_row", "bad:1")


def test_non_object_json_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "list.jsonl", [["What is 1+1?"]])
    with pytest.raises(ValueError, match=r"list\.jsonl line 1: expected a JSON object, got list"):
        load_dataset(str(path))


def test_missing_prompt_field_names_row_and_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "a"}, {"question": "b", "answer": "c"}])
    with pytest.raises(
        TaskError, match=r"data\.jsonl line 2: no 'prompt' field \(fields: question, answer\)"
    ) as info:
        load_dataset(str(path))
    assert info.value.reason == "bad_row"


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (42, r"field 'prompt' must be a string or a list of \{role, content\} messages, got int"),
        ([{"role": "user"}], r"field 'prompt' message 0 must be a \{role, content\} object of strings"),
        (["hi"], r"field 'prompt' message 0 must be .*, got 'hi'"),
    ],
)
def test_bad_prompt_values(tmp_path: Path, prompt: Any, match: str) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": prompt}])
    with pytest.raises(TaskError, match=r"data\.jsonl line 1: " + match):
        load_dataset(str(path))


def test_unreadable_parquet(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"broken\.parquet: cannot read it as parquet"):
        load_dataset(str(path))


def test_parquet_without_a_reader_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"data\.parquet: reading parquet needs pyarrow; install pyarrow"):
        load_dataset(str(path))


# ------------------------------------------------------------------------------------------ builtins


def test_builtin_arith_train_and_test_are_disjoint() -> None:
    assert "arith" in BUILTIN_DATASETS
    train = load_dataset("builtin:arith")
    test = load_dataset("builtin:arith", split="test")
    assert len(train) == ARITH_TRAIN_SIZE == 2000
    assert len(test) == ARITH_TEST_SIZE == 200
    assert len({t.prompt for t in train}) == len(train)
    assert len({t.prompt for t in test}) == len(test)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert train[0].task_id == "arith:0" and {t.split for t in train} == {"train"}
    assert {t.split for t in test} == {"test"}
    # the held-out rows are the same whichever held-out name asks for them
    assert [t.prompt for t in load_dataset("builtin:arith", split="eval:arith")] == [t.prompt for t in test]


def test_builtin_arith_answers_are_right() -> None:
    tasks = load_dataset("builtin:arith", seed=3)
    ops: Counter[str] = Counter()
    for task in tasks:
        question = task.prompt.removeprefix("What is ").removesuffix("?")
        op = "+" if "+" in question else "-"
        a, b = (int(x) for x in question.split(op))
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert task.reference == str(a + b if op == "+" else a - b)
        ops[op] += 1
    assert ops["+"] > 500 and ops["-"] > 500


def test_builtin_arith_is_deterministic_from_the_seed() -> None:
    assert load_dataset("builtin:arith", seed=1) == load_dataset("builtin:arith", seed=1)
    assert load_dataset("builtin:arith", split="test", seed=1) == load_dataset(
        "builtin:arith", split="test", seed=1
    )
    assert [t.prompt for t in load_dataset("builtin:arith", seed=1)] != [
        t.prompt for t in load_dataset("builtin:arith", seed=2)
    ]


def test_builtin_digit_add_splits_cover_all_100_problems_once() -> None:
    assert "digit_add" in BUILTIN_DATASETS
    train = load_dataset("builtin:digit_add")
    test = load_dataset("builtin:digit_add", split="test")
    assert (len(train), len(test)) == (100 - DIGIT_ADD_TEST_SIZE, DIGIT_ADD_TEST_SIZE) == (80, 20)
    everything = {t.prompt for t in train} | {t.prompt for t in test}
    assert everything == {f"What is {a}+{b}?" for a in range(10) for b in range(10)}  # disjoint, complete
    assert train[0].task_id == "digit_add:0" and test[0].task_id == "digit_add:test:0"
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert [t.prompt for t in load_dataset("builtin:digit_add", split="eval:x")] == [t.prompt for t in test]


def test_builtin_digit_add_answers_are_right() -> None:
    for task in load_dataset("builtin:digit_add", seed=3) + load_dataset(
        "builtin:digit_add", split="test", seed=3
    ):
        a, b = (int(x) for x in task.prompt.removeprefix("What is ").removesuffix("?").split("+"))
        assert 0 <= a <= 9 and 0 <= b <= 9 and task.reference == str(a + b)


def test_builtin_digit_add_is_deterministic_from_the_seed() -> None:
    assert load_dataset("builtin:digit_add", seed=1) == load_dataset("builtin:digit_add", seed=1)
    one, two = load_dataset("builtin:digit_add", seed=1), load_dataset("builtin:digit_add", seed=2)
    assert [t.prompt for t in one] != [t.prompt for t in two]  # another order and another held-out cut


def test_builtin_tail_add_splits_are_disjoint_and_right() -> None:
    train, test = load_dataset("builtin:tail_add"), load_dataset("builtin:tail_add", split="test")
    assert (len(train), len(test)) == (TAIL_ADD_TRAIN_SIZE, TAIL_ADD_TEST_SIZE) == (2000, 200)
    assert not {t.prompt for t in train} & {t.prompt for t in test}  # held-out numbers are unseen
    assert train[0].task_id == "tail_add:0" and test[0].task_id == "tail_add:test:0"
    for task in train + test:
        number = task.prompt.removeprefix("What is the sum of the last two digits of ").removesuffix("?")
        assert 100 <= int(number) <= 9999 and task.reference == str(int(number[-1]) + int(number[-2]))
    # the held-out numbers use the digit-pair sums the train numbers teach
    pairs = {t.prompt[-3:-1] for t in train}
    assert {t.prompt[-3:-1] for t in test} <= pairs
    assert load_dataset("builtin:tail_add", seed=4) != load_dataset("builtin:tail_add", seed=5)


def test_builtin_unknown_split() -> None:
    with pytest.raises(ValueError, match=r"unknown split 'validation'.*'train'.*'test', 'eval'"):
        load_dataset("builtin:arith", split="validation")


# ---------------------------------------------------------------------------------------- task order


def test_each_epoch_covers_every_task_once_and_reshuffles() -> None:
    tasks = [_task(f"t:{i}") for i in range(50)]
    order = DatasetTasks(tasks, seed=5)
    assert len(order) == 50 and order.epoch == 0
    epochs = []
    for epoch in range(3):
        ids = [order.next().task_id for _ in range(50)]
        assert order.epoch == epoch
        assert sorted(ids) == sorted(t.task_id for t in tasks)
        epochs.append(ids)
    assert epochs[0] != epochs[1] != epochs[2]
    next(order)
    assert order.epoch == 3
    # the same seed gives the same sequence
    again = DatasetTasks(tasks, seed=5)
    assert [again.next().task_id for _ in range(100)] == epochs[0] + epochs[1]
    assert [t.task_id for t in _take(DatasetTasks(tasks, seed=6), 50)] != epochs[0]


def _take(order: DatasetTasks, n: int) -> list[rollout_pb2.Task]:
    return [order.next() for _ in range(n)]


def test_get_by_id_and_returned_tasks_are_copies() -> None:
    order = DatasetTasks([_task("a", "first"), _task("b", "second")])
    found = order.get("b")
    assert found is not None and found.prompt == "second"
    assert order.get("c") is None
    found.prompt = "changed"
    order.next().prompt = "changed too"
    assert {order.get("a").prompt, order.get("b").prompt} == {"first", "second"}  # type: ignore[union-attr]


def test_duplicate_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"duplicate task_id 'x' \(at indices 0 and 2\)"):
        DatasetTasks([_task("x"), _task("y"), _task("x")])


def test_empty_dataset_and_empty_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one task"):
        DatasetTasks([])
    with pytest.raises(ValueError, match="task at index 1 has an empty task_id"):
        DatasetTasks([_task("a"), _task("")])


def test_dataset_tasks_over_a_loaded_builtin() -> None:
    order = DatasetTasks(load_dataset("builtin:arith", split="test"), seed=0)
    assert len({t.task_id for t in _take(order, ARITH_TEST_SIZE)}) == ARITH_TEST_SIZE


# ------------------------------------------------------------------------------------------- encoding


def test_encode_equals_the_chat_template(tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=256, max_tokens=32)
    tokens = encoder.encode(_task(prompt="What is 12+30?"))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+30?"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert tokens == list(expected)
    assert all(type(t) is int for t in tokens)
    text = tokenizer.decode(tokens)
    assert text == "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"


def test_encode_with_system_prompt_and_messages(tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=256, max_tokens=32, system_prompt="Be brief.")
    assert tokenizer.decode(encoder.encode(_task(prompt="hi"))) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    conversation = [common_pb2.ChatMessage(role="user", content="2+2?")]
    task = _task(prompt="", messages=conversation)
    # messages are used as they are: no system prompt added, an empty prompt is fine
    assert tokenizer.decode(encoder.encode(task)) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_empty_prompt(tokenizer, prompt: str) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=256, max_tokens=32)
    with pytest.raises(TaskError, match=r"task 'e:1': the prompt is empty") as info:
        encoder.encode(_task("e:1", prompt))
    assert (info.value.reason, info.value.task_id) == ("empty_prompt", "e:1")


def test_too_long_prompt(tokenizer) -> None:
    task = _task("long:0", "What is 1+2?")
    prompt_len = len(PromptEncoder(tokenizer, max_model_len=1024, max_tokens=8).encode(task))
    # exactly one token of room is enough ...
    assert (
        len(PromptEncoder(tokenizer, max_model_len=prompt_len + 1, max_tokens=8).encode(task)) == prompt_len
    )
    # ... none is not
    encoder = PromptEncoder(tokenizer, max_model_len=prompt_len, max_tokens=8)
    with pytest.raises(
        TaskError,
        match=rf"task 'long:0': the prompt is {prompt_len} tokens; max_model_len={prompt_len} leaves no room",
    ) as info:
        encoder.encode(task)
    assert info.value.reason == "prompt_too_long"


def test_response_budget(tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=100, max_tokens=30)
    assert encoder.response_budget(10) == 30
    assert encoder.response_budget(70) == 30
    assert encoder.response_budget(80) == 20
    assert encoder.response_budget(99) == 1
    assert encoder.response_budget(150) == 0


def test_encoder_settings_are_checked(tokenizer) -> None:
    with pytest.raises(ValueError, match=r"max_model_len must be >= 2 \(.*\), got 1"):
        PromptEncoder(tokenizer, max_model_len=1, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        PromptEncoder(tokenizer, max_model_len=64, max_tokens=0)


class _ListTokenizer:
    """A fake returning the shapes other transformers versions return."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        assert kwargs == {"tokenize": True, "add_generation_prompt": True}
        return self.result


@pytest.mark.parametrize(
    "result", [[1, 2, 3], [[1, 2, 3]], {"input_ids": [1, 2, 3]}, {"input_ids": [[1, 2, 3]]}]
)
def test_token_ids_from_any_return_shape(result: Any) -> None:
    assert PromptEncoder(_ListTokenizer(result), max_model_len=8, max_tokens=2).encode(_task()) == [1, 2, 3]


# -------------------------------------------------------------------------------------------- errors


def test_task_error_fields_and_copies() -> None:
    error = TaskError("unknown_environment", "t:9", "no environment named 'chess'")
    assert isinstance(error, ValueError)
    assert str(error) == "task 't:9': no environment named 'chess'"
    clone = copy.copy(error)
    assert (clone.reason, clone.task_id, str(clone)) == (error.reason, error.task_id, str(error))


# ------------------------------------------------------------------- the paper's published (veRL) layout

VERL_SCORERS = {"openai/gsm8k": "gsm8k", "lighteval/MATH": "math_verl", "countdown": "countdown"}


def test_verl_parquet_loads_as_downloaded_with_nested_answers_and_scorers_by_source(tmp_path: Path) -> None:
    """Files in the published layout load with answer_field = reward_model.ground_truth, each row's scorer
    from its data_source; the rest of the row (ability, reward_model, extra_info) stays in the metadata."""
    pytest.importorskip("pyarrow.parquet")
    from tests.verl_layout import countdown_rows, gsm8k_rows, math_rows, write_parquet

    loaded = {}
    for name, rows in (("gsm8k", gsm8k_rows()), ("math", math_rows()), ("countdown", countdown_rows())):
        path = write_parquet(tmp_path / name / "train.parquet", rows)
        loaded[name] = load_dataset(
            str(path), "prompt", "reward_model.ground_truth", scorer_by_source=VERL_SCORERS
        )
    gsm8k, math_, countdown = loaded["gsm8k"], loaded["math"], loaded["countdown"]
    assert [t.reference for t in gsm8k] == ["17", "25", "33"] and {t.scorer for t in gsm8k} == {"gsm8k"}
    assert gsm8k[0].messages[0].role == "user" and "####" in gsm8k[0].messages[0].content
    assert not gsm8k[0].prompt
    assert [t.reference for t in math_] == ["\\frac{1}{2}", "3\\sqrt{2}"]
    assert {t.scorer for t in math_} == {"math_verl"}
    assert [json.loads(t.reference) for t in countdown] == [
        {"target": 24, "numbers": [2, 3, 4]},
        {"target": 10, "numbers": [1, 2, 7]},
    ]
    assert {t.scorer for t in countdown} == {"countdown"}
    meta = dict(gsm8k[0].metadata)
    assert meta["data_source"] == "openai/gsm8k" and meta["ability"] == "math"
    assert json.loads(meta["reward_model"]) == {"style": "rule", "ground_truth": "17"}
    assert json.loads(meta["extra_info"])["index"] == 0
    # a key ending in * matches by prefix, the longest first; an exact name wins over any prefix
    aime = write_parquet(
        tmp_path / "aime.parquet",
        [
            dict(r, data_source=src)
            for r, src in zip(math_rows(3), ["aime25", "aime2025-hard", "aime"], strict=True)
        ],
    )
    by_prefix = {"aime*": "math_dapo", "aime2025*": "math_verl", "aime": "gsm8k"}
    tasks = load_dataset(str(aime), answer_field="reward_model.ground_truth", scorer_by_source=by_prefix)
    assert [t.scorer for t in tasks] == ["math_dapo", "math_verl", "gsm8k"]
    # without a mapping the tasks name no scorer (reward.default_scorer judges them)
    path = tmp_path / "gsm8k" / "train.parquet"
    assert {t.scorer for t in load_dataset(str(path), answer_field="reward_model.ground_truth")} == {""}


def test_a_column_named_with_dots_wins_over_the_path(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "a.b": "flat", "a": {"b": "nested"}}])
    assert load_dataset(str(path), answer_field="a.b")[0].reference == "flat"


@pytest.mark.parametrize(
    ("row", "fields", "match"),
    [
        (
            {"prompt": "p", "reward_model": {"style": "rule"}},
            {"answer_field": "reward_model.ground_truth"},
            r"d\.jsonl line 1: no 'reward_model\.ground_truth' field \(no 'ground_truth' in it",
        ),
        (
            {"prompt": "p"},
            {"answer_field": "reward_model.ground_truth"},
            r"no 'reward_model\.ground_truth' field \(no 'reward_model' in it",
        ),
        (
            {"q": {"text": "p"}},
            {"prompt_field": "q.messages"},
            r"no 'q\.messages' field \(no 'messages' in it",
        ),
        (
            {"prompt": "p", "data_source": "aime"},
            {"scorer_by_source": VERL_SCORERS},
            r"data_source 'aime' has no scorer in scorer_by_source \(it maps 'countdown', 'lighteval/MATH', "
            r"'openai/gsm8k'\); add it",
        ),
        (
            {"prompt": "p"},
            {"scorer_by_source": VERL_SCORERS},
            r"no 'data_source' field to choose its scorer by",
        ),
    ],
    ids=["nested-answer-part", "nested-answer-column", "nested-prompt", "unmapped-source", "no-source"],
)
def test_missing_paths_and_unmapped_sources_are_named(
    tmp_path: Path, row: dict[str, Any], fields: dict[str, Any], match: str
) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(TaskError, match=match):
        load_dataset(str(path), **fields)
