"""The README stays true: the paths, make targets and config keys it names exist."""

from __future__ import annotations

import re
from pathlib import Path

from deploy.config import SystemConfig
from services.common.config import RunConfig

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


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
