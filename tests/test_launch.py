"""`make run`'s entry point: a bad configuration fails before anything starts (the run itself: test_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_cluster_of_several_nodes_needs_a_redis_every_node_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With launcher.ray_address and no run.redis_url, the launcher would start a redis-server on 127.0.0.1:
    services on the cluster's other nodes could not reach it, nor the weight group's rendezvous (its address
    follows the route to Redis). Refused once the cluster says it has several nodes; one node is fine. Ray's
    answers are stood in for (a cluster of several nodes cannot run here)."""
    import ray

    from deploy.config import SystemConfig
    from deploy.launcher_setup import init_ray

    alive: list[dict[str, bool]] = [{"Alive": True}, {"Alive": True}, {"Alive": False}]
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "nodes", lambda: alive)
    cluster = {"launcher": {"ray_address": "ray://head:10001"}}
    with pytest.raises(
        ValueError, match=r"run.redis_url is empty, and the Ray cluster at ray://head:10001 has 2 nodes"
    ):
        init_ray(SystemConfig.model_validate(cluster))
    with_redis = {**cluster, "run": {"redis_url": "redis://redis.rl.svc:6379/0"}}
    assert init_ray(SystemConfig.model_validate(with_redis)) == "connected to ray://head:10001 (2 nodes)"
    alive[1]["Alive"] = False
    assert init_ray(SystemConfig.model_validate(cluster)) == "connected to ray://head:10001 (1 node)"
