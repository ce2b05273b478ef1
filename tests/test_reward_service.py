"""The reward service on real parts: worker processes, Redis streams, the gRPC API, a killed replica."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.reward.config import RewardServiceConfig
from services.reward.pool import ScoringPool
from services.reward.scorers import ScoreInput
from vcpo.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

RUN = "rw"
PLUGINS = ["tests.reward_plugins"]


def reward_config(redis_url: str, run_dir: Path, **reward: Any) -> RewardServiceConfig:
    settings: dict[str, Any] = {
        "workers": 2,
        "plugins": PLUGINS,
        "timeouts": {"test_sleepy": 1.0},
        "fallback_reward": -1.0,
        "grpc_port": 0,
        "metrics_port": 0,
        "default_scorer": "math",
    }
    settings.update(reward)
    return RewardServiceConfig.model_validate(
        {
            "run": {"run_id": RUN, "redis_url": redis_url, "run_dir": str(run_dir)},
            "streams": {"block_ms": 100, "reclaim_idle_ms": 1000},
            "reward": settings,
        }
    )


def make_group(group_id: str, task: rollout_pb2.Task, texts: list[str], version: int = 0) -> Any:
    group = rollout_pb2.TrajectoryGroup(
        group_id=group_id, run_id=RUN, policy_version_start=version, policy_version_end=version
    )
    group.task.CopyFrom(task)
    for text in texts:
        group.trajectories.add(
            text=text,
            response_tokens=[5, 6],
            behaviour_logprobs=[-0.5, -0.25],
            loss_mask=[True, True],
            policy_version_start=version,
            policy_version_end=version,
            finish_reason="stop",
        )
    return group


def specs_for(cfg: RewardServiceConfig) -> Any:
    return stream_specs(cfg.run, cfg.streams)


def scored_groups(client: redis.Redis, cfg: RewardServiceConfig) -> list[tuple[int, Any]]:
    key = specs_for(cfg)["scored"].key
    out = []
    for _id, fields in client.xrange(key):
        out.append(
            (int(fields[b"policy_version"]), rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"]))
        )
    return out


# --------------------------------------------------------------------------------------------- pool


def test_pool_enforces_time_limits_and_records_every_failure() -> None:
    timeouts = {"test_sleepy": 1.0}
    with ScoringPool(2, lambda s: timeouts.get(s, 10.0), fallback_reward=-1.0, plugins=PLUGINS) as pool:
        slow = pool.score("test_sleepy", ScoreInput("x", metadata={"sleep_s": "30"}))
        assert (slow.failed, slow.reason, slow.value) == (True, "timeout", -1.0)
        assert "longer than 1s" in slow.message and 0.9 < slow.latency_s < 5.0
        assert pool.replaced == 1
        fine = pool.score("test_sleepy", ScoreInput("x", metadata={"sleep_s": "0"}))
        assert (fine.failed, fine.value, fine.components) == (False, 1.0, {"slept": 1.0})

        died = pool.score("test_crash", ScoreInput("x"))
        assert (died.failed, died.reason) == (True, "worker_died") and "exit code 3" in died.message
        raised = pool.score("test_raise", ScoreInput("x", task_id="t-9"))
        assert raised.reason == "exception" and "scorer bug on task t-9" in raised.message
        nan = pool.score("test_nan", ScoreInput("x"))
        assert nan.reason == "nonfinite_reward" and nan.value == -1.0
        unknown = pool.score("no_such_scorer", ScoreInput("x"))
        assert unknown.reason == "unknown_scorer" and "test_length" in unknown.message

        # a batch keeps its order; a timeout in it costs one response's reward, not the batch
        jobs = [("test_length", ScoreInput("a" * i)) for i in range(6)]
        jobs.insert(3, ("test_sleepy", ScoreInput("x", metadata={"sleep_s": "30"})))
        outcomes = pool.score_many(jobs)
        assert [o.value for o in outcomes] == [0.0, 1.0, 2.0, -1.0, 3.0, 4.0, 5.0]
        assert [o.reason for o in outcomes if o.failed] == ["timeout"]


def test_pool_start_fails_clearly_on_a_bad_plugin() -> None:
    with pytest.raises(ImportError, match="no_such_plugin_module"):
        ScoringPool(1, lambda s: 1.0, plugins=["no_such_plugin_module"])


# ----------------------------------------------------------------------------------- stream service


def run_service(cfg: RewardServiceConfig, max_groups: int) -> tuple[Any, dict[str, Any]]:
    from services.reward.service import RewardService

    service = RewardService(cfg, "reward-0")
    try:
        summary = service.serve(threading.Event(), max_groups)
        return service, summary
    finally:
        service.close()


def test_service_scores_every_response_and_hands_groups_on(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = reward_config(redis_url, tmp_path)
    specs = specs_for(cfg)
    math_task = rollout_pb2.Task(task_id="gsm8k:1", prompt="?", reference="Half of 144 is #### 72")
    countdown = rollout_pb2.Task(
        task_id="cd:1", scorer="countdown", reference='{"target": 24, "numbers": [4, 6, 1]}'
    )
    slow = rollout_pb2.Task(task_id="slow:1", scorer="test_sleepy", metadata={"sleep_s": "30"})
    groups = [
        (make_group("g-math", math_task, ["So 144/2 = 72.", "I think 70", "\\boxed{72}"], version=2), 2),
        (make_group("g-cd", countdown, ["<answer>4*6*1</answer>", "<answer>4*6*6</answer>"], 3), 3),
        (make_group("g-slow", slow, ["a", "b"], 4), 4),
    ]
    StreamProducer(redis_client, specs["rollouts"]).put_many(groups)

    service, summary = run_service(cfg, max_groups=3)

    out = {g.group_id: (v, g) for v, g in scored_groups(redis_client, cfg)}
    assert sorted(out) == ["g-cd", "g-math", "g-slow"]
    assert {gid: v for gid, (v, _) in out.items()} == {"g-math": 2, "g-cd": 3, "g-slow": 4}
    rewards = {gid: [t.reward.value for t in g.trajectories] for gid, (_, g) in out.items()}
    assert rewards == {"g-math": [1.0, 0.0, 1.0], "g-cd": [1.0, 0.0], "g-slow": [-1.0, -1.0]}
    math_group = out["g-math"][1]
    assert {t.reward.scorer for t in math_group.trajectories} == {"math"}  # the default scorer
    assert all(not t.reward.failed for t in math_group.trajectories)
    assert math_group.scored_unix > 0 and list(math_group.trajectories[0].response_tokens) == [5, 6]
    for t in out["g-slow"][1].trajectories:
        assert t.reward.failed and t.reward.failure_reason.startswith("timeout: scorer 'test_sleepy'")
    assert redis_client.xlen(specs["rollouts"].key) == 0
    assert summary["groups_scored"] == 3 and summary["fallback_rewards"] == 2

    text = service.registry.exposition().decode()
    assert 'vcpo_reward_failures_total{reason="timeout",scorer="test_sleepy"} 2.0' in text
    assert 'vcpo_reward_groups_scored_total{replica="reward-0"} 3.0' in text
    assert 'vcpo_reward_value_count{task="gsm8k"} 3.0' in text
    assert 'vcpo_reward_group_mean{task="cd"} 0.5' in text
    assert 'vcpo_reward_score_latency_seconds_count{scorer="countdown"} 2.0' in text
    assert "vcpo_reward_queue_depth 0.0" in text and "vcpo_reward_groups_per_second{" in text


# ---------------------------------------------------------------------------------------- gRPC API


@pytest.mark.slow
def test_grpc_api_scores_and_survives_hostile_code(redis_url: str, tmp_path: Path) -> None:
    from services.reward.service import RewardService

    service = RewardService(reward_config(redis_url, tmp_path, timeouts={"code": 30.0}), "reward-0")
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{service.server.port}")
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        names = stub.ListScorers(reward_pb2.ListScorersRequest()).scorers
        assert {"exact_match", "math", "countdown", "code", "environment", "test_sleepy"} <= set(names)

        task = rollout_pb2.Task(task_id="m:1", reference="\\frac{1}{2}")
        one = stub.Score(reward_pb2.ScoreRequest(task=task, response_text="It is 0.5"))
        assert (one.reward.value, one.reward.scorer, one.reward.failed) == (1.0, "math", False)
        env = stub.Score(reward_pb2.ScoreRequest(task=task, scorer="environment", environment_reward=0.25))
        assert env.reward.value == 0.25
        missing = stub.Score(reward_pb2.ScoreRequest(task=task, scorer="environment"))
        assert missing.reward.failed and missing.reward.failure_reason.startswith("no_environment_reward")

        batch = stub.ScoreBatch(
            reward_pb2.ScoreBatchRequest(
                requests=[reward_pb2.ScoreRequest(task=task, response_text=t) for t in ("1/2", "2", "0.50")]
            )
        )
        assert [r.value for r in batch.rewards] == [1.0, 0.0, 1.0]

        with pytest.raises(grpc.RpcError) as err:
            stub.Score(reward_pb2.ScoreRequest(task=task, scorer="nope"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown scorer 'nope'" in str(
            err.value
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.ScoreBatch(
                reward_pb2.ScoreBatchRequest(requests=[reward_pb2.ScoreRequest(scorer="nope")] * 2)
            )
        assert "request 0: unknown scorer" in str(err.value.details())

        tests = rollout_pb2.Task(task_id="c:1", scorer="code", reference="assert f(2) == 4")
        hostile = [
            "```python\nwhile True:\n    pass\n```",
            "```python\nx = bytearray(10**11)\n```",
            "```python\nimport os\nwhile True:\n    os.fork()\n```",
            "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 6379))\n```",
        ]
        for code in hostile:
            reward = stub.Score(reward_pb2.ScoreRequest(task=tests, response_text=code)).reward
            assert (reward.value, reward.failed) == (0.0, False), code
        good = stub.Score(
            reward_pb2.ScoreRequest(task=tests, response_text="```python\ndef f(x):\n    return x*x\n```")
        )
        assert good.reward.value == 1.0
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        channel.close()
    finally:
        service.close()


# ------------------------------------------------------------------------------------ killed replica


def start_replica(config: Path, replica: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.reward", "--config", str(config), "--replica", str(replica), *extra],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
def test_a_replica_killed_mid_group_is_covered_by_another_exactly_once(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nrun_id = "{RUN}"\nredis_url = "{redis_url}"\nrun_dir = "{tmp_path}"\n'
        "[streams]\nblock_ms = 100\nreclaim_idle_ms = 1500\n"
        f"[reward]\nworkers = 2\nplugins = {PLUGINS!r}\ntimeouts = {{test_sleepy = 60.0}}\n".replace("'", '"')
        + "grpc_port = 0\nmetrics_port = 0\n"
    )
    cfg = reward_config(redis_url, tmp_path)
    specs = specs_for(cfg)
    task = rollout_pb2.Task(task_id="slow:1", scorer="test_sleepy", metadata={"sleep_s": "4"})
    StreamConsumer(
        redis_client, specs["rollouts"], "observer"
    )  # the consumer group, to watch its pending list
    StreamProducer(redis_client, specs["rollouts"]).put(make_group("g-kill", task, ["a", "b", "c"]), 7)

    first = start_replica(config, 0)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pending: Any = redis_client.xpending_range(specs["rollouts"].key, "reward", "-", "+", 10)
            if pending and pending[0]["consumer"] == b"reward-0":
                break
            assert first.poll() is None, first.stdout.read().decode() if first.stdout else ""
            time.sleep(0.1)
        else:
            pytest.fail("the first replica never took the group")
        time.sleep(1.0)  # mid-group: its workers are sleeping in the scorer
        children = psutil.Process(first.pid).children(recursive=True)
        assert children, "the replica should have scoring worker processes"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    _gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"scoring workers outlived their killed replica: {alive}"
    assert redis_client.xlen(specs["scored"].key) == 0  # nothing was written by the killed one

    second = start_replica(config, 1, "--max-groups", "1")
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out.decode()[-3000:]

    scored = scored_groups(redis_client, cfg)
    assert [(v, g.group_id) for v, g in scored] == [(7, "g-kill")]
    assert [t.reward.value for t in scored[0][1].trajectories] == [1.0, 1.0, 1.0]
    assert redis_client.xlen(specs["rollouts"].key) == 0
    assert redis_client.xpending(specs["rollouts"].key, "reward")["pending"] == 0
    assert not any(math.isnan(t.reward.value) for t in scored[0][1].trajectories)
    assert os.path.exists(tmp_path / "reward" / "reward-1.summary.json")


def test_a_replica_restarted_under_its_name_first_redoes_what_it_left_pending(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = reward_config(redis_url, tmp_path, workers=1)
    cfg = cfg.model_copy(update={"streams": cfg.streams.model_copy(update={"reclaim_idle_ms": 600_000})})
    specs = specs_for(cfg)
    task = rollout_pb2.Task(task_id="t:1", scorer="test_length")
    StreamProducer(redis_client, specs["rollouts"]).put_many(
        [(make_group(f"g{i}", task, ["x" * i]), i) for i in range(3)]
    )
    crashed = StreamConsumer(redis_client, specs["rollouts"], "reward-0")
    assert len(crashed.read(count=3)) == 3  # taken, then "crashed" before scoring any

    _service, summary = run_service(cfg, max_groups=3)  # the idle time (600 s) rules out a reclaim

    assert summary["groups_scored"] == 3
    assert sorted((v, g.group_id) for v, g in scored_groups(redis_client, cfg)) == [
        (0, "g0"),
        (1, "g1"),
        (2, "g2"),
    ]
    assert redis_client.xpending(specs["rollouts"].key, "reward")["pending"] == 0
