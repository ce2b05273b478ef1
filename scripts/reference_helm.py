"""docs/reference/helm-values.md: every value of helm/vcpo-rl/values.yaml with its ``# --`` comment.

The helm-docs convention: a ``# -- text`` comment, continued on the ``#`` lines below it, documents the key
right below the comment (an optional ``(type)`` after ``--`` overrides the type shown). A commented map or
list is documented as a whole: keys under it need no comment of their own (``resources.requests``), though
those that have one get a row too. A value with no such comment on it or on a map above it is
*undocumented* (:func:`undocumented`; ``scripts/gen_reference.py --check`` names them).

Why not helm-docs itself: it is a Go binary the project does not install, and its template would be one more
format to keep; the walk below is PyYAML's node tree (line numbers included) plus the comment lines above
each key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from reference_markdown import abbreviate, banner, code, prose, table

ROOT = Path(__file__).resolve().parent.parent
VALUES = ROOT / "helm" / "vcpo-rl" / "values.yaml"
DEFAULT_LIMIT = 80  # characters of a default shown; longer ones are cut with an ellipsis
START = re.compile(r"^\s*#\s?--(?:\s+(.*))?$")
TYPE_OVERRIDE = re.compile(r"^\((\w[\w/ ]*)\)\s*(.*)$", re.S)


@dataclass
class Value:
    path: str
    type: str
    default: str
    description: str  # "" when undocumented
    covered: bool  # under a map that has a comment (then listed only with a comment of its own)


def _comment(lines: list[str], line: int) -> str | None:
    """The ``# --`` comment right above line ``line`` (0-based), joined on one line; None if there is none."""
    block: list[str] = []
    i = line - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, lines[i])
        i -= 1
    starts = [n for n, text in enumerate(block) if START.match(text)]
    if not starts:
        return None
    first = block[starts[-1]]
    m = START.match(first)
    text = [m.group(1) or "" if m else ""]
    text += [re.sub(r"^\s*#\s?", "", rest) for rest in block[starts[-1] + 1 :]]
    return " ".join(" ".join(text).split())


def _type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


def _default(value: Any) -> str:
    return code(abbreviate(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")), DEFAULT_LIMIT))


def _key_text(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z_][\w-]*", key) else json.dumps(key)


def values(path: Path = VALUES) -> list[Value]:
    """Every documented or undocumented value, in the file's order."""
    text = path.read_text()
    lines = text.splitlines()
    root = yaml.compose(text)
    loader = yaml.SafeLoader("")  # builds each node's value as safe_load would
    out: list[Value] = []

    def walk(node: yaml.MappingNode, prefix: str, covered: bool) -> None:
        for key_node, value_node in node.value:
            key = str(loader.construct_object(key_node, deep=True))
            value = loader.construct_object(value_node, deep=True)
            here = prefix + _key_text(key)
            comment = _comment(lines, key_node.start_mark.line)
            shown_type = _type(value)
            if comment is not None and (m := TYPE_OVERRIDE.match(comment)):
                shown_type, comment = m.group(1), m.group(2)
            is_map = isinstance(value_node, yaml.MappingNode) and value
            if comment is not None or not (is_map or covered):
                out.append(Value(here, shown_type, _default(value), comment or "", covered))
            if is_map:
                walk(value_node, here + ".", covered or comment is not None)

    if not isinstance(root, yaml.MappingNode):
        raise SystemExit(f"{path}: the top level is not a map")
    walk(root, "", False)
    return out


def undocumented(path: Path = VALUES) -> list[str]:
    """Values with no ``# --`` comment on them or on a map above them."""
    return [v.path for v in values(path) if not v.description]


def render(path: Path = VALUES) -> str:
    rel = path.relative_to(ROOT)
    rows = [[code(v.path), v.type, v.default, prose(v.description)] for v in values(path)]
    return "\n".join(
        [
            "# Helm values reference\n",
            banner(f"{rel}'s `# --` comments"),
            f"Every value of the chart's [{path.name}](../../{rel}), in the file's order: its key path (what "
            "`helm install --set` takes), its type, its default and what it does. Keys under a documented "
            "map (`sampler.resources`) are listed only where they have a comment of their own. Installing "
            "the chart: [the Kubernetes guide](../deploy.md); the run-file keys the chart renders: "
            "[the run-file reference](config.md).\n",
            table(["Key", "Type", "Default", "Description"], rows),
        ]
    )
