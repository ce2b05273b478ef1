"""Exactly-once hand-off between queues (services/common/handoff.py) on a real Redis."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.handoff import forward
from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamFullError, StreamProducer
from services.common.streams.specs import stream_specs
from vcpo.v1 import rollout_pb2


def specs(scored_maxlen: int = 100) -> Any:
    return stream_specs(RunConfig(run_id="hop"), StreamsConfig(scored_maxlen=scored_maxlen))


def group(group_id: str) -> rollout_pb2.TrajectoryGroup:
    return rollout_pb2.TrajectoryGroup(group_id=group_id)


def scored_ids(client: redis.Redis, key: str) -> list[tuple[int, str]]:
    return [
        (int(f[b"policy_version"]), rollout_pb2.TrajectoryGroup.FromString(f[b"payload"]).group_id)
        for _, f in client.xrange(key)
    ]


def test_forward_writes_once_even_when_an_entry_is_reclaimed(redis_client: redis.Redis) -> None:
    s = specs()
    StreamProducer(redis_client, s["rollouts"]).put(group("g"), 3)
    slow = StreamConsumer(redis_client, s["rollouts"], "slow")
    other = StreamConsumer(redis_client, s["rollouts"], "other")
    scored = StreamProducer(redis_client, s["scored"])
    (entry,) = slow.read(count=1)
    (taken,) = other.reclaim(min_idle_ms=0)
    assert taken.id == entry.id
    assert slow.touch([entry.id]) == []  # keeping an entry alive must not take it back
    assert other.touch([entry.id]) == [entry.id]
    assert forward(slow, entry.id, scored, entry.message, 3) is None  # not ours any more: nothing written
    assert redis_client.xlen(s["scored"].key) == 0
    assert forward(other, taken.id, scored, taken.message, 3) is not None
    assert forward(other, taken.id, scored, taken.message, 3) is None  # acknowledged: never twice
    assert scored_ids(redis_client, s["scored"].key) == [(3, "g")]
    assert redis_client.xlen(s["rollouts"].key) == 0
    assert redis_client.xpending(s["rollouts"].key, "reward")["pending"] == 0


def test_forward_waits_for_room_on_a_full_output_queue(redis_client: redis.Redis) -> None:
    s = specs(scored_maxlen=1)
    StreamProducer(redis_client, s["rollouts"]).put_many([(group("a"), 0), (group("b"), 1)])
    consumer = StreamConsumer(redis_client, s["rollouts"], "r")
    scored = StreamProducer(redis_client, s["scored"])
    learner = StreamConsumer(redis_client, s["scored"], "learner")
    first, second = consumer.read(count=2)
    assert forward(consumer, first.id, scored, first.message, 0)
    (seen,) = learner.read(count=1)

    threading.Timer(0.3, learner.ack, args=([seen.id],)).start()  # the learner makes room a bit later
    t0 = time.monotonic()
    assert forward(consumer, second.id, scored, second.message, 1)
    assert time.monotonic() - t0 >= 0.25 and not scored.waiting
    assert scored_ids(redis_client, s["scored"].key) == [(1, "b")]

    StreamProducer(redis_client, s["rollouts"]).put(group("c"), 2)
    (third,) = consumer.read(count=1)
    impatient = StreamProducer(redis_client, s["scored"], wait_timeout_s=0.2)
    with pytest.raises(StreamFullError, match="stayed full"):
        forward(consumer, third.id, impatient, third.message, 2)
    assert redis_client.xpending(s["rollouts"].key, "reward")["pending"] == 1  # still pending: redone later
    with pytest.raises(TypeError, match="carries"):
        forward(consumer, third.id, scored, rollout_pb2.Task(), 2)  # type: ignore[arg-type]
