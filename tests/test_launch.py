"""`make run`'s entry point: a bad configuration fails before anything starts (the run itself: test_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LOCAL = ROOT / "deploy" / "presets" / "local.toml"


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.launch", "--config", str(LOCAL), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_launch_rejects_a_bad_value_before_starting_anything(tmp_path: Path) -> None:
    out = launch("--run.run_dir", str(tmp_path / "run"), "--set", "sampler.top_p=2")
    assert out.returncode == 2
    assert (
        "sampler.top_p = 2 (from --set sampler.top_p=2): Input should be less than or equal to 1"
        in out.stderr
    )
    assert not (tmp_path / "run").exists()


def test_the_k_flag_sets_the_lag_bound_and_is_checked(tmp_path: Path) -> None:
    out = launch("--run.run_dir", str(tmp_path / "run"), "--k", "-1")
    assert out.returncode == 2
    assert "run.k = -1 (from --set run.k=-1): Input should be greater than or equal to 0" in out.stderr


def test_a_scored_stream_too_small_for_the_checkpoint_interval_is_refused(tmp_path: Path) -> None:
    out = launch("--run.run_dir", str(tmp_path / "run"), "--learner.checkpoint_every", "20")
    assert out.returncode == 2
    assert (
        "streams.scored_maxlen = 64 is less than (learner.checkpoint_every + 1) * run.groups_per_step = 84"
        in (out.stderr)
    )


def test_a_gpu_learner_beside_samplers_that_hold_no_gpu_is_refused(tmp_path: Path) -> None:
    out = launch("--run.run_dir", str(tmp_path / "run"), "--learner.gpus_per_rank", "1")
    assert out.returncode == 2
    assert "sampler.gpus_per_replica = 0 while learner.gpus_per_rank = 1" in out.stderr
    assert "set sampler.gpus_per_replica = 1 (sampler.tensor_parallel_size)" in out.stderr
    assert not (tmp_path / "run").exists()
