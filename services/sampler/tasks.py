"""Where the sampler's prompts come from: dataset loading, the endless shuffled task order, prompt encoding.

    load_dataset("data.jsonl" | "data.parquet" | "builtin:<name>") ─► list[Task]
        └─► DatasetTasks(tasks, seed).next() ─► Task  (every task once per epoch, each epoch reshuffled)
                └─► PromptEncoder.encode(task) ─► prompt token ids (chat template) ── or TaskError(reason)

What it decides:

- A row becomes a :class:`Task`: ``task_id`` from the row's ``task_id``/``id`` column, else
  ``<file stem>:<row index>``; the prompt column fills ``prompt``, or ``messages`` when it holds a list of
  ``{role, content}`` dicts; the answer column is the ``reference``; every other column goes to ``metadata``
  as a string (lists and dicts as JSON, so nothing is dropped), ``None`` values are left out.
- A field may be a dotted path into nested columns (``reward_model.ground_truth``: veRL's parquet layout, whose
  ``reward_model`` column is a struct); a column whose own name holds the dots wins. A dotted path that a row
  lacks is an error naming the row and the missing part (a flat answer column may be absent: reference "").
  A structured answer (Countdown's ``{target, numbers}``) becomes its JSON.
- ``scorer_by_source`` (veRL's ``data_source`` names -> scorer names): each row's ``source_field`` value picks
  its task's ``scorer`` (a key ending in ``*`` matches by prefix: ``aime*``); a row without the field, or
  with a value the mapping lacks, is an error naming both.
- A bad file or row fails the load with a :class:`ValueError` naming the file, the line or row and the field;
  rows are never skipped silently.
- A task that cannot be sampled raises :class:`TaskError`, whose ``reason`` is a short, bounded label for a
  metric (``empty_prompt``, ``prompt_too_long``, ...) and whose message names the task.
- A prompt is rejected only when it leaves no room for a single response token; a long prompt that leaves
  fewer than ``max_tokens`` is sampled with :meth:`PromptEncoder.response_budget` tokens.
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

Parquet is read with pyarrow (pandas as a fallback), imported only when a parquet file is loaded.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from vcpo.v1 import common_pb2, rollout_pb2

TASK_ERROR_REASONS = (
    "empty_prompt",
    "prompt_too_long",
    "unknown_task",
    "unknown_environment",
    "bad_row",
    "bad_payload",
    "environment_failed",
)
"""The ``reason`` labels :class:`TaskError` is raised with (bounded, so they can label a metric)."""

BUILTIN_PREFIX = "builtin:"
TRAIN_SPLIT = "train"
HELD_OUT_SPLITS = ("test", "eval")
"""Split names that select a builtin dataset's held-out rows (``eval:<name>`` too)."""
ID_FIELDS = ("task_id", "id")
"""Columns that give a row its task id, in order of preference."""

ARITH_TRAIN_SIZE = 2000
ARITH_TEST_SIZE = 200
_ARITH_MAX_OPERAND = 99
_ARITH_OPS = "+-"
DIGIT_ADD_TEST_SIZE = 20
"""Held-out problems of ``builtin:digit_add``; the other 80 of the 100 are the train split."""


class TaskError(ValueError):
    """A task that cannot be sampled; ``reason`` is a short metric label, ``str(exc)`` names the task."""

    def __init__(self, reason: str, task_id: str, message: str) -> None:
        super().__init__(f"task {task_id!r}: {message}")
        self.reason = reason
        self.task_id = task_id
        self.message = message

    def __reduce__(self) -> tuple[type[TaskError], tuple[str, str, str]]:
        # The default reduce would call TaskError(str(self)): keep the three fields across copies and Ray.
        return (type(self), (self.reason, self.task_id, self.message))


# ---------------------------------------------------------------------------------------------- builtins

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


# --------------------------------------------------------------------------------------------- loading


