"""docs/reference/config.md: every key of a run file, read from the pydantic models that validate it.

The root is deploy.config.SystemConfig (a whole run file); each field that holds a model is a table of its
own (``[sampler.api_tls]``), a list of models an array of tables (``[[sampler.environments]]``), a map of
models a table per key (``[section.field.<name>]``). Types, defaults, constraints (``ge``/``gt``/``le``/
``lt``, lengths, patterns, ``Literal`` choices) and descriptions are the models' own, so the page cannot
disagree with what the launcher accepts.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from reference_markdown import abbreviate, banner, code, first_paragraph, prose, slug, table

DEFAULT_LIMIT = 60  # characters of a default shown in a table; longer ones are cut with an ellipsis
BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
LENGTHS = (("min_length", "length ≥"), ("max_length", "length ≤"), ("multiple_of", "multiple of"))


@dataclass
class Table:
    """One TOML table of the run file: its header (``[run]``, ``[[sampler.environments]]``) and its keys."""

    header: str
    model: type[BaseModel]
    rows: list[list[str]] = field(default_factory=list)


def _args(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation)


def _strip_annotated(annotation: Any) -> tuple[Any, list[Any]]:
    """The type under ``Annotated[...]`` and its metadata."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *meta = _args(annotation)
        return base, list(meta)
    return annotation, []


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def model_of(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """``("table" | "array" | "map", model)`` when a field holds a model, a list of them or a map of them."""
    annotation, _ = _strip_annotated(annotation)
    if _is_union(annotation):  # `Model | None`: the model's table
        models = [a for a in _args(annotation) if _is_model(a)]
        return ("table", models[0]) if len(models) == 1 else None
    if _is_model(annotation):
        return "table", annotation
    origin, args = typing.get_origin(annotation), _args(annotation)
    if origin in (list, tuple, typing.Sequence) and args and _is_model(_strip_annotated(args[0])[0]):
        return "array", _strip_annotated(args[0])[0]
    if origin in (dict, typing.Mapping) and len(args) == 2 and _is_model(_strip_annotated(args[1])[0]):
        return "map", _strip_annotated(args[1])[0]
    return None


def type_name(annotation: Any) -> str:
    """A field's type in TOML's words: string, integer, float, boolean, list of ..., table of ..."""
    annotation, _ = _strip_annotated(annotation)
    origin, args = typing.get_origin(annotation), _args(annotation)
    simple = {
        str: "string",
        int: "integer",
        float: "float",
        bool: "boolean",
        Path: "path",
        SecretStr: "secret",
    }
    if annotation in simple:
        return simple[annotation]
    if annotation is type(None):
        return "none"
    if annotation is Any:
        return "any"
    if origin is typing.Literal:
        kinds = {type_name(type(a)) for a in args}
        return kinds.pop() if len(kinds) == 1 else "literal"
    if _is_union(annotation):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, set, frozenset, typing.Sequence) or (origin is tuple and args[-1:] == (Ellipsis,)):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in (dict, typing.Mapping):
        return f"table of {type_name(args[1])}" if args else "table"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "string"
    if _is_model(annotation):
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(meta: list[Any]) -> list[str]:
    out = []
    for m in meta:
        if isinstance(m, FieldInfo):  # Annotated[float, Field(gt=0)]: the bounds are in its metadata
            out += _bounds(list(m.metadata))
            continue
        for attr, sign in (*BOUNDS, *LENGTHS):
            value = getattr(m, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
        pattern = getattr(m, "pattern", None)
        if pattern is not None:
            out.append(f"matches {code(pattern)}")
    return out


def constraints(info: FieldInfo) -> str:
    """The checks pydantic makes on the value: bounds, lengths, patterns, the choices of a Literal."""
    out = _bounds(list(info.metadata))
    annotation, meta = _strip_annotated(info.annotation)
    out += _bounds(meta)
    choices = [a for a in _args(annotation) if typing.get_origin(annotation) is typing.Literal]
    if choices:
        out.append("one of " + ", ".join(code(json.dumps(c)) for c in choices))
    origin, args = typing.get_origin(annotation), _args(annotation)
    inner = args[1] if origin in (dict, typing.Mapping) and len(args) == 2 else None
    inner = args[0] if origin in (list, typing.Sequence) and args else inner
    if inner is not None and (inner_bounds := _bounds(_strip_annotated(inner)[1])):
        out.append("each value " + ", ".join(inner_bounds))
    return "; ".join(out)


def _toml(value: Any) -> str:
    """A default as the run file would spell it."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, float | int):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, default=str)


def default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    try:
        value = info.get_default(call_default_factory=True, validated_data={})
    except (TypeError, KeyError, ValueError):  # a default factory that needs the other fields' values
        return "computed"
    if value is PydanticUndefined:
        return "required"
    return code(abbreviate(_toml(value), DEFAULT_LIMIT))


def header_of(path: str, kind: str) -> str:
    return {"table": f"[{path}]", "array": f"[[{path}]]", "map": f"[{path}.<name>]"}[kind]


def tables(root: type[BaseModel]) -> list[Table]:
    """Every table of a run file under ``root``, depth first in the models' field order."""
    out: list[Table] = []

    def walk(model: type[BaseModel], path: str, kind: str) -> None:
        here = Table(header_of(path, kind), model)
        out.append(here)
        prefix = f"{path}.<name>." if kind == "map" else f"{path}."
        for name, info in model.model_fields.items():
            nested = model_of(info.annotation)
            if nested is not None:
                sub_kind, sub_model = nested
                sub_header = header_of(prefix + name, sub_kind)
                shown = {"table": "table", "array": "array of tables", "map": "tables by name"}[sub_kind]
                link = f"[{code(sub_header)}](#{slug(code(sub_header))})"
                default_shown = "`[]`" if sub_kind == "array" else "`{}`" if sub_kind == "map" else ""
                here.rows.append(
                    [code(name), shown, default_shown, "", f"See {link}. " + prose(info.description or "")]
                )
                walk(sub_model, prefix + name, sub_kind)
            else:
                here.rows.append(
                    [
                        code(name),
                        type_name(info.annotation),
                        default(info),
                        constraints(info),
                        prose(info.description or ""),
                    ]
                )

    for name, info in root.model_fields.items():
        nested = model_of(info.annotation)
        if nested is None:
            raise SystemExit(
                f"{root.__name__}.{name} is not a section (a model): the run file has no such table"
            )
        walk(nested[1], name, nested[0])
    return out


def undocumented(root: type[BaseModel]) -> list[str]:
    """Run-file keys whose field has no description (the page would show an empty cell)."""
    missing = []
    for t in tables(root):
        for name, info in t.model.model_fields.items():
            if not info.description and model_of(info.annotation) is None:
                missing.append(f"{t.header} {name}")
    return missing


def render() -> str:
    from deploy.config import SystemConfig

    parts = [
        "# Run-file reference\n",
        banner("the pydantic models (deploy/config.py `SystemConfig` and the services' `config.py`)"),
        "Every key a run file (TOML; presets in `deploy/presets/`) may set, table by table. A key can also be "
        "set from the environment as `VCPO_<SECTION>__<KEY>` (nested tables add `__`) or on the launcher's "
        "command line as `--<section>.<key> VALUE` or `--set <section>.<key>=VALUE`; later layers win "
        "(defaults, files, environment, flags). Unknown keys are errors. How to write a run file: "
        "[the configuration guide](../guides/configuration.md).\n",
        "Types are TOML's: a *table* is a `[section]` or an inline `{...}`; *path* and *secret* are strings. "
        'A default of `0` or `""` often means *automatic* or *off*: the description says which.\n',
    ]
    all_tables = tables(SystemConfig)
    parts.append(
        "Tables: " + ", ".join(f"[{code(t.header)}](#{slug(code(t.header))})" for t in all_tables) + ".\n"
    )
    for t in all_tables:
        depth = "##" if t.header.count(".") == 0 else "###"
        parts.append(f"{depth} {code(t.header)}\n")
        intro = first_paragraph(t.model.__doc__)
        if intro:
            parts.append(prose(intro) + "\n")
        parts.append(table(["Key", "Type", "Default", "Constraints", "Description"], t.rows))
    return "\n".join(parts)
