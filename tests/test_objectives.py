"""The objectives' registry: its names are the modules of services/learner/objectives/, each declares itself
under its own name, and the config's choices are those names (read without importing torch); what an
objective may declare (settings, metrics) and how both are checked. An objective dropped in as one file:
tests/test_objective_dropin.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import BaseModel, Field, ValidationError

from services.learner import objectives
from services.learner.config import LearnerConfig
from services.learner.objectives import NAME_PATTERN, Objective
from services.learner.vcpo import METRIC_KEYS, ObjectiveConfig, _rule_output
from tests.test_config import modules_imported_by

ROOT = Path(__file__).parent.parent
HEAVY = ("torch", "vllm", "deepspeed")  # what validating a config must not import
PACKAGE = Path(objectives.__file__).parent
SHIPPED = ("grpo", "reinforce", "rloo", "vcpo")


def test_every_module_is_a_registered_objective_under_its_own_name() -> None:
    modules = sorted(
        p.stem for d in objectives.__path__ for p in Path(d).glob("*.py") if not p.stem.startswith("_")
    )
    assert tuple(modules) == objectives.NAMES and set(SHIPPED) <= set(modules)
    for name in objectives.NAMES:
        assert re.match(NAME_PATTERN, name), name
        assert objectives.get(name).name == name == ObjectiveConfig(objective=name).spec.name


def test_the_shipped_objectives_declare_their_rules() -> None:
    spec = {name: objectives.get(name) for name in SHIPPED}
    assert [n for n in SHIPPED if spec[n].needs_sq_grad_norms] == ["vcpo"]
    assert [n for n in SHIPPED if spec[n].std_normalize] == ["grpo", "vcpo"]
    assert [n for n in SHIPPED if spec[n].zero_signal == "batch"] == ["reinforce"]
    for s in spec.values():  # no settings and no metrics of their own: a run file's table is refused
        assert (s.settings, s.metrics, s.summed_metrics) == (None, (), ())
        assert ObjectiveConfig(objective=s.name).settings is None


def test_an_unknown_objective_is_refused_naming_it_and_the_choices() -> None:
    choices = re.escape(str(list(objectives.NAMES)))
    with pytest.raises(ValueError, match=rf"unknown objective 'ppo'; choices: {choices}"):
        objectives.get("ppo")
    with pytest.raises(ValidationError, match=rf"objective must be one of {choices}, got 'ppo'"):
        LearnerConfig(objective="ppo")


def test_the_registry_names_need_no_torch() -> None:
    code = (
        "import services.learner.config\nfrom services.learner.objectives import NAMES\nassert NAMES, NAMES"
    )
    assert modules_imported_by(code, HEAVY) == ""


def test_reading_every_objectives_declaration_needs_no_torch() -> None:
    """The config's validation reads a declaration (a multi-rank config asks where the zero-signal rule
    looks; a settings table is checked against the settings model): every module imports torch only inside
    its rule, so validating stays torch-free."""
    code = "from services.learner import objectives\nspecs = [objectives.get(n) for n in objectives.NAMES]"
    assert modules_imported_by(code, HEAVY) == ""


def test_validating_a_config_without_objective_settings_imports_no_objective() -> None:
    """An empty ``[learner.objective_settings]`` is not checked against the module (every setting has a
    default), so validating a one-rank run file imports no objective, and any run file no torch."""
    code = (
        "import sys\n"
        "from deploy.config import SystemConfig\n"
        "from services.common.config import load_config\n"
        "env = {'VCPO_LEARNER__NUM_RANKS': '1'}\n"
        "cfg = load_config(SystemConfig, ['deploy/presets/local.toml'], env=env)\n"
        "assert cfg.learner.objective == 'vcpo' and cfg.learner.objective_settings == {}\n"
        "loaded = [m for m in sys.modules if m.startswith('services.learner.objectives.')]\n"
        "cfg = load_config(SystemConfig, ['deploy/presets/local.toml'], env={})\n"
        "assert cfg.learner.num_ranks == 2\n"
        "print(''.join(m + ',' for m in loaded), end='')"
    )
    assert modules_imported_by(code, HEAVY, cwd=ROOT) == ""


def test_the_helm_schema_checks_the_form_of_an_objective_name_not_a_list() -> None:
    """The chart cannot see the image's objectives, so its schema checks the form of the name (an objective
    is added without touching the chart) and the launcher refuses an unregistered one, naming the choices."""
    schema = json.loads((ROOT / "helm/vcpo-rl/values.schema.json").read_text())
    learner = schema["properties"]["learner"]["properties"]
    assert learner["objective"] == {"type": "string", "pattern": NAME_PATTERN}
    assert learner["objectiveSettings"] == {"type": "object"}
    assert "enum" not in json.dumps(learner["objective"])
    values = yaml.safe_load((ROOT / "helm/vcpo-rl/values.yaml").read_text())["learner"]
    assert values["objective"] in objectives.NAMES and values["objectiveSettings"] == {}


# ------------------------------------------------------------------------------- settings: the run file's table


def test_objective_settings_for_an_objective_without_settings_are_refused() -> None:
    with pytest.raises(
        ValidationError, match=r"learner.objective_settings: objective 'grpo' has no settings"
    ):
        LearnerConfig(objective="grpo", objective_settings={"temperature": 2.0})
    with pytest.raises(
        ValueError, match=r"ObjectiveConfig.objective_settings: objective 'vcpo' has no settings"
    ):
        ObjectiveConfig(objective_settings={"x": 1})
    assert LearnerConfig(objective="grpo", objective_settings={}).objective_settings == {}


class _Temperature(BaseModel):
    temperature: float = Field(1.0, gt=0)


def test_settings_are_checked_against_the_objectives_model_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = Objective("grpo", objectives.get("grpo").advantages, settings=_Temperature)
    monkeypatch.setattr(objectives, "get", lambda name: spec)
    assert objectives.settings_of("grpo", {}) == _Temperature()
    assert objectives.settings_of("grpo", {"temperature": "2.5"}).temperature == 2.5
    with pytest.raises(
        ValueError, match=r"learner.objective_settings.temp is not a setting of objective 'grpo'; "
    ):
        objectives.settings_of("grpo", {"temp": 2.0})
    with pytest.raises(
        ValueError, match=r"objective 'grpo': learner.objective_settings.temperature = -1: .*greater"
    ):
        objectives.settings_of("grpo", {"temperature": -1})


def test_an_objective_declaration_is_checked_when_its_module_is_imported() -> None:
    rule = objectives.get("grpo").advantages

    class Required(BaseModel):
        temperature: float

    with pytest.raises(ValueError, match=r"every setting needs a default, and \['temperature'\] have none"):
        Objective("x", rule, settings=Required)
    with pytest.raises(ValueError, match=r"settings must be a pydantic model class"):
        Objective("x", rule, settings=dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"metric 'ess' in metrics is one of the learner's own metrics"):
        Objective("x", rule, metrics=("ess",))
    with pytest.raises(ValueError, match=r"metric name 'My-Metric' in summed_metrics must match"):
        Objective("x", rule, summed_metrics=("My-Metric",))
    with pytest.raises(ValueError, match=r"metrics must be a tuple of names, got 'abc'"):
        Objective("x", rule, metrics="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"declared twice"):
        Objective("x", rule, metrics=("m",), summed_metrics=("m",))


# --------------------------------------------------------------------------- the rule's output, held to its contract


def test_an_advantage_rule_may_return_only_what_its_objective_declares() -> None:
    r = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    mine = Objective(
        "x", objectives.get("grpo").advantages, metrics=("my_mean",), summed_metrics=("my_count",)
    )
    adv, own = _rule_output(mine, r.float(), {"my_mean": torch.tensor(0.5), "baseline_fallbacks": 2}, r)
    assert adv.dtype == torch.float64 and own == {"my_mean": 0.5, "baseline_fallbacks": 2.0}
    with pytest.raises(
        ValueError, match=r"objective 'x'.*returned metrics \['ess', 'other'\] that its OBJECTIVE"
    ):
        _rule_output(mine, r, {"other": 1.0, "ess": 1.0}, r)
    with pytest.raises(ValueError, match=r"floating tensor of shape \(3,\).*got torch.float64 \(2,\)"):
        _rule_output(mine, r[:2], {}, r)
    with pytest.raises(ValueError, match=r"got torch.int64 \(3,\)"):
        _rule_output(mine, r.long(), {}, r)
    assert "my_mean" not in METRIC_KEYS and mine.metric_names[:2] == ("my_mean", "my_count")
