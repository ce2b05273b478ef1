"""The Helm chart: lints, renders the run config every service reads, rejects bad values by schema."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy.config import SystemConfig
from services.common.config import load_config

ROOT = Path(__file__).parent.parent
HELM = ROOT / ".tools" / "bin" / "helm"
CHART = ROOT / "helm" / "vcpo-rl"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM.exists(), f"{HELM} missing: `make setup` unpacks helm there"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, cwd=ROOT)


def test_chart_lints() -> None:
    out = helm("lint", str(CHART), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_run_config_is_a_valid_run_file(tmp_path: Path) -> None:
    out = helm(
        "template", "r", str(CHART), "--set", "run.k=16", "--set", "run.groupsPerStep=32",
        # 32 groups per step: checkpoints every 25 steps keep (25 + 1) * 32 = 832 scored groups <= the 1024
        # the stream holds (the default 50 would be refused: the learner acknowledges only at checkpoints)
        "--set-string", "extraConfig=[sampler]\nn = 4\n[learner]\ncheckpoint_every = 25\n",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    run_toml = config_map["data"]["run.toml"]
    tomllib.loads(run_toml)
    path = tmp_path / "run.toml"
    path.write_text(run_toml)
    cfg = load_config(SystemConfig, [path], env={})
    assert (cfg.run.k, cfg.run.groups_per_step, cfg.sampler.n, cfg.learner.checkpoint_every) == (
        16,
        32,
        4,
        25,
    )

    import kubernetes_validate

    kubernetes_validate.validate(config_map, "1.31", strict=True)


@pytest.mark.parametrize(
    ("flag", "message"),
    [("run.k=-1", "/run/k"), ("run.groupsPerStep=0", "/run/groupsPerStep"), ("run.kk=3", "kk")],
)
def test_bad_values_fail_at_install(flag: str, message: str) -> None:
    out = helm("template", "r", str(CHART), "--set", flag)
    assert out.returncode != 0
    assert message in out.stderr
