"""Restarts counted from service starts (services/common/starts.py), against a real redis-server: the
launcher's `vcpo_service_restarts_total{service}` and the report's restart figures come from these."""

from __future__ import annotations

import redis

from services.common.starts import clear, record_start, record_start_quietly, record_stop, restarts


def test_restarts_are_starts_after_the_first_and_dead_reward_replicas(redis_client: redis.Redis) -> None:
    run = "starts"
    assert restarts(redis_client, run, {"reward": 0}) == {"reward": 0}  # nothing started yet
    # Ray restarts a sampler replica and the broker under their own names: every start after the first
    assert record_start(redis_client, run, "sampler", "sampler-0") == 1
    record_start(redis_client, run, "sampler", "sampler-1")
    assert record_start(redis_client, run, "sampler", "sampler-0") == 2
    record_start(redis_client, run, "weight_broker", "weight_broker")
    assert restarts(redis_client, run) == {"sampler": 1, "weight_broker": 0}
    record_start(redis_client, run, "sampler", "sampler-0")
    record_start(redis_client, run, "weight_broker", "weight_broker")
    assert restarts(redis_client, run) == {"sampler": 2, "weight_broker": 1}

    # Serve names each reward replica anew: scaling up and down is no restart, a replica that vanished is
    for name in ("reward-a", "reward-b"):
        record_start(redis_client, run, "reward", name)
    assert restarts(redis_client, run, {"reward": 2})["reward"] == 0  # both run
    record_stop(redis_client, run, "reward", "reward-b")  # scaled down on request
    assert restarts(redis_client, run, {"reward": 1})["reward"] == 0
    record_start(redis_client, run, "reward", "reward-c")  # reward-a died; Serve started reward-c
    assert restarts(redis_client, run, {"reward": 1})["reward"] == 1

    assert restarts(redis_client, "another-run") == {}  # per run
    clear(redis_client, run)  # a new launch counts its own
    assert restarts(redis_client, run, {"reward": 0}) == {"reward": 0}


def test_a_start_that_cannot_be_recorded_does_not_stop_the_service() -> None:
    assert record_start_quietly("redis://127.0.0.1:1/0", "r", "sampler", "sampler-0") == 0
