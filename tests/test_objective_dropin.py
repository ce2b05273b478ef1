"""A new objective is one new file: a module written here (a group-mean baseline divided by a temperature, with
one setting and two metrics of its own) is dropped in, and works through the config's validation (its
settings included), the loss (a real step on tensors, checked against a hand computation), the merge over
ranks, the Prometheus gauge and the metrics log, the stability grid, and the Helm chart's render and schema,
without a line changed anywhere else.

The file goes in a temporary directory named by ``VCPO_OBJECTIVES_PATH`` (the registry's documented way to
add a directory to the objectives package), read by subprocesses: nothing is written into the repository,
whether a test passes, fails or is interrupted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.config import SystemConfig
from services.common.config import ConfigError, load_config
from tests.test_helm import container, errors, group, helm, one, render

ROOT = Path(__file__).parent.parent
GUIDE = ROOT / "docs" / "research" / "adding-an-objective.md"
EXAMPLE = (
    "mean_temp"  # the objective below, also the guide's example (tests/test_docs.py lets the guide name it)
)
MEAN_TEMP = '''"""Group-mean baseline, divided by a temperature: Â = (R − mean_g R) / temperature."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from services.learner.objectives import AdvantageInputs, Objective

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig


class Settings(BaseModel):
    temperature: float = Field(1.0, gt=0, description="Divides every advantage.")


