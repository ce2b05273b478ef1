"""What a round's results are and where they go: accuracy (mean@n, pass@n), the per-set result and its
metrics-log line, the ``vcpo_eval_*`` metrics, and the recorder that writes results to Redis, the gauges and
the log."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from services.common.clock import RunClock, eval_results_key
from services.common.observability import Metrics

log = logging.getLogger(__name__)

ROUND_OUTCOMES = ("done", "abandoned", "shutdown")


def accuracy(rewards: Sequence[Sequence[float]], correct_at: float) -> tuple[float, float, float]:
    """``(mean@n, pass@n, mean reward)`` of each task's sample rewards."""
    if not rewards or any(not r for r in rewards):
        raise ValueError("accuracy needs at least one task and one sample per task")
    correct = [[r >= correct_at for r in task] for task in rewards]
    mean_at_n = sum(sum(c) / len(c) for c in correct) / len(correct)
    pass_at_n = sum(any(c) for c in correct) / len(correct)
    reward_mean = sum(sum(r) for r in rewards) / sum(len(r) for r in rewards)
    return mean_at_n, pass_at_n, reward_mean


@dataclass
class SetResult:
    """One set's accuracy at one version."""

    set: str
    version: int
    n: int
    tasks: int
    mean_at_n: float
    pass_at_n: float
    reward_mean: float
    failed_scores: int
    eval_seconds: float
    tokens: int
    per_task: list[list[float]] = field(default_factory=list, repr=False)  # rewards, task by task
    failed_episodes: int = 0  # samples whose environment failed (scored 0; environment sets only)

    def record(
        self, where: str, replica: str, train_seconds: float | None, gpu_hours: float | None
    ) -> dict[str, Any]:
        """The metrics-log line (``kind: eval``)."""
        return {
            "kind": "eval",
            "set": self.set,
            "version": self.version,
            "n": self.n,
            "tasks": self.tasks,
            "mean_at_n": self.mean_at_n,
            "pass_at_n": self.pass_at_n,
            "reward_mean": self.reward_mean,
            "train_seconds": train_seconds,
            "gpu_hours": gpu_hours,
            "time": time.time(),
            "eval_seconds": self.eval_seconds,
            "tokens": self.tokens,
            "failed_scores": self.failed_scores,
            "failed_episodes": self.failed_episodes,
            "where": where,
            "replica": replica,
        }


class EvalMetrics:
    def __init__(self, metrics: Metrics) -> None:
        s = ["set"]
        self.accuracy = metrics.gauge(
            "vcpo_eval_accuracy",
            "Held-out accuracy at the newest evaluated version (metric: mean_at_n or pass_at_n)",
            ["set", "metric"],
        )
        self.reward = metrics.gauge("vcpo_eval_reward_mean", "Mean reward of the newest evaluation", s)
        self.version = metrics.gauge("vcpo_eval_policy_version", "Policy version of the newest evaluation", s)
        self.train_seconds = metrics.gauge(
            "vcpo_eval_train_seconds", "Training wall time when the newest evaluated version was published", s
        )
        self.gpu_hours = metrics.gauge(
            "vcpo_eval_gpu_hours", "GPU-hours of the run when the newest evaluated version was published", s
        )
        self.rounds = metrics.counter(
            "vcpo_eval_rounds_total",
            "Evaluation rounds (the sets due at one version), by outcome; shared: each replica counts its "
            "part of a round (the shards it generated)",
            ["outcome"],
        )
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        self.failed_scores = metrics.counter(
            "vcpo_eval_failed_scores_total",
            "Evaluation responses whose scorer failed (scored as failures)",
            s,
        )
        self.failed_episodes = metrics.counter(
            "vcpo_eval_failed_episodes_total",
            "Evaluation samples whose environment failed or timed out (scored 0; environment sets)",
            s,
        )
        self.round_seconds = metrics.histogram(
            "vcpo_eval_round_seconds",
            "Time of an evaluation round, generation and scoring",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
        )
        self.hold_seconds = metrics.counter(
            "vcpo_eval_hold_seconds_total",
            "Time newer versions waited to be loaded while an evaluation round was generating (shared)",
        )
        self.tokens = metrics.counter("vcpo_eval_generated_tokens_total", "Tokens generated for evaluation")


class EvalRecorder:
    """Where results go: the run's Redis list (for the metrics log), gauges, the log."""

    def __init__(
        self, metrics: EvalMetrics | None, client: redis.Redis | None, run_id: str, where: str, replica: str
    ) -> None:
        self.metrics, self.client, self.run_id = metrics, client, run_id
        self.where, self.replica = where, replica
        self.clock = RunClock(client, run_id) if client is not None else None

    def record(self, results: Sequence[SetResult]) -> list[dict[str, Any]]:
        records = []
        for r in results:
            seconds, gpu_hours = self.clock.at(r.version) if self.clock is not None else (None, None)
            rec = r.record(self.where, self.replica, seconds, gpu_hours)
            records.append(rec)
            if self.client is not None:
                self.client.rpush(eval_results_key(self.run_id), json.dumps(rec))
            if self.metrics is not None:
                m = self.metrics
                m.accuracy.labels(r.set, "mean_at_n").set(r.mean_at_n)
                m.accuracy.labels(r.set, "pass_at_n").set(r.pass_at_n)
                m.reward.labels(r.set).set(r.reward_mean)
                m.version.labels(r.set).set(r.version)
                if seconds is not None:
                    m.train_seconds.labels(r.set).set(seconds)
                if gpu_hours is not None:
                    m.gpu_hours.labels(r.set).set(gpu_hours)
                m.failed_scores.labels(r.set).inc(r.failed_scores)
                m.failed_episodes.labels(r.set).inc(r.failed_episodes)
            log.info(
                "evaluation at version %d: %s mean@%d %.3f pass@%d %.3f (%d tasks, %.1fs)",
                r.version,
                r.set,
                r.n,
                r.mean_at_n,
                r.n,
                r.pass_at_n,
                r.tasks,
                r.eval_seconds,
            )
        return records
