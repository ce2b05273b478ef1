"""The stream layer against a real redis-server: round-trips, reclaim, back-pressure, malformed entries."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.observability import Metrics
from services.common.streams.consumer import StreamConsumer, StreamTail
from services.common.streams.metrics import StreamMetrics
from services.common.streams.producer import StreamFullError, StreamProducer
from services.common.streams.specs import MalformedEntryError, connect, decode_entry, stream_specs
from services.common.synthetic import make_announcement, make_group, make_task
from vcpo.v1 import rollout_pb2


def specs(run_id: str = "t", **streams: int):
    return stream_specs(RunConfig(run_id=run_id), StreamsConfig(**streams))


def test_every_stream_message_type_round_trips(redis_client: redis.Redis) -> None:
    s = specs()
    samples = {
        "tasks": [(make_task(i), 0) for i in range(3)],
        "rollouts": [(make_group(i, n=4, response_len=64, policy_version=5), 5) for i in range(3)],
        "scored": [(make_group(i, n=4, response_len=64, policy_version=6, scored=True), 6) for i in range(3)],
    }
    for name, items in samples.items():
        producer = StreamProducer(redis_client, s[name])
        consumer = StreamConsumer(redis_client, s[name], "c0")
        ids = producer.put_many(items)
        entries = consumer.read(count=10)
        assert [e.id for e in entries] == ids
        for entry, (message, version) in zip(entries, items, strict=True):
            assert entry.message == message
            assert entry.policy_version == version
            assert type(entry.message) is s[name].message_type
        assert consumer.ack(ids) == len(ids)
        assert redis_client.xlen(s[name].key) == 0  # acknowledged entries are deleted

    # the weights log: every sampler tails it; the policy version is a plain field readable without decoding
    producer = StreamProducer(redis_client, s["weights"])
    tail = StreamTail(redis_client, s["weights"])
    announcements = [make_announcement(v) for v in (1, 2, 3)]
    for a in announcements:
        producer.put(a, a.policy_version)
    got = tail.read()
    assert [e.message for e in got] == announcements
    assert tail.read() == []  # follows from where it stopped
    latest = tail.latest()
    assert latest is not None and latest.policy_version == 3
    raw = redis_client.xrevrange(s["weights"].key, count=1)[0][1]
    assert raw[b"policy_version"] == b"3"
    assert raw[b"type"] == b"vcpo.v1.WeightAnnouncement"


def test_group_message_carries_everything_the_learner_needs(redis_client: redis.Redis) -> None:
    group = make_group(0, n=2, response_len=256, policy_version=9, scored=True)
    spec = specs()["scored"]
    StreamProducer(redis_client, spec).put(group, group.policy_version_start)
    got = StreamConsumer(redis_client, spec, "learner-0").read()[0].message
    t = got.trajectories[1]
    assert len(t.response_tokens) == len(t.behaviour_logprobs) == len(t.loss_mask) == 256
    assert not any(t.loss_mask[100:120]) and all(t.loss_mask[:100])
    assert (got.policy_version_start, got.policy_version_end) == (9, 10)
    assert [s.policy_version for s in t.version_segments] == [9, 10]
    assert t.reward.value == 1.0 and t.reward.scorer == "math"
    assert got.task.task_id == "task-0" and got.group_id == "group-0"


def test_log_stream_is_trimmed_to_its_cap(redis_client: redis.Redis) -> None:
    spec = specs(weights_maxlen=10)["weights"]
    producer = StreamProducer(redis_client, spec)
    for v in range(500):
        producer.put(make_announcement(v), v)
    # MAXLEN ~ trims by whole radix-tree nodes: bounded near the cap, never the whole history
    assert redis_client.xlen(spec.key) < 200
    assert StreamTail(redis_client, spec).latest().policy_version == 499  # type: ignore[union-attr]


def _consume_and_die(url: str, run_id: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    """Child process: read entries (delivering them to this consumer), then hang until killed, no ack."""
    client = redis.Redis.from_url(url)
    consumer = StreamConsumer(client, specs(run_id)["rollouts"], "doomed")
    got = consumer.read(count=6)
    assert len(got) == 6
    ready.set()  # type: ignore[attr-defined]
    time.sleep(600)


def test_killed_consumer_loses_nothing_and_each_entry_is_processed_once(
    redis_client: redis.Redis, redis_url: str
) -> None:
    spec = specs("kill")["rollouts"]
    producer = StreamProducer(redis_client, spec)
    sent = producer.put_many([(make_group(i, n=2, response_len=32), i) for i in range(10)])
    StreamConsumer(redis_client, spec, "survivor")  # the group exists before the child reads

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_consume_and_die, args=(redis_url, "kill", ready))
    child.start()
    try:
        assert ready.wait(60), "child consumer did not read its entries"
    finally:
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
    assert child.exitcode == -signal.SIGKILL

    survivor = StreamConsumer(redis_client, spec, "survivor", reclaim_idle_ms=200)
    processed: list[str] = []
    assert survivor.reclaim() == []  # not idle long enough yet: the owner might still be alive
    deadline = time.monotonic() + 10
    while len(processed) < len(sent) and time.monotonic() < deadline:
        entries = survivor.reclaim() + survivor.read(count=10)
        processed += [e.id for e in entries]
        survivor.ack([e.id for e in entries])
        time.sleep(0.05)
    assert sorted(processed) == sorted(sent)  # every entry, each exactly once
    assert len(set(processed)) == len(processed)
    # nothing left anywhere: not pending, not in the stream
    assert redis_client.xpending(spec.key, spec.group)["pending"] == 0
    assert redis_client.xlen(spec.key) == 0
    assert survivor.reclaim(min_idle_ms=0) == [] and survivor.read(count=10) == []


def test_two_reclaimers_never_take_the_same_entry(redis_client: redis.Redis) -> None:
    spec = specs()["rollouts"]
    StreamProducer(redis_client, spec).put_many([(make_group(i, n=1, response_len=8), 0) for i in range(50)])
    StreamConsumer(redis_client, spec, "dead").read(count=50)
    time.sleep(0.05)
    a = StreamConsumer(redis_client, spec, "a", reclaim_idle_ms=20)
    b = StreamConsumer(redis_client, spec, "b", reclaim_idle_ms=20)
    got: dict[str, list[str]] = {"a": [], "b": []}

    def run(name: str, consumer: StreamConsumer) -> None:
        for _ in range(10):
            got[name] += [e.id for e in consumer.reclaim(count=7)]

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got["a"]) + len(got["b"]) == 50
    assert not set(got["a"]) & set(got["b"])


def test_producer_blocks_on_a_full_stream_and_resumes(redis_client: redis.Redis) -> None:
    metrics = StreamMetrics(Metrics("test"))
    spec = specs(rollouts_maxlen=4)["rollouts"]
    producer = StreamProducer(redis_client, spec, metrics)
    consumer = StreamConsumer(redis_client, spec, "slow")
    producer.put_many([(make_group(i, n=1, response_len=8), 0) for i in range(4)])
    assert redis_client.xlen(spec.key) == 4

    done = threading.Event()
    written: list[str] = []

    def produce() -> None:
        written.extend(producer.put_many([(make_group(i, n=1, response_len=8), 1) for i in range(4, 7)]))
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    time.sleep(0.3)
    assert not done.is_set() and producer.waiting  # blocked: the stream holds 4 unacknowledged entries
    assert redis_client.xlen(spec.key) == 4
    # reading alone does not make room (read-but-unacked entries still count); acknowledging does
    first = consumer.read(count=2)
    time.sleep(0.1)
    assert not done.is_set()
    consumer.ack([e.id for e in first])
    deadline = time.monotonic() + 5
    while redis_client.xlen(spec.key) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert redis_client.xlen(spec.key) == 4  # resumed, and never past the cap
    assert not done.is_set()  # one entry still waits
    consumer.ack([e.id for e in consumer.read(count=1)])
    assert done.wait(5)
    thread.join()
    assert len(written) == 3 and not producer.waiting
    rest = consumer.read(count=10)
    assert [e.message.group_id for e in rest] == ["group-3", "group-4", "group-5", "group-6"]
    wait = metrics.wait.labels("rollouts")._value.get()
    assert wait > 0.2  # the blocked time is counted


def test_producer_wait_timeout_raises_a_clear_error(redis_client: redis.Redis) -> None:
    spec = specs(tasks_maxlen=2)["tasks"]
    producer = StreamProducer(redis_client, spec, wait_timeout_s=0.2)
    producer.put_many([(make_task(0), 0), (make_task(1), 0)])
    with pytest.raises(
        StreamFullError, match=r"stayed full \(2 unacknowledged entries\).*0 of 1 entries written"
    ):
        producer.put(make_task(2), 0)


def test_producer_rejects_wrong_message_type_and_negative_version(redis_client: redis.Redis) -> None:
    producer = StreamProducer(redis_client, specs()["tasks"])
    with pytest.raises(TypeError, match=r"'tasks' carries vcpo.v1.Task, got TrajectoryGroup"):
        producer.put(make_group(0, n=1, response_len=4), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy_version must be >= 0, got -1"):
        producer.put(make_task(0), -1)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {b"policy_version": b"1", b"type": b"vcpo.v1.TrajectoryGroup", b"payload": b"\xff\xff\xff"},
            "payload is not",
        ),
        (
            {b"policy_version": b"1", b"type": b"vcpo.v1.Task", b"payload": b""},
            "type 'vcpo.v1.Task', expected",
        ),
        (
            {b"policy_version": b"x1", b"type": b"vcpo.v1.TrajectoryGroup", b"payload": b""},
            "policy_version 'x1'",
        ),
        ({b"payload": b"abc"}, "missing fields ['policy_version', 'type']"),
    ],
)
def test_malformed_entry_raises_a_clear_error(fields: dict[bytes, bytes], reason: str) -> None:
    spec = specs()["rollouts"]
    with pytest.raises(MalformedEntryError) as info:
        decode_entry(spec, "1-0", fields)
    assert reason in str(info.value)
    assert info.value.kind in {"bad_payload", "wrong_type", "bad_version", "missing_fields"}
    assert "entry 1-0 on stream 'rollouts'" in str(info.value)


def test_consumer_counts_and_dead_letters_malformed_entries_and_keeps_going(
    redis_client: redis.Redis,
) -> None:
    metrics = StreamMetrics(Metrics("test"))
    spec = specs()["rollouts"]
    producer = StreamProducer(redis_client, spec, metrics)
    consumer = StreamConsumer(redis_client, spec, "c", metrics)
    good_before = producer.put(make_group(1, n=1, response_len=8), 1)
    redis_client.xadd(
        spec.key, {b"policy_version": b"1", b"type": b"vcpo.v1.TrajectoryGroup", b"payload": b"\x0a\xff"}
    )
    redis_client.xadd(spec.key, {b"hello": b"world"})
    good_after = producer.put(make_group(2, n=1, response_len=8), 2)

    entries = consumer.read(count=10)
    assert [e.id for e in entries] == [good_before, good_after]
    assert metrics.malformed.labels("rollouts", "bad_payload")._value.get() == 1
    assert metrics.malformed.labels("rollouts", "missing_fields")._value.get() == 1
    assert metrics.dead.labels("rollouts", "bad_payload")._value.get() == 1
    dead = redis_client.xrange(spec.dead_letter_key)
    assert len(dead) == 2
    assert b"payload is not a valid" in dead[0][1][b"dead_reason"]
    assert b"missing fields" in dead[1][1][b"dead_reason"]
    # the bad entries are out of the queue and of the pending list: only the good ones await an ack
    assert redis_client.xpending(spec.key, spec.group)["pending"] == 2
    consumer.ack([e.id for e in entries])
    assert redis_client.xlen(spec.key) == 0


def test_entry_delivered_too_often_goes_to_dead_letter(redis_client: redis.Redis) -> None:
    metrics = StreamMetrics(Metrics("test"))
    spec = specs()["rollouts"]
    StreamProducer(redis_client, spec).put(make_group(0, n=1, response_len=8), 0)
    consumer = StreamConsumer(redis_client, spec, "c", metrics, reclaim_idle_ms=0, max_deliveries=3)
    assert len(consumer.read()) == 1  # delivery 1
    assert len(consumer.reclaim()) == 1  # delivery 2
    assert len(consumer.reclaim()) == 1  # delivery 3
    assert consumer.reclaim() == []  # a 4th would exceed max_deliveries: dead-lettered instead
    assert redis_client.xlen(spec.dead_letter_key) == 1
    assert redis_client.xlen(spec.key) == 0
    assert metrics.dead.labels("rollouts", "max_deliveries")._value.get() == 1
    assert (
        redis_client.xrange(spec.dead_letter_key)[0][1][b"dead_reason"] == b"delivered 3 times without an ack"
    )


def test_restarted_consumer_sees_its_own_pending_entries(redis_client: redis.Redis) -> None:
    spec = specs()["scored"]
    ids = StreamProducer(redis_client, spec).put_many(
        [(make_group(i, n=1, response_len=8), 0) for i in range(3)]
    )
    StreamConsumer(redis_client, spec, "learner-0").read(count=3)
    again = StreamConsumer(redis_client, spec, "learner-0")  # same name after a restart
    assert [e.id for e in again.pending()] == ids
    assert again.read(count=3) == []


def test_run_ids_keep_streams_apart(redis_client: redis.Redis) -> None:
    a, b = specs("run-a")["tasks"], specs("run-b")["tasks"]
    assert a.key == "vcpo:run-a:tasks" and b.key == "vcpo:run-b:tasks"
    StreamProducer(redis_client, a).put(make_task(1), 0)
    assert StreamConsumer(redis_client, b, "c").read() == []
    assert isinstance(StreamConsumer(redis_client, a, "c").read()[0].message, rollout_pb2.Task)


def test_connect_names_an_unreachable_redis() -> None:
    from services.common.ports import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ConnectionError, match=f"cannot reach Redis at {url}"):
        connect(url, retries=1)


def test_connect_gives_a_working_client(redis_url: str) -> None:
    client = connect(redis_url)
    assert client.ping()


def test_a_write_id_makes_a_retried_write_return_the_first_entry(redis_client: redis.Redis) -> None:
    """A client that retries a write whose reply a Redis restart cut off sends the same script again: with a
    write id (the sampler passes the group id) the second call returns the first entry's id and adds nothing,
    so no group reaches the learner twice. Without one, both land (the producer's plain behaviour)."""
    spec = specs("dedup", rollouts_maxlen=3)["rollouts"]
    producer = StreamProducer(redis_client, spec, remember_writes_s=60)
    first = producer.put(make_group(0, n=1, response_len=8), 0, write_id="r0.a-1")
    again = producer.put(make_group(0, n=1, response_len=8), 0, write_id="r0.a-1")
    assert again == first
    assert redis_client.xlen(spec.key) == 1
    assert int(redis_client.get(spec.produced_key)) == 1
    assert 0 < redis_client.ttl(f"{spec.key}:written:r0.a-1") <= 60

    # a batch mixing a repeat, new ids and an id-less write; the repeat takes no room in the capped queue
    ids = producer.put_many(
        [(make_group(i, n=1, response_len=8), 0) for i in range(3)], ["r0.a-1", "r0.a-2", ""]
    )
    assert ids[0] == first and len(set(ids)) == 3
    assert redis_client.xlen(spec.key) == 3  # the cap: 1 + 2 new
    assert int(redis_client.get(spec.produced_key)) == 3
    assert (
        producer.put(make_group(9, n=1, response_len=8), 0, write_id="r0.a-2") == ids[1]
    )  # full, yet answered
    with pytest.raises(ValueError, match="2 write ids for 1 items"):
        producer.put_many([(make_group(0, n=1, response_len=8), 0)], ["a", "b"])