def advantages(inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
    settings: Settings = config.settings
    baseline = inputs.mean[inputs.groups]
    metrics = {"baseline_mean": float(baseline.mean()), "groups_seen": float(inputs.n_groups)}
    return (inputs.rewards - baseline) / settings.temperature, metrics


OBJECTIVE = Objective(
    "mean_temp", advantages, settings=Settings, metrics=("baseline_mean",), summed_metrics=("groups_seen",)
)
'''
# an objective whose rule returns a metric it never declared
LEAKY = """from services.learner.objectives import Objective


def advantages(inputs, config):
    return inputs.rewards - inputs.mean[inputs.groups], {"surprise": 1.0}


OBJECTIVE = Objective("leaky", advantages)
"""


@pytest.fixture
def objective_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "objectives"
    folder.mkdir()
    (folder / "mean_temp.py").write_text(MEAN_TEMP)
    (folder / "leaky.py").write_text(LEAKY)
    return folder


def test_the_guides_example_is_the_module_tested_here() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), re.M | re.S)
    assert blocks == [MEAN_TEMP]
    assert f'"{EXAMPLE}", advantages' in MEAN_TEMP


def run_python(objective_dir: Path, code: str, *args: str) -> dict[str, Any]:
    """``code`` in a fresh interpreter that sees the dropped-in objectives; its last stdout line, as JSON."""
    env = {**os.environ, "VCPO_OBJECTIVES_PATH": str(objective_dir)}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_path_variable_refuses_a_missing_directory_a_clash_and_a_bad_name(tmp_path: Path) -> None:
    def registry_error(folder: Path) -> str:
        env = {**os.environ, "VCPO_OBJECTIVES_PATH": str(folder)}
        code = "import services.learner.objectives"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
        assert out.returncode != 0
        return out.stderr.strip().splitlines()[-1]

    assert "VCPO_OBJECTIVES_PATH names" in registry_error(tmp_path / "absent")
    assert "which are not directories" in registry_error(tmp_path / "absent")
    (tmp_path / "grpo.py").write_text(MEAN_TEMP)
    assert "objective 'grpo' is defined twice" in registry_error(tmp_path)
    (tmp_path / "grpo.py").unlink()
    (tmp_path / "MeanTemp.py").write_text(MEAN_TEMP)
    assert "MeanTemp: its name must match ^[a-z][a-z0-9_]*$" in registry_error(tmp_path)


VALIDATE = """
import json, sys
from pathlib import Path
from deploy.config import SystemConfig
from services.common.config import ConfigError, load_config
from services.learner import objectives

out = {"names": list(objectives.NAMES)}
for i, text in enumerate(sys.argv[2:]):
    path = Path(sys.argv[1]) / f"run{i}.toml"
    path.write_text(text)
    try:
        learner = load_config(SystemConfig, [path], env={}).learner
        out[str(i)] = {"objective": learner.objective, "settings": learner.objective_settings}
    except ConfigError as e:
        out[str(i)] = {"error": str(e)}
out["heavy"] = [m for m in ("torch", "deepspeed", "vllm") if m in sys.modules]
print(json.dumps(out))
"""


def test_the_dropped_in_objective_and_its_settings_are_validated_with_the_config(
    objective_dir: Path, tmp_path: Path
) -> None:
    head = '[learner]\nobjective = "mean_temp"\n[learner.objective_settings]\n'
    out = run_python(
        objective_dir,
        VALIDATE,
        str(tmp_path),
        head + "temperature = 2.0\n",
        head + "temperature = -1.0\n",
        head + "temp = 2.0\n",
        '[learner]\nobjective = "mean_temp"\n',
        '[learner]\nobjective = "grpo"\n[learner.objective_settings]\ntemperature = 2.0\n',
    )
    assert {"mean_temp", "leaky", "grpo", "vcpo"} <= set(out["names"])
    assert out["0"] == {"objective": "mean_temp", "settings": {"temperature": 2.0}}
    assert "learner.objective_settings.temperature = -1.0" in out["1"]["error"]
    assert "objective 'mean_temp'" in out["1"]["error"] and "greater than 0" in out["1"]["error"]
    assert "learner.objective_settings.temp is not a setting of objective 'mean_temp'" in out["2"]["error"]
    assert "its settings: ['temperature']" in out["2"]["error"]
    assert out["3"] == {"objective": "mean_temp", "settings": {}}  # its defaults apply
    assert "objective 'grpo' has no settings" in out["4"]["error"]
    assert out["heavy"] == []  # the module imports torch nowhere at its top: validating it needs none
    # without the variable the objective does not exist, and the config says which do
    (tmp_path / "plain.toml").write_text(head + "temperature = 2.0\n")
    with pytest.raises(ConfigError, match=r"objective must be one of \['grpo', .*got 'mean_temp'"):
        load_config(SystemConfig, [tmp_path / "plain.toml"], env={})


LOSS = """
import json
import torch
from services.learner.vcpo import METRIC_KEYS, ObjectiveConfig, PolicyBatch, policy_loss

mask = torch.tensor(
    [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
).bool()
rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.3, 0.3], dtype=torch.float64)
groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
logprobs = (-torch.rand(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).requires_grad_()
out = {}
for name, table in (("t2", {"temperature": 2.0}), ("default", {})):
    config = ObjectiveConfig(objective="mean_temp", objective_settings=table)
    logprobs.grad = None
    batch = PolicyBatch(logprobs, logprobs.detach().clone(), mask, rewards, groups)
    loss, metrics = policy_loss(batch, config)
    loss.backward()
    out[name] = {"temperature": config.settings.temperature, "metrics": metrics, "grad": logprobs.grad.tolist()}
out["metric_keys"] = list(METRIC_KEYS)
try:
    policy_loss(PolicyBatch(logprobs, logprobs.detach(), mask, rewards, groups), ObjectiveConfig(objective="leaky"))
except ValueError as e:
    out["leaky"] = str(e)
print(json.dumps(out))
"""


def test_the_loss_takes_the_dropped_in_rule_its_settings_and_its_metrics(objective_dir: Path) -> None:
    """On-policy (every ℓ = 0, so w̄ = 1) under seq-mean-token-mean the gradient of the loss by each masked
    log-prob is ``c_i = −Â_i / (B · L_i)``: the advantages, recovered from a real backward, match the hand
    computation ``(R − mean_g R) / temperature``, with the zero-signal rule applied after the rule."""
    out = run_python(objective_dir, LOSS)
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    rewards = [1.0, 0.0, 0.5, 0.2, 0.9, 0.3, 0.3]
    groups = [0, 0, 0, 1, 1, 2, 2]
    means = {
        g: sum(r for r, h in zip(rewards, groups, strict=True) if h == g) / groups.count(g)
        for g in set(groups)
    }
    for name, temperature in (("t2", 2.0), ("default", 1.0)):
        step = out[name]
        assert step["temperature"] == temperature
        expected = [
            0.0 if g == 2 else (r - means[g]) / temperature  # group 2's rewards are equal: zero signal
            for r, g in zip(rewards, groups, strict=True)
        ]
        for i, row in enumerate(step["grad"]):
            length = sum(mask[i])
            coef = -expected[i] / (len(rewards) * length)
            assert row == pytest.approx([coef if m else 0.0 for m in mask[i]], abs=1e-15)
        metrics = step["metrics"]
        # the loss's keys, then the objective's own, in its declared order
        assert list(metrics) == [*out["metric_keys"], "baseline_mean", "groups_seen"]
        assert metrics["baseline_mean"] == pytest.approx(sum(means[g] for g in groups) / len(groups))
        assert metrics["groups_seen"] == 3.0
        assert metrics["advantage_abs_mean"] == pytest.approx(sum(map(abs, expected)) / len(expected))
    assert "objective 'leaky'" in out["leaky"] and "returned metrics ['surprise']" in out["leaky"]
    assert "Objective(metrics=...)" in out["leaky"]


FLOWS = """
import json, math
from deploy.metrics_log import train_record
from services.common.observability import Metrics
from services.learner.config import LearnerConfig
from services.learner.metric_names import METRIC_KEYS
from services.learner.metrics import LearnerMetrics
from services.learner.trainer import StepResult, merge_metrics

config = LearnerConfig(objective="mean_temp", objective_settings={"temperature": 2.0})
rank = dict.fromkeys(METRIC_KEYS, 0.0)
a = {**rank, "num_valid": 6.0, "num_tokens": 20.0, "baseline_mean": 0.5, "groups_seen": 3.0}
b = {**rank, "num_valid": 2.0, "num_tokens": 5.0, "baseline_mean": 0.1, "groups_seen": 1.0}
idle = {**rank, "baseline_mean": 0.0, "groups_seen": 0.0}  # a rank with nothing valid: its rule never ran
merged = merge_metrics([(a, [0.0] * 6), (b, [0.0] * 2), (idle, [])], 8.0, 1.0, config)
merged.update(grad_norm=1.0, lr=1e-6, recompute=0.0)
registry = Metrics("learner")
timings = {"gradient_s": 0.1, "optimizer_s": 0.1, "step_s": 0.2, "tokens_all_ranks": 25.0}
LearnerMetrics(registry, k=2).step(StepResult(1, 1, merged, timings), publish_s=0.0)
sample = registry.registry.get_sample_value
print(json.dumps({
    "merged": {k: merged[k] for k in ("baseline_mean", "groups_seen", "num_valid")},
    "gauge": {k: sample("vcpo_learner_objective_metric", {"metric": k}) for k in ("baseline_mean", "groups_seen")},
    "record": train_record({"step": 1, "version": 1, "metrics": merged}, None, None)["objective_metrics"],
}))
"""


def test_the_objectives_metrics_merge_over_ranks_and_reach_prometheus_and_the_metrics_log(
    objective_dir: Path,
) -> None:
    out = run_python(objective_dir, FLOWS)
    mean = (0.5 * 6 + 0.1 * 2) / 8  # weighted by each rank's valid trajectories; the idle rank weighs 0
    assert out["merged"] == {"baseline_mean": pytest.approx(mean), "groups_seen": 4.0, "num_valid": 8.0}
    assert out["gauge"] == {"baseline_mean": pytest.approx(mean), "groups_seen": 4.0}
    assert out["record"] == {"baseline_mean": pytest.approx(mean), "groups_seen": 4.0}


def test_the_chart_takes_the_dropped_in_objective_and_its_settings(
    objective_dir: Path, tmp_path: Path
) -> None:
    """The guide's route on Kubernetes: the file on the shared volume, the variable on every Ray container
    (the launcher's, on the head, and the learner's ranks) through the chart's extraEnv."""
    values = tmp_path / "values.yaml"
    where = {"name": "VCPO_OBJECTIVES_PATH", "value": "/data/objectives"}
    chart_values = {"learner": {"objective": "mean_temp", "objectiveSettings": {"temperature": 2.0}}}
    values.write_text(yaml.safe_dump({**chart_values, "extraEnv": [where]}))
    docs = render("-f", str(values))
    text = one(docs, "ConfigMap", "run-config")["data"]["run.toml"]
    assert "[learner.objective_settings]" in text
    for name in ("head", "learner"):
        assert where in container(group(docs, name))["env"], name
    out = run_python(objective_dir, VALIDATE, str(tmp_path), text)
    assert out["0"] == {"objective": "mean_temp", "settings": {"temperature": 2.0}}
    # the schema checks the name's form and that the settings are a table
    for flag, where in (
        ("learner.objective=Mean-Temp", "/learner/objective"),
        ("learner.objectiveSettings=3", "/learner/objectiveSettings"),
    ):
        bad = helm("template", "r", str(ROOT / "helm" / "vcpo-rl"), "--set", flag)
        assert bad.returncode != 0 and where in errors(bad), errors(bad)


def test_the_stability_grid_takes_the_dropped_in_objective_without_an_edit(
    objective_dir: Path, tmp_path: Path
) -> None:
    code = "import runpy, sys; sys.argv = ['stability.py', *sys.argv[1:]]; runpy.run_path('experiments/stability.py', run_name='__main__')"
    out = run_python(
        objective_dir,
        code,
        "--dry-run",
        "--methods",
        "tis",
        "--objectives",
        "mean_temp",
        "--method",
        'mean_temp_t4={objective = "mean_temp", objective_settings = {temperature = 4.0}}',
    )
    assert out["methods"] == {
        "tis": {
            "objective": "grpo",
            "importance_weighting": "truncated",
            "truncation": 8.0,
            "ess_rule": "off",
        },
        "mean_temp": {"objective": "mean_temp"},
        "mean_temp_t4": {"objective": "mean_temp", "objective_settings": {"temperature": 4.0}},
    }
    assert out["out"] == "runs/stability"  # never the committed results unless named
    env = {**os.environ, "VCPO_OBJECTIVES_PATH": str(objective_dir)}
    bad = subprocess.run(
        [
            sys.executable,
            "experiments/stability.py",
            "--dry-run",
            "--method",
            'm={objective = "mean_temp", objective_settings = {temperature = -1.0}}',
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert bad.returncode != 0 and "method 'm'" in bad.stderr
    assert "learner.objective_settings.temperature = -1.0" in bad.stderr


@pytest.mark.slow
def test_a_stability_run_of_the_dropped_in_objective_records_its_metrics(
    objective_dir: Path, tmp_path: Path
) -> None:
    """The replay itself (the tiny model, warm-started, a lag of 2) on the new objective: its runs.jsonl
    carries the objective's metrics per step, and the results go where --out says."""
    env = {**os.environ, "VCPO_OBJECTIVES_PATH": str(objective_dir)}
    out = tmp_path / "out"
    args = ["--quick", "--methods", "no-correction", "--objectives", "mean_temp", "--ks", "2", "--steps", "3"]
    done = subprocess.run(
        [
            sys.executable,
            "experiments/stability.py",
            *args,
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "work"),
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()[1:]]
    mine = next(r for r in runs if r["method"] == "mean_temp")
    assert mine["fields"] == {"objective": "mean_temp"} and len(mine["steps"]["baseline_mean"]) == 3
    assert all(math.isfinite(v) for v in mine["steps"]["baseline_mean"])
    assert mine["steps"]["groups_seen"] == [4.0, 4.0, 4.0]  # the preset's groups per step
    assert "mean_temp" in (out / "stability.md").read_text()
