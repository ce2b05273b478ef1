"""Datasets as Tasks: what the sampler, the evaluator and the learner's warm start all load their prompts from.

    load_dataset("data.jsonl" | "data.parquet" | "builtin:<name>") ─► list[Task]

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
- ``builtin:<name>`` rows come from :mod:`services.common.builtin_datasets`.

Parquet is read with pyarrow (pandas as a fallback), imported only when a parquet file is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from services.common.builtin_datasets import BUILTIN_DATASETS
from services.common.prompts import TaskError
from vcpo.v1 import common_pb2, rollout_pb2

BUILTIN_PREFIX = "builtin:"
ID_FIELDS = ("task_id", "id")
"""Columns that give a row its task id, in order of preference."""


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
