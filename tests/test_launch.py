"""`make run`'s entry point: brings up every service through one training step and names what is missing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LOCAL = ROOT / "deploy" / "presets" / "local.toml"


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.launch", "--config", str(LOCAL), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_launch_brings_up_the_foundation_and_names_missing_services(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = launch("--run.run_dir", str(run_dir), "--run.k", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    for piece in (
        "[ok]      config",
        "[ok]      redis",
        "[ok]      streams",
        "[ok]      model",
        "[ok]      weight_broker",
        "[ok]      learner",
        "[ok]      reward-0",
        "[ok]      sampler-0",
        "[ok]      rollouts",
        "[ok]      first step",
    ):
        assert piece in out.stdout
    assert "vcpo:local:rollouts (queue, cap 64)" in out.stdout
    assert "[missing] ray launcher" in out.stdout and "issue 8" in out.stdout
    assert "[missing] reward" not in out.stdout and "[missing] sampler" not in out.stdout
    assert "published version 1" in out.stdout  # scored groups reached the learner, which trained on them
    assert "serving version 0" in (run_dir / "logs" / "sampler-0.log").read_text()
    written = re.search(
        r"(\d+) groups written so far \(the lag bound admits 12 before version 1\)", out.stdout
    )
    assert written and int(written.group(1)) >= 12
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["run"]["k"] == 2  # the flag won over the preset
    assert resolved["run"]["redis_url"].startswith("redis://127.0.0.1:")  # what the services were handed
    assert resolved["weight_broker"]["grpc_port"] > 0
    assert "serving on gRPC port" in (run_dir / "logs" / "weight_broker.log").read_text()
    broker = f"127.0.0.1:{resolved['weight_broker']['grpc_port']}"
    assert f"version 0 published to {broker}" in (run_dir / "logs" / "learner.log").read_text()
    assert (run_dir / "model" / "config.json").exists()
    assert (run_dir / "redis" / "appendonlydir").is_dir()  # the local Redis persisted into the run dir

    again = launch("--run.run_dir", str(run_dir))  # same run dir: reuses the built model
    assert again.returncode == 0, again.stdout + again.stderr


def test_launch_rejects_a_bad_value_before_starting_anything(tmp_path: Path) -> None:
    out = launch("--run.run_dir", str(tmp_path / "run"), "--set", "sampler.top_p=2")
    assert out.returncode == 2
    assert (
        "sampler.top_p = 2 (from --set sampler.top_p=2): Input should be less than or equal to 1"
        in out.stderr
    )
    assert not (tmp_path / "run").exists()