def load_dataset(
    source: str,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    split: str = "train",
    seed: int = 0,
    scorer_by_source: Mapping[str, str] | None = None,
    source_field: str = "data_source",
) -> list[rollout_pb2.Task]:
    """Load a ``.jsonl`` or ``.parquet`` file, or ``builtin:<name>``, as Tasks labelled with ``split``.

    ``seed`` only drives builtin generators (shuffling is :class:`DatasetTasks`' job). Builtins always use
    their own ``prompt``/``answer`` fields. Fields may be dotted paths into nested columns. With
    ``scorer_by_source``, each task's scorer is the mapping's value for its row's ``source_field``. Raises
    ValueError naming the file, line or row, and field.
    """
    sources = _Sources(dict(scorer_by_source or {}), source_field)
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX) :]
        generator = BUILTIN_DATASETS.get(name)
        if generator is None:
            raise ValueError(
                f"unknown builtin dataset {name!r} in {source!r}; known: {', '.join(sorted(BUILTIN_DATASETS))}"
            )
        rows: Iterator[tuple[str, dict[str, Any]]] = (
            (f"{source} row {i}", row) for i, row in enumerate(generator(split, seed))
        )
        return _to_tasks(rows, name, "prompt", "answer", split, sources)

    path = Path(source)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise ValueError(
            f"dataset {source!r}: unknown extension {path.suffix!r}; expected a .jsonl or .parquet file "
            f"or 'builtin:<name>' (known builtins: {', '.join(sorted(BUILTIN_DATASETS))})"
        )
    if not path.is_file():
        raise ValueError(f"dataset file {source!r} does not exist (or is not a file)")
    rows = _jsonl_rows(path) if suffix == ".jsonl" else _parquet_rows(path)
    return _to_tasks(rows, path.stem, prompt_field, answer_field, split, sources)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each non-blank line; a line that is not a JSON object is an error."""
    with path.open(encoding="utf-8") as f:
        row_index = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(
                    "bad_row", f"{path.stem}:{row_index}", f"{where}: malformed JSON ({exc})"
                ) from exc
            if not isinstance(row, dict):
                raise TaskError(
                    "bad_row",
                    f"{path.stem}:{row_index}",
                    f"{where}: expected a JSON object, got {type(row).__name__}",
                )
            yield where, row
            row_index += 1


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each row of a parquet file."""
    read = _parquet_reader(path)
    try:
        records = read(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"dataset file {path}: cannot read it as parquet ({exc})") from exc
    for i, row in enumerate(records):
        yield f"{path} row {i}", row


def _parquet_reader(path: Path) -> Callable[[Path], list[dict[str, Any]]]:
    """pyarrow's reader when installed, else pandas' (which itself needs pyarrow or fastparquet, and turns
    integer columns with nulls into floats: ``3`` reads back as ``"3.0"``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        return lambda p: pq.read_table(p).to_pylist()
    try:
        import pandas as pd
    except ImportError as exc:
        raise ValueError(f"dataset file {path}: reading parquet needs pyarrow; install pyarrow") from exc
    return lambda p: [
        {str(key): _plain(value) for key, value in record.items()}
        for record in pd.read_parquet(p).to_dict("records")
    ]


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (what pandas hands back) as plain Python values; NaN as None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and value != value:
        return None
    return value


class _Sources:
    """Which scorer a row's source names (``scorer_by_source``; empty: the task names none)."""

    def __init__(self, scorers: dict[str, str], field: str) -> None:
        self.scorers, self.field = scorers, field

    def scorer(self, row: Mapping[str, Any], where: str, task_id: str) -> str:
        if not self.scorers:
            return ""
        found, source = field_value(row, self.field)
        if not found or source in (None, ""):
            raise TaskError(
                "bad_row",
                task_id,
                f"{where}: no {self.field!r} field to choose its scorer by "
                f"(scorer_by_source maps {', '.join(map(repr, sorted(self.scorers)))})",
            )
        scorer = self.scorers.get(str(source))
        if scorer is None:  # "aime*": any source that starts with "aime" (the longest such prefix wins)
            prefixes = [k for k in self.scorers if k.endswith("*") and str(source).startswith(k[:-1])]
            scorer = self.scorers[max(prefixes, key=len)] if prefixes else None
        if scorer is None:
            raise TaskError(
                "bad_row",
                task_id,
                f"{where}: {self.field} {source!r} has no scorer in "
                f"scorer_by_source (it maps {', '.join(map(repr, sorted(self.scorers)))}); "
                "add it",
            )
        return scorer


