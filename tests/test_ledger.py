"""The run's ledger on real Redis: it balances for a consistent run and names each way one can go wrong (a
lost group, a group trained twice, a trained group past the lag bound); the audit-log reader copes with a line
still being written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from deploy.ledger import take_ledger
from deploy.progress import StepLog

KEYS = {"rollouts": "vcpo:led:rollouts", "scored": "vcpo:led:scored"}
DEAD = {"rollouts": "vcpo:led:rollouts:dead", "scored": "vcpo:led:scored:dead"}


def _run(client: redis.Redis, rollouts: int, scored: int, scored_left: int) -> None:
    """``rollouts`` groups sampled (all scored and removed from rollouts), ``scored`` of them written to
    scored, of which ``scored_left`` are still there."""
    for i in range(rollouts):
        entry = client.xadd(KEYS["rollouts"], {"n": i})
        client.xdel(KEYS["rollouts"], entry)
    for i in range(scored):
        entry = client.xadd(KEYS["scored"], {"n": i})
        if i < scored - scored_left:
            client.xdel(KEYS["scored"], entry)


def _steps(groups: list[list[str]], lags: list[list[int]]) -> dict[int, dict[str, Any]]:
    return {
        i + 1: {"step": i + 1, "groups": g, "lags": lag}
        for i, (g, lag) in enumerate(zip(groups, lags, strict=True))
    }


FEED = {"consumed": 5, "trained_groups": 4, "rejected": {"nonfinite_reward": 1}, "dropped_by_lag": {}}


def test_a_consistent_run_balances(redis_client: redis.Redis) -> None:
    _run(redis_client, rollouts=7, scored=7, scored_left=2)
    ledger = take_ledger(
        redis_client, KEYS, DEAD, FEED, _steps([["a", "b"], ["c", "d"]], [[0, 1], [2, 2]]), k=2
    )
    assert ledger["balanced"], ledger["problems"]
    assert (ledger["rollouts_added"], ledger["scored_added"], ledger["scored_left"], ledger["trained"]) == (
        7,
        7,
        2,
        4,
    )


def test_each_inconsistency_is_named(redis_client: redis.Redis) -> None:
    _run(redis_client, rollouts=8, scored=7, scored_left=2)  # one rollout vanished without being scored
    steps = _steps([["a", "b"], ["b", "d"]], [[0, 1], [3, 2]])  # "b" trained twice, a lag of 3 > k
    ledger = take_ledger(redis_client, KEYS, DEAD, {**FEED, "consumed": 6}, steps, k=2)
    assert not ledger["balanced"]
    problems = "\n".join(ledger["problems"])
    assert "rollouts added 8 != scored 7" in problems
    assert "1 group(s) trained on in two steps: ['b']" in problems
    assert "a trained group had lag 3 > k = 2" in problems
    assert "scored added 7 != consumed by the learner 6" in problems
    assert "consumed 6 != trained 4 + rejected 1 + dropped 0" in problems


def test_no_feed_state_is_a_problem(redis_client: redis.Redis) -> None:
    ledger = take_ledger(redis_client, KEYS, DEAD, None, {}, k=1)
    assert not ledger["balanced"] and "no feed state" in ledger["problems"][0]


def test_the_step_log_reads_whole_lines_only_and_the_last_line_per_step_wins(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    assert log.poll() == []  # no file yet
    path.write_text(json.dumps({"step": 1, "groups": ["a"]}) + "\n" + '{"step": 2, "gro')
    assert [r["step"] for r in log.poll()] == [1]  # the second line is still being written
    with path.open("a") as f:
        f.write('ups": ["b"]}\n' + json.dumps({"step": 1, "groups": ["c"]}) + "\nnot json\n")
    assert [r["step"] for r in log.poll()] == [2, 1]
    assert log.steps[1]["groups"] == ["c"] and log.unreadable == 1
    latest = log.latest()
    assert latest is not None and latest["step"] == 2


def test_foreign_entries_are_counted_apart_and_the_run_still_balances(redis_client: redis.Redis) -> None:
    """Entries written into the queues by anything but the services (here: a person's XADD, malformed) are
    dead-lettered by the consumers and counted as foreign; the groups the samplers produced still balance
    (the seen failure: 'rollouts added 530 != scored 530 + ... + dead-lettered 30', an exit 3 for a run that
    lost nothing)."""
    from services.common.handoff import forward
    from services.common.streams.consumer import StreamConsumer
    from services.common.streams.producer import StreamProducer
    from services.common.streams.specs import StreamSpec
    from vcpo.v1 import rollout_pb2

    spec = {
        n: StreamSpec(n, KEYS[n], rollout_pb2.TrajectoryGroup, 64, "queue", f"{n}-readers")
        for n in ("rollouts", "scored")
    }
    sampler = StreamProducer(redis_client, spec["rollouts"])
    reward = StreamConsumer(redis_client, spec["rollouts"], "reward-0")
    learner = StreamConsumer(redis_client, spec["scored"], "learner-0")
    sampler.put_many([(rollout_pb2.TrajectoryGroup(group_id=f"g{i}"), 0) for i in range(5)])
    for key in KEYS.values():  # foreign: not ours, not even well-formed
        redis_client.xadd(key, {"junk": "x"})
        redis_client.xadd(
            key, {"policy_version": "1", "type": "vcpo.v1.TrajectoryGroup", "payload": b"\xff\xfe"}
        )
    entries = reward.read(count=10)
    assert len(entries) == 5  # the foreign two were dead-lettered on the way
    for entry in entries[:4]:  # one rollout is still being scored
        assert forward(reward, entry.id, StreamProducer(redis_client, spec["scored"]), entry.message, 0)
    consumed = learner.read(count=10)
    assert len(consumed) == 4
    learner.ack([e.id for e in consumed])  # the last checkpoint covers them
    feed = {"consumed": 4, "trained_groups": 4, "rejected": {}, "dropped_by_lag": {}}
    steps = _steps([[f"g{i}" for i in range(4)]], [[0, 0, 0, 0]])
    ledger = take_ledger(redis_client, KEYS, DEAD, feed, steps, k=1)
    assert ledger["balanced"], ledger["problems"]
    assert (ledger["rollouts_added"], ledger["rollouts_produced"], ledger["rollouts_foreign"]) == (7, 5, 2)
    assert (ledger["scored_added"], ledger["scored_produced"], ledger["scored_foreign"]) == (6, 4, 2)
    assert (ledger["rollouts_left"], ledger["rollouts_dead_lettered"]) == (1, 2)
    assert (ledger["scored_left"], ledger["scored_dead_lettered"]) == (0, 2)
    # a rollout that vanished is still a problem, foreign entries or not
    redis_client.xdel(KEYS["rollouts"], entries[4].id)
    ledger = take_ledger(redis_client, KEYS, DEAD, feed, steps, k=1)
    assert "rollouts added 7 != scored 4 + left in rollouts 0 + dead-lettered 2" in ledger["problems"]
