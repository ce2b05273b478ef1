"""The reward loop: score every response of each rollout group and hand the group on, exactly once.

    [stream rollouts] ──read / reclaim──► RewardLoop.step()
                                              │ every trajectory of up to `batch_groups` groups at once
                                              ▼
                                          ScoringPool.score_many  (worker processes, per-scorer deadlines)
                                              │ Reward on each trajectory (fallback reward + reason on failure)
                                              ▼
    [stream scored]  ◄── forward(): XADD scored + XACK/XDEL rollouts in one Lua script (handoff.py)

What blocks what: the loop blocks on an empty `rollouts` stream (up to ``block_ms``), on the pool while
responses are scored, and in ``forward`` while `scored` is full (the learner is behind): back-pressure
travels upstream, nothing is buffered here. A group is acknowledged only by the script that writes its
scored entry, and only while it is still pending with this replica; a replica killed mid-group leaves it
pending, another replica reclaims it after ``reclaim_idle_ms`` and scores it (once: ``forward`` refuses to
write a group that another replica has taken over). While a slow group is scored, its entry is kept alive.

Which scorer: the task's ``scorer``; else ``environment`` for a task of a tool-use environment whose
trajectories carry the environment's reward (set by the sampler on ``Trajectory.reward``); else the
configured default. A response an agent finished with a reward (``Trajectory.reward.scorer = "agent"``) is
judged by that reward, whatever its group's scorer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from services.common.handoff import forward
from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import Entry
from services.reward.metrics import RewardMetrics
from services.reward.pool import Outcome, ScoringPool
from services.reward.scorers import ScoreInput
from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)

Group = rollout_pb2.TrajectoryGroup
MAX_FAILURE_REASON_CHARS = 500


def scorer_for(group: Group, default: str) -> str:
    """The scorer a group's responses are judged by (see the module docstring)."""
    task = group.task
    if task.scorer:
        return task.scorer
    if task.environment and any(t.HasField("reward") for t in group.trajectories):
        return "environment"
    return default


def scorer_of(trajectory: rollout_pb2.Trajectory, group_scorer: str) -> str:
    """An agent that finished its episode with a reward is judged by it (the environment scorer reads the
    reward a trajectory carries); any other response by its group's scorer."""
    agent = trajectory.HasField("reward") and trajectory.reward.scorer == "agent"
    return "environment" if agent else group_scorer


def score_input(task: rollout_pb2.Task, trajectory: rollout_pb2.Trajectory) -> ScoreInput:
    env_reward = trajectory.reward.value if trajectory.HasField("reward") else None
    return ScoreInput(
        response=trajectory.text,
        reference=task.reference,
        task_id=task.task_id,
        metadata=dict(task.metadata),
        payload_json=task.payload_json,
        environment_reward=env_reward,
    )


def reward_of(outcome: Outcome) -> rollout_pb2.Reward:
    reward = rollout_pb2.Reward(
        value=outcome.value,
        scorer=outcome.scorer,
        failed=outcome.failed,
        latency_seconds=outcome.latency_s,
    )
    if outcome.failed:
        reason = f"{outcome.reason}: {outcome.message}"
        reward.failure_reason = reason[:MAX_FAILURE_REASON_CHARS]
    reward.components.update(outcome.components)
    return reward


