"""The documentation stays true: what README.md and docs/ name exists.

Cheap checks, nothing launched: relative links and their #anchors resolve; the README stays a landing page
(under 25,000 characters); every `make` target, `python -m` module and `python path.py` script a page names
exists; every config key a page writes in backticks as `section.key` (with a known section: a run-file table
or a top-level Helm value) is a field of the pydantic config models or a key of the chart's values.yaml; every
`vcpo_*` metric a page names is registered by a service.
"""

from __future__ import annotations

import importlib.util
import re
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from deploy.config import SystemConfig
from services.common.config import RunConfig
from tests.test_monitoring import HISTOGRAM_SUFFIXES, registered_metrics

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
# every page a user reads; CHANGELOG.md is history and may name what no longer exists
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
README_LIMIT = 25_000

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# file names and certificate parts that look like `section.key`: `run.toml`, `tls.crt`
NOT_KEYS = {
    "toml",
    "json",
    "jsonl",
    "yaml",
    "yml",
    "py",
    "md",
    "log",
    "png",
    "txt",
    "proto",
    "sh",
    "js",
    "crt",
    "key",
}
NOT_KEYS |= {"pem", "parquet", "safetensors", "tpl", "tgz", "csv", "com", "io", "org"}
# a `vcpo_*` name with one of these prefixes is a metric and must be registered; any other (the vLLM engine
# `vcpo_collective`, the Ray resource `vcpo_learner`, a benchmark's figure `vcpo_peak_over_grpo`) must occur in
# the code
METRIC_PREFIXES = tuple(
    f"vcpo_{p}_"
    for p in ("learner", "sampler", "reward", "broker", "stream", "eval", "weight_group", "service")
)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _code_spans(text: str) -> Iterator[str]:
    for m in CODE_SPAN.finditer(_prose(text)):
        yield m.group(2)


# ------------------------------------------------------------------------------------------------ the README


def test_paths_named_in_the_readme_exist() -> None:
    named = set(
        re.findall(r"`((?:services|deploy|protos|helm|benchmarks|tests|scripts|\.ci)/[^`\s*<>{}]*)`", README)
    )
    named |= set(re.findall(r"^((?:services|deploy|protos|helm|benchmarks|tests)/\S*)", README, re.M))
    assert len(named) > 5
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"README names paths that do not exist: {missing}"


def test_make_targets_named_in_the_readme_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    named = set(re.findall(r"\bmake ([a-z][a-z-]*)", README))
    assert {"run", "test", "setup"} <= named
    assert named <= targets, f"README names make targets that do not exist: {sorted(named - targets)}"


def test_run_section_table_matches_the_config() -> None:
    table = README.split("The shared `[run]` section:", 1)[1].split("\n\n", 2)[1]  # the table under it
    rows = re.findall(r"^\| `([a-z_]+)` \| `?([^|`]*?)`? \|", table, re.M)
    keys = {key for key, _ in rows}
    assert keys == set(RunConfig.model_fields), "README's [run] table and RunConfig disagree"
    defaults = RunConfig().model_dump(mode="json")
    for key, shown in rows:
        assert str(defaults[key]) == shown.strip('"') or (shown == '""' and defaults[key] == ""), key


def test_sections_named_in_the_readme_are_the_config_sections() -> None:
    named = set(re.findall(r"`\[([a-z_]+)\]`", README))
    assert named == set(SystemConfig.model_fields)


def test_the_readme_is_a_landing_page() -> None:
    assert len(README) < README_LIMIT, (
        f"README.md has {len(README):,} characters, over {README_LIMIT:,}: move details to a page in docs/"
    )
    linked = {target.split("#")[0] for target in LINK.findall(_prose(README))}
    assert "docs/README.md" in linked, "the README links the docs map"
    assert {"LICENSE", "CONTRIBUTING.md", "CHANGELOG.md"} <= linked


def test_the_readme_keeps_the_gpu_status_of_vllms_engine_layout() -> None:
    row = next((line for line in README.splitlines() if line.startswith("| vLLM's engine")), "")
    assert row, "the README's GPU status table has a row on vLLM's engine"
    for words in ("not the GPU layout", "async scheduling off", "engine-core process", "async scheduling on"):
        assert words in row, f"the vLLM row no longer says {words!r}"
    assert "official `vllm` on CUDA" in row and "not yet run" in row.rsplit("|", 2)[1]


# ------------------------------------------------------------------------------------- every page: links


