"""The sampler's task feed on a real Redis: stream before dataset, acknowledgement after the group, keep-alive."""

from __future__ import annotations

import time

import pytest
import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.datasets import load_dataset
from services.common.prompts import PromptEncoder
from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.common.tiny_model import build_tokenizer
from services.sampler.feed import TaskFeed
from services.sampler.tasks import DatasetTasks
from vcpo.v1 import rollout_pb2


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(build_tokenizer(), max_model_len=256, max_tokens=16)


def test_stream_tasks_come_first_and_stay_ours_until_done(
    redis_client: redis.Redis, encoder: PromptEncoder
) -> None:
    spec = stream_specs(RunConfig(run_id="feed"), StreamsConfig())["tasks"]
    ours = StreamConsumer(redis_client, spec, "sampler-0", reclaim_idle_ms=300)
    other = StreamConsumer(redis_client, spec, "sampler-1", reclaim_idle_ms=300)
    feed = TaskFeed(encoder, DatasetTasks(load_dataset("builtin:arith")), ours)
    StreamProducer(redis_client, spec).put(rollout_pb2.Task(task_id="mine", prompt="What is 1+1?"), 0)
    first = feed.next()
    assert first is not None and first.task.task_id == "mine" and first.entry_id is not None
    assert first.prompt_tokens == encoder.encode(first.task)
    assert feed.next().task.task_id.startswith("arith:")  # then the dataset
    for _ in range(8):  # a long generation: the entry is kept alive, so another replica cannot take it
        time.sleep(0.1)
        feed.keep_alive()
        assert other.reclaim() == []
    feed.done(first)
    assert redis_client.xlen(spec.key) == 0  # acknowledged (and deleted) once its group is written


def test_a_stopped_replicas_tasks_are_reclaimed(redis_client: redis.Redis, encoder: PromptEncoder) -> None:
    spec = stream_specs(RunConfig(run_id="feed2"), StreamsConfig())["tasks"]
    dead = TaskFeed(encoder, None, StreamConsumer(redis_client, spec, "sampler-0", reclaim_idle_ms=200))
    StreamProducer(redis_client, spec).put(rollout_pb2.Task(task_id="orphan", prompt="What is 2+2?"), 0)
    assert dead.next().task.task_id == "orphan"  # then it stops without finishing the task
    time.sleep(0.3)
    alive = TaskFeed(encoder, None, StreamConsumer(redis_client, spec, "sampler-1", reclaim_idle_ms=200))
    taken = alive.next()
    assert taken is not None and taken.task.task_id == "orphan"
    alive.done(taken)
    assert redis_client.xlen(spec.key) == 0 and alive.next() is None


def test_token_rate_counts_only_the_window() -> None:
    from services.common.observability import WindowRate

    rate = WindowRate(window_s=10)
    assert rate.rate(now=0.0) == 0.0
    for t in range(20):  # 100 tokens a second for 20 s
        rate.add(100, now=float(t))
    assert rate.rate(now=19.0) == pytest.approx(1100 / 10)  # the 11 events at 9..19 s, over 10 s
    assert rate.rate(now=100.0) == 0.0  # all aged out
    rate.add(50, now=100.0)
    assert rate.rate(now=100.0) == 50 / 1e-3