class RewardLoop:
    def __init__(
        self,
        consumer: StreamConsumer[Group],
        producer: StreamProducer[Group],
        pool: ScoringPool,
        metrics: RewardMetrics,
        default_scorer: str,
        block_ms: int = 1000,
        batch_groups: int = 2,
        reclaim_every_s: float = 5.0,
    ) -> None:
        self.consumer, self.producer, self.pool, self.metrics = consumer, producer, pool, metrics
        self.default_scorer, self.block_ms, self.batch_groups = default_scorer, block_ms, batch_groups
        self.reclaim_every_s = reclaim_every_s
        self.scored = 0  # groups this replica forwarded
        self.reclaimed_elsewhere = 0  # groups scored here but taken over (and forwarded) by another replica
        self.failures = 0  # responses that got the fallback reward
        self._last_reclaim = -float("inf")
        self._own_pending_done = False
        self._in_flight: list[str] = []
        self._lock = threading.Lock()
        self.busy_s = 0.0

    # ------------------------------------------------------------------------------------------ loop
    def run(self, stop: threading.Event, max_groups: int = 0) -> None:
        """Score groups until ``stop`` is set (or ``max_groups`` are forwarded); finishes the current batch."""
        done = threading.Event()
        keep_alive = threading.Thread(
            target=self._keep_alive, args=(done,), name="reward-keepalive", daemon=True
        )
        keep_alive.start()
        try:
            while not stop.is_set() and not (max_groups and self.scored >= max_groups):
                left = max_groups - self.scored if max_groups else self.batch_groups
                self.step(min(self.batch_groups, left))
        finally:
            done.set()
            keep_alive.join(timeout=5)

    def step(self, limit: int | None = None) -> int:
        """Take up to ``limit`` groups (own pending ones after a restart, reclaimed ones, then new), score and
        forward them; returns how many were forwarded."""
        entries = self._take(limit or self.batch_groups)
        forwarded = self.process(entries) if entries else 0
        self.metrics.queue_depth.set(self.consumer.backlog())
        self.metrics.refresh()
        return forwarded

    def _take(self, limit: int) -> list[Entry[Group]]:
        if not self._own_pending_done:  # after a restart under the same name: what this replica left pending
            entries = self.consumer.pending(count=limit)
            if entries:
                log.info("redoing %d group(s) this replica left pending", len(entries))
                return entries
            self._own_pending_done = True
        now = time.monotonic()
        if now - self._last_reclaim >= self.reclaim_every_s:
            self._last_reclaim = now
            entries = self.consumer.reclaim(count=limit)
            if entries:
                log.info("taking over %d group(s) a stopped replica left pending", len(entries))
                return entries
        return self.consumer.read(count=limit, block_ms=self.block_ms)

    def process(self, entries: Sequence[Entry[Group]]) -> int:
        """Score every response of ``entries`` (in parallel over the pool) and forward each group."""
        t0 = time.perf_counter()
        with self._lock:
            self._in_flight = [e.id for e in entries]
        self.metrics.in_flight.labels(self.metrics.replica).set(len(entries))
        jobs: list[tuple[str, ScoreInput]] = []
        for entry in entries:
            group = entry.message
            scorer = scorer_for(group, self.default_scorer)
            jobs += [(scorer_of(t, scorer), score_input(group.task, t)) for t in group.trajectories]
        outcomes = iter(self.pool.score_many(jobs))
        forwarded = 0
        for entry in entries:
            group = entry.message
            rewards = []
            for trajectory in group.trajectories:
                outcome = next(outcomes)
                self.metrics.record_outcome(outcome)
                if outcome.failed:
                    self.failures += 1
                    log.warning("group %s: %s: %s", group.group_id, outcome.reason, outcome.message)
                trajectory.reward.CopyFrom(reward_of(outcome))
                rewards.append(outcome.value)
            group.scored_unix = time.time()
            if forward(self.consumer, entry.id, self.producer, group, entry.policy_version) is None:
                self.reclaimed_elsewhere += 1
                self.metrics.lost_ownership.labels(self.metrics.replica).inc()
                log.warning("group %s was taken over by another replica; not forwarded here", group.group_id)
                continue
            forwarded += 1
            self.scored += 1
            self.metrics.record_group(group.task, rewards)
        with self._lock:
            self._in_flight = []
        self.metrics.in_flight.labels(self.metrics.replica).set(0)
        self.busy_s += time.perf_counter() - t0
        return forwarded

    def _keep_alive(self, stop: threading.Event) -> None:
        # touch in-flight entries well within the reclaim idle time, so a slow group is not taken over
        interval = max(self.consumer.reclaim_idle_ms / 3000, 0.05)
        while not stop.wait(interval):
            with self._lock:
                ids = list(self._in_flight)
            if ids:
                self.consumer.touch(ids)

    def summary(self) -> dict[str, Any]:
        return {
            "groups_scored": self.scored,
            "groups_reclaimed_elsewhere": self.reclaimed_elsewhere,
            "fallback_rewards": self.failures,
            "queue_depth": self.consumer.backlog(),
            "busy_seconds": self.busy_s,  # scoring and forwarding, not waiting for rollouts
        }