def field_value(row: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    """``(True, value)`` of ``path`` in ``row``: the column of that name, else a dotted path into nested
    columns (``reward_model.ground_truth``); ``(False, <the part that is missing>)`` when there is none."""
    if path in row:
        return True, row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, part
        value = value[part]
    return True, value


def _to_tasks(
    rows: Iterator[tuple[str, dict[str, Any]]],
    stem: str,
    prompt_field: str,
    answer_field: str,
    split: str,
    sources: _Sources,
) -> list[rollout_pb2.Task]:
    return [
        _row_to_task(row, where, f"{stem}:{i}", prompt_field, answer_field, split, sources)
        for i, (where, row) in enumerate(rows)
    ]


def _row_to_task(
    row: Mapping[str, Any],
    where: str,
    default_id: str,
    prompt_field: str,
    answer_field: str,
    split: str,
    sources: _Sources,
) -> rollout_pb2.Task:
    id_field = next((f for f in ID_FIELDS if row.get(f) not in (None, "")), None)
    task_id = str(row[id_field]) if id_field is not None else default_id
    found, prompt = field_value(row, prompt_field)
    if not found:
        missing = f" (no {prompt!r} in it)" if "." in prompt_field else ""
        raise TaskError(
            "bad_row",
            task_id,
            f"{where}: no {prompt_field!r} field{missing} (fields: {', '.join(map(str, row)) or 'none'}); "
            "set prompt_field to the column that holds the prompt",
        )
    task = rollout_pb2.Task(task_id=task_id, split=split, scorer=sources.scorer(row, where, task_id))
    if isinstance(prompt, str):
        task.prompt = prompt
    elif isinstance(prompt, list):
        task.messages.extend(_messages(prompt, where, prompt_field, task_id))
    else:
        raise TaskError(
            "bad_row",
            task_id,
            f"{where}: field {prompt_field!r} must be a string or a list of {{role, content}} messages, "
            f"got {type(prompt).__name__}",
        )
    found, answer = field_value(row, answer_field)
    if not found and "." in answer_field:
        raise TaskError(
            "bad_row",
            task_id,
            f"{where}: no {answer_field!r} field (no {answer!r} in it; fields: {', '.join(map(str, row))}); "
            "set answer_field to the path of the reference answer",
        )
    task.reference = _text(answer if found else None)
    skip = {prompt_field, answer_field, *ID_FIELDS}
    for key, value in row.items():
        if key not in skip and value is not None:
            task.metadata[str(key)] = _text(value)
    return task


def _messages(items: list[Any], where: str, field: str, task_id: str) -> list[common_pb2.ChatMessage]:
    out = []
    for i, item in enumerate(items):
        if not (
            isinstance(item, Mapping)
            and isinstance(item.get("role"), str)
            and isinstance(item.get("content"), str)
        ):
            raise TaskError(
                "bad_row",
                task_id,
                f"{where}: field {field!r} message {i} must be a {{role, content}} object of strings, "
                f"got {item!r}",
            )
        out.append(common_pb2.ChatMessage(role=item["role"], content=item["content"]))
    return out


def _text(value: Any) -> str:
    """A cell as a string: "" for None, JSON for lists and dicts (readable by scorers), else ``str``."""
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


# ------------------------------------------------------------------------------------------ task order


class DatasetTasks:
    """Endless iterator over a dataset's tasks, each epoch in a fresh ``random.Random(seed + epoch)`` order.

    ``epoch`` is the epoch of the task last returned (0 at the start); it moves on when the next call finds
    the current epoch used up. Returned tasks are copies, so callers may modify them freely.
    """

    def __init__(self, tasks: list[rollout_pb2.Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("DatasetTasks needs at least one task; the dataset is empty")
        self._index: dict[str, int] = {}
        for i, task in enumerate(tasks):
            if not task.task_id:
                raise ValueError(f"task at index {i} has an empty task_id")
            first = self._index.setdefault(task.task_id, i)
            if first != i:
                raise ValueError(f"duplicate task_id {task.task_id!r} (at indices {first} and {i})")
        self._tasks = list(tasks)
        self._seed = seed
        self._lock = threading.Lock()
        self.epoch = 0
        self._order = self._shuffled(0)
        self._position = 0

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self._tasks)))
        random.Random(self._seed + epoch).shuffle(order)
        return order

    def next(self) -> rollout_pb2.Task:
        """The next task, starting a new, reshuffled epoch when this one is used up."""
        with self._lock:
            if self._position == len(self._order):
                self.epoch += 1
                self._order = self._shuffled(self.epoch)
                self._position = 0
            task = self._tasks[self._order[self._position]]
            self._position += 1
        return _copy(task)

    def get(self, task_id: str) -> rollout_pb2.Task | None:
        """The task with this id, or None."""
        index = self._index.get(task_id)
        return None if index is None else _copy(self._tasks[index])

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[rollout_pb2.Task]:
        return self

    def __next__(self) -> rollout_pb2.Task:
        return self.next()


