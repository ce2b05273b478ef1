"""The objectives' registry: its names are the modules of services/learner/objectives/, each declares itself
under its own name, and the config's choices are those names (read without importing torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.learner import objectives
from services.learner.config import LearnerConfig
from services.learner.vcpo import ObjectiveConfig

PACKAGE = Path(objectives.__file__).parent


def test_every_module_is_a_registered_objective_under_its_own_name() -> None:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))
    assert objectives.NAMES == tuple(modules) == ("grpo", "reinforce", "rloo", "vcpo")
    for name in objectives.NAMES:
        assert objectives.get(name).name == name == ObjectiveConfig(objective=name).spec.name
    assert [n for n in objectives.NAMES if objectives.get(n).needs_sq_grad_norms] == ["vcpo"]
    assert [n for n in objectives.NAMES if objectives.get(n).std_normalize] == ["grpo", "vcpo"]
    assert [n for n in objectives.NAMES if objectives.get(n).zero_signal == "batch"] == ["reinforce"]


def test_an_unknown_objective_is_refused_naming_it_and_the_choices() -> None:
    choices = r"\['grpo', 'reinforce', 'rloo', 'vcpo'\]"
    with pytest.raises(ValueError, match=rf"unknown objective 'ppo'; choices: {choices}"):
        objectives.get("ppo")
    with pytest.raises(ValidationError, match=rf"objective must be one of {choices}, got 'ppo'"):
        LearnerConfig(objective="ppo")


def test_the_registry_names_need_no_torch() -> None:
    code = (
        "import sys, services.learner.config\n"
        "from services.learner.objectives import NAMES\n"
        "assert NAMES, NAMES\n"
        "print(','.join(m for m in ('torch', 'vllm', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_helm_schema_offers_exactly_the_registered_objectives() -> None:
    """The chart's values schema lists the objectives too (helm refuses others before a pod starts); adding an
    objective module must add it there, which this test says."""
    import json

    schema = json.loads((Path(__file__).parent.parent / "helm/vcpo-rl/values.schema.json").read_text())
    found: list[list[str]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("objective"), dict) and "enum" in node["objective"]:
                found.append(node["objective"]["enum"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    assert found, "no objective enum in values.schema.json"
    assert all(sorted(enum) == list(objectives.NAMES) for enum in found), found
