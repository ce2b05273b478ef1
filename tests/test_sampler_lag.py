"""The lag bound end to end: two sampler replicas (``python -m services.sampler``, real vLLM each) share one
admission counter while a learner stand-in consumes their groups and publishes new versions at random
intervals."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from services.common.config import RunConfig, StreamsConfig, write_resolved
from services.common.streams.specs import stream_specs
from tests.sampler_helpers import LearnerStandIn, announcing_broker, sampler_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
STEPS = 6


@pytest.mark.parametrize("k", [0, 2])
def test_two_replicas_never_feed_a_step_past_the_lag_bound(
    k: int, redis_client: redis.Redis, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = RunConfig(
        run_id=f"lag{k}",
        k=k,
        groups_per_step=4,
        model=str(tiny_model_dir),
        redis_url=redis_url,
        run_dir=tmp_path,
    )
    broker = announcing_broker(redis_client, run)
    cfg = sampler_config(
        run, broker, n=2, max_tokens=24, kv_cache_memory_bytes=32 << 20, max_requests_in_flight=4
    )
    config = write_resolved(cfg, tmp_path, "sampler.json")
    learner = LearnerStandIn(redis_client, run, broker.client(), tiny_model_dir)
    learner.publish(0)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "services.sampler", "--config", str(config), "--replica", str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"sampler-{i}.log").open("w"),
        )
        for i in range(2)
    ]
    rng = random.Random(k)
    try:
        for _ in range(STEPS):
            time.sleep(rng.uniform(0.0, 1.0))  # the learner's step takes a while, never the same
            learner.step(timeout_s=180)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
        broker.stop()
    logs = "\n".join((tmp_path / f"sampler-{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs

    assert len(learner.consumed) == STEPS * run.groups_per_step
    for step, group in learner.consumed:
        assert step - group.policy_version_start <= k, (step, group.group_id, group.policy_version_start)
        if k == 0:  # synchronous: every group of step t comes from version t
            assert group.policy_version_start == group.policy_version_end == step
    if k == 0:
        assert not learner.dropped
    summaries = [
        json.loads((tmp_path / "sampler" / f"sampler-{i}.summary.json").read_text()) for i in range(2)
    ]
    assert all(s["groups_emitted"] > 0 for s in summaries), summaries  # both replicas did work
    # what the samplers wrote was consumed, dropped by the stand-in as too old (counted there), or is still queued
    emitted = sum(s["groups_emitted"] for s in summaries)
    queued = redis_client.xlen(stream_specs(run, StreamsConfig())["rollouts"].key)
    assert emitted == len(learner.consumed) + len(learner.dropped) + queued
    # the shared counter: admitted groups that were neither given back nor trained on are in the queue
    started = int(redis_client.get(f"vcpo:{run.run_id}:admission:started") or 0)
    assert started == len(learner.consumed) + queued
    # a sampler never started a group past the bound of the newest version it could have held
    assert started <= (learner.version + k + 1) * run.groups_per_step


def test_ray_actor_replica_runs_the_same_service(
    redis_client: redis.Redis, redis_url: str, tiny_model_dir: Path, tmp_path: Path, ray_local: object
) -> None:
    import ray

    from services.sampler.ray_actor import start_samplers

    run = RunConfig(
        run_id="ray", k=1, groups_per_step=2, model=str(tiny_model_dir), redis_url=redis_url, run_dir=tmp_path
    )
    specs = stream_specs(run, StreamsConfig())
    broker = announcing_broker(redis_client, run, retain=2)
    try:
        LearnerStandIn(redis_client, run, broker.client(), tiny_model_dir).publish(0)
        cfg = sampler_config(
            run, broker, n=2, max_tokens=8, max_model_len=128, kv_cache_memory_bytes=16 << 20
        )
        actors, runs = start_samplers(cfg, max_groups=4)  # k = 1: exactly the 4 groups version 0 may start
        (summary,) = ray.get(runs, timeout=240)
        status = ray.get(actors[0].status.remote())
    finally:
        broker.stop()
    assert summary["groups_emitted"] == 4 and summary["policy_version"] == 0
    assert status["policy_version"] == 0 and status["figures"]["groups_emitted"] == 4
    entries = redis_client.xrange(specs["rollouts"].key)
    assert len(entries) == 4 and all(f[b"policy_version"] == b"0" for _, f in entries)
