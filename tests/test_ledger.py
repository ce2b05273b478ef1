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