def _copy(task: rollout_pb2.Task) -> rollout_pb2.Task:
    out = rollout_pb2.Task()
    out.CopyFrom(task)
    return out


# ------------------------------------------------------------------------------------------- encoding


class ChatTokenizer(Protocol):
    """What :class:`PromptEncoder` needs of a tokenizer (a transformers tokenizer has it)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> Any: ...


class PromptEncoder:
    """Turns a Task into prompt token ids with the tokenizer's chat template, within the engine's length."""

    def __init__(
        self, tokenizer: ChatTokenizer, max_model_len: int, max_tokens: int, system_prompt: str = ""
    ) -> None:
        if max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and a response token), got {max_model_len}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.system_prompt = system_prompt

    def messages(self, task: rollout_pb2.Task) -> list[dict[str, str]]:
        """The conversation to template: ``task.messages``, else the system prompt (if any) and the prompt."""
        if task.messages:
            return [{"role": m.role, "content": m.content} for m in task.messages]
        if not task.prompt.strip():
            raise TaskError("empty_prompt", task.task_id, "the prompt is empty and there are no messages")
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out.append({"role": "user", "content": task.prompt})
        return out

    def encode(self, task: rollout_pb2.Task, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids, with the generation prompt; TaskError if empty or too long for one response token.
        ``tools`` (JSON schemas of an environment's tools) go to the chat template, which describes them to
        the model in its own format (a template without tool support leaves them out)."""
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        result = self.tokenizer.apply_chat_template(
            self.messages(task), tokenize=True, add_generation_prompt=True, **kwargs
        )
        tokens = _token_ids(result)
        if len(tokens) + 1 > self.max_model_len:
            raise TaskError(
                "prompt_too_long",
                task.task_id,
                f"the prompt is {len(tokens)} tokens; max_model_len={self.max_model_len} leaves no room "
                "for a response token",
            )
        return tokens

    def response_budget(self, prompt_len: int) -> int:
        """Tokens a response to a prompt of ``prompt_len`` tokens may have: ``max_tokens`` or what fits."""
        return max(0, min(self.max_tokens, self.max_model_len - prompt_len))


def _token_ids(result: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` output as a plain list of ints.

    transformers 5 returns a BatchEncoding (``input_ids`` and ``attention_mask``); older versions and
    ``return_dict=False`` a list; with ``return_tensors`` a (1, n) tensor.
    """
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        if len(result) != 1:
            raise ValueError(f"apply_chat_template returned a batch of {len(result)} prompts, expected one")
        result = result[0]
    return [int(t) for t in result]