@cache
def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(path.read_text()), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text
        text = re.sub(r"[`*]", "", text)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_relative_link_resolves() -> None:
    broken = []
    checked = 0
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            checked += 1
            if not dest.exists():
                broken.append(f"{_rel(page)}: {target} (no {path})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(page)}: {target} (no heading #{anchor} in {_rel(dest)})")
    assert checked > 50
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_paths_named_in_the_docs_exist() -> None:
    prefix = r"(?:services|deploy|protos|helm|benchmarks|tests|scripts|examples|experiments|docs)/"
    missing = []
    for page in PAGES:
        for span in _code_spans(page.read_text()):
            for path in re.findall(rf"(?<![\w./<>-])({prefix}[^`\s*<>{{}}]*)", span):
                if not (ROOT / path.rstrip("/.,;:")).exists():
                    missing.append(f"{_rel(page)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------- every page: commands that exist


def test_make_targets_named_in_the_docs_exist() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    unknown = [
        f"{_rel(page)}: make {name}"
        for page in PAGES
        for name in re.findall(r"\bmake ([a-z][a-z-]*)", page.read_text())
        if name not in targets
    ]
    assert not unknown, "make targets that do not exist:\n" + "\n".join(unknown)


def _module_exists(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return True
    if name.split(".")[0] in {
        "services",
        "deploy",
        "benchmarks",
        "experiments",
        "scripts",
        "examples",
        "tests",
    }:
        return False  # the project's own modules are files, and a missing one must not be imported to tell
    return importlib.util.find_spec(name) is not None


def test_python_commands_named_in_the_docs_exist() -> None:
    modules: list[tuple[Path, str]] = []
    scripts: list[tuple[Path, str]] = []
    for page in PAGES:
        text = page.read_text()
        modules += [(page, m) for m in re.findall(r"\bpython[\d.]* -m ([A-Za-z_][\w.]*)", text)]
        scripts += [(page, s) for s in re.findall(r"\bpython[\d.]* ([\w./-]+\.py)\b", text)]
    assert len(modules) > 10 and len(scripts) > 10
    missing = [f"{_rel(p)}: python -m {m}" for p, m in modules if not _module_exists(m)]
    missing += [f"{_rel(p)}: python {s}" for p, s in scripts if not (ROOT / s).is_file()]
    assert not missing, "commands whose module or script does not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------ every page: config keys


@cache
def _helm_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((ROOT / "helm" / "vcpo-rl" / "values.yaml").read_text())
    return values


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds, alone or as the items of a list; None for anything else."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in typing.get_args(arg):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _is_config_key(parts: list[str]) -> bool:
    model: type[BaseModel] | None = SystemConfig
    for i, part in enumerate(parts):
        if model is None:  # a dict or free-form value: its keys are the user's
            return True
        field = model.model_fields.get(part)
        if field is None:
            return False
        model = _model_of(field.annotation)
        if model is None and i < len(parts) - 1 and typing.get_origin(field.annotation) is not dict:
            return False
    return True


def _is_helm_value(parts: list[str]) -> bool:
    node: Any = _helm_values()
    for part in parts:
        if isinstance(node, list) or (isinstance(node, dict) and not node):
            return True  # a list's items or a free-form map: not spelled out in values.yaml
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _named_keys(text: str) -> Iterator[str]:
    """Dotted names in inline code (`learner.lr`, `sampler.api_tls.cert_file = ...`) and in command-line
    flags (`--run.k 16`, `--set image.tag=0.1.0`) anywhere, code blocks included."""
    dotted = r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)"
    for span in _code_spans(text):
        yield from re.findall(dotted, span)
    yield from re.findall(r"--(?:set(?:-string)? )?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", text)


def test_config_keys_named_in_the_docs_exist() -> None:
    sections = set(SystemConfig.model_fields) | set(_helm_values())
    unknown = []
    checked = 0
    for page in PAGES:
        for name in _named_keys(page.read_text()):
            parts = name.split(".")
            if parts[0] not in sections or parts[-1] in NOT_KEYS:
                continue
            checked += 1
            if not (_is_config_key(parts) or _is_helm_value(parts)):
                unknown.append(f"{_rel(page)}: {name}")
    assert checked > 200
    assert not unknown, (
        "config keys that are neither in the config models nor in helm/vcpo-rl/values.yaml:\n"
        + "\n".join(unknown)
    )


# ------------------------------------------------------------------------------------ every page: metrics


def _code_mentions(name: str) -> bool:
    return any(
        name in path.read_text()
        for folder in ("services", "deploy", "benchmarks", "helm")
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in {".py", ".yaml", ".tpl", ".json"}
    )


def test_metrics_named_in_the_docs_exist() -> None:
    names, histograms = registered_metrics()
    unknown = []
    seen = 0
    for page in PAGES:
        for name in set(re.findall(r"(?<![\w/.])(vcpo_[a-z0-9_]+)(?![\w.])", page.read_text())):
            seen += 1
            if name.endswith("_"):  # a family, `vcpo_learner_*`
                ok = any(n.startswith(name) for n in names)
            elif name.startswith(METRIC_PREFIXES):
                bare = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
                ok = name in names or bare in histograms
            else:
                ok = _code_mentions(name)
            if not ok:
                unknown.append(f"{_rel(page)}: {name}")
    assert seen > 50
    assert not unknown, "metric names no service registers:\n" + "\n".join(unknown)


# ---------------------------------------------------------------------------------- every page: objectives

# a clause that gives `learner.objective` its values: "`learner.objective`: `vcpo` (the default), `grpo` ..."
OBJECTIVE_CLAUSE = re.compile(r"`learner\.objective[`\s=](?:[^;\n]|\n(?!\n))*?(?=;|\.\s|\n\n|$)")


def test_objective_names_the_docs_give_are_registered() -> None:
    from services.learner.objectives import NAMES

    given = []
    for page in PAGES:
        prose = _prose(page.read_text())
        for clause in OBJECTIVE_CLAUSE.findall(prose):
            # backticked bare names: `vcpo`; a dotted key (`learner.ppo_clip`) is a setting, not a value
            given += [(page, n) for n in re.findall(r"`([a-z][a-z0-9_]*)`", clause)]
        for code in re.findall(r"objective\s*=\s*\"([^\"]+)\"", page.read_text()):
            given.append((page, code))
    assert len(given) >= 4
    # the guide's example objective, which tests/test_objective_dropin.py drops in and checks
    from tests.test_objective_dropin import EXAMPLE

    unknown = [f"{_rel(p)}: {n}" for p, n in given if n not in NAMES and n != EXAMPLE]
    assert not unknown, (
        f"objective names that learner.objective refuses (choices {list(NAMES)}):\n" + "\n".join(unknown)
    )
