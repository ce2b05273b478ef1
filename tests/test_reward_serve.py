"""The reward service as a Ray Serve application: it scores the stream and scales out on queue depth."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.reward.autoscaling import QueueDepthPolicy, replicas_for_depth
from tests.test_reward_service import make_group, reward_config, scored_groups
from vcpo.v1 import reward_pb2, rollout_pb2


def test_replicas_follow_queue_depth_within_bounds() -> None:
    assert [replicas_for_depth(d, 4, 1, 3) for d in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="target_queue_depth"):
        replicas_for_depth(3, 0, 1, 2)

    def ctx(metrics: dict[str, Any]) -> Any:
        return SimpleNamespace(
            aggregated_metrics=metrics,
            target_num_replicas=2,
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=4,
        )

    policy = QueueDepthPolicy(target_queue_depth=8)
    assert policy(ctx({})) == (2, {})  # nothing reported yet: no change
    assert policy(ctx({"queue_depth": {"a": 3.0, "b": 20.0}})) == (3, {"queue_depth": 20.0})
    assert policy(ctx({"queue_depth": {"a": 0.0}}))[0] == 1


@pytest.mark.slow
def test_serve_app_scores_the_stream_and_scales_out_on_queue_depth(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path, ray_local: Any
) -> None:
    from ray import serve

    from services.reward.serve_app import APP_NAME, deploy_reward

    cfg = reward_config(
        redis_url,
        tmp_path,
        workers=1,
        min_replicas=1,
        max_replicas=2,
        target_queue_depth=2,
        timeouts={"test_sleepy": 30.0},
    )
    specs = stream_specs(cfg.run, cfg.streams)
    task = rollout_pb2.Task(task_id="slow:1", scorer="test_sleepy", metadata={"sleep_s": "0.5"})
    groups = [(make_group(f"g{i}", task, ["a", "b"]), i % 3) for i in range(16)]
    StreamProducer(redis_client, specs["rollouts"]).put_many(groups)

    handle = deploy_reward(cfg, upscale_delay_s=0.0, downscale_delay_s=600.0, metrics_push_interval_s=0.5)
    try:
        most = 0
        deadline = time.monotonic() + 120
        while redis_client.xlen(specs["scored"].key) < len(groups):
            status = serve.status().applications[APP_NAME].deployments["RewardDeployment"]
            most = max(most, status.replica_states.get("RUNNING", 0))
            assert time.monotonic() < deadline, f"only {redis_client.xlen(specs['scored'].key)} scored"
            time.sleep(0.2)
        assert most == 2, "the backlog (16 groups, target 2 per replica) should have added a replica"

        scored = scored_groups(redis_client, cfg)
        assert sorted(g.group_id for _, g in scored) == sorted(g.group_id for g, _ in groups)  # each once
        assert all(t.reward.value == 1.0 for _, g in scored for t in g.trajectories)
        assert redis_client.xlen(specs["rollouts"].key) == 0

        request = reward_pb2.ScoreBatchRequest(
            requests=[
                reward_pb2.ScoreRequest(task=rollout_pb2.Task(reference="#### 1,234"), response_text=text)
                for text in ("so 1234", "1243")
            ]
        )
        reply = reward_pb2.ScoreBatchResponse.FromString(
            handle.score_batch.remote(request.SerializeToString()).result(timeout_s=60)
        )
        assert [r.value for r in reply.rewards] == [1.0, 0.0]
    finally:
        # the handle's router pushes metrics from a thread of its own: left running, it outlived the session's
        # ray.shutdown and its next push auto-started a Ray instance as pytest exited (a logging error in CI)
        handle.shutdown()
        serve.delete(APP_NAME)
