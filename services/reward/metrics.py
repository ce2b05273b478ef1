"""The reward service's Prometheus metrics (``vcpo_reward_*``).

Mean reward per task is labelled by the task's *family*, not its id (ids are unbounded): the task's
``metadata["task_family"]`` when set, else its environment, else the id's prefix before the first ``:``
(``gsm8k:17`` → ``gsm8k``; the dataset loader names rows ``<file stem>:<row>``). At most
``MAX_TASK_FAMILIES`` distinct families get their own label; later ones count as ``other``.
"""

from __future__ import annotations

import threading

from services.common.observability import Metrics, WindowRate
from services.reward.pool import Outcome
from vcpo.v1 import rollout_pb2

MAX_TASK_FAMILIES = 64
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0)


def task_family(task: rollout_pb2.Task) -> str:
    family = task.metadata.get("task_family") or task.environment or task.task_id.split(":", 1)[0]
    return family or "unnamed"


class RewardMetrics:
    def __init__(self, metrics: Metrics, replica: str) -> None:
        self.replica = replica
        r = ["replica"]
        self.groups = metrics.counter("vcpo_reward_groups_scored_total", "Groups scored and forwarded", r)
        self.groups_per_second = metrics.gauge(
            "vcpo_reward_groups_per_second", "Groups scored per second over the last 30 s", r
        )
        self.trajectories = metrics.counter(
            "vcpo_reward_trajectories_scored_total", "Responses scored, by scorer", ["scorer"]
        )
        self.latency = metrics.histogram(
            "vcpo_reward_score_latency_seconds",
            "Time to score one response, by scorer",
            ["scorer"],
            buckets=LATENCY_BUCKETS,
        )
        self.failures = metrics.counter(
            "vcpo_reward_failures_total",
            "Scoring calls that failed or timed out (the fallback reward was recorded), by scorer and reason",
            ["scorer", "reason"],
        )
        self.value = metrics.histogram(
            "vcpo_reward_value",
            "Rewards recorded, by task family (no _sum: a bucket is negative; the mean is vcpo_reward_group_mean)",
            ["task"],
            buckets=REWARD_BUCKETS,
        )
        self.group_mean = metrics.gauge(
            "vcpo_reward_group_mean", "Mean reward of the last group scored, by task family", ["task"]
        )
        self.queue_depth = metrics.gauge(
            "vcpo_reward_queue_depth", "Groups waiting on the rollouts stream (unread or being scored)"
        )
        self.in_flight = metrics.gauge("vcpo_reward_groups_in_flight", "Groups being scored", r)
        self.lost_ownership = metrics.counter(
            "vcpo_reward_groups_reclaimed_elsewhere_total",
            "Groups scored here but forwarded by another replica that had reclaimed them (not written twice)",
            r,
        )
        self._rate = WindowRate()
        self._families: set[str] = set()
        self._lock = threading.Lock()

    def family(self, task: rollout_pb2.Task) -> str:
        name = task_family(task)
        with self._lock:
            if name in self._families:
                return name
            if len(self._families) < MAX_TASK_FAMILIES:
                self._families.add(name)
                return name
        return "other"

    def record_outcome(self, outcome: Outcome) -> None:
        self.trajectories.labels(outcome.scorer).inc()
        self.latency.labels(outcome.scorer).observe(outcome.latency_s)
        if outcome.failed:
            self.failures.labels(outcome.scorer, outcome.reason).inc()

    def record_group(self, task: rollout_pb2.Task, rewards: list[float]) -> None:
        family = self.family(task)
        for value in rewards:
            self.value.labels(family).observe(value)
        if rewards:
            self.group_mean.labels(family).set(sum(rewards) / len(rewards))
        self.groups.labels(self.replica).inc()
        self._rate.add(1)

    def refresh(self) -> float:
        rate = self._rate.rate()
        self.groups_per_second.labels(self.replica).set(rate)
        return rate
