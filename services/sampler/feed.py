"""Where the sampler's prompts come from: the `tasks` stream first (gRPC submissions), then the dataset.

    `tasks` stream ──► StreamConsumer (group "sampler", shared by replicas) ─┐
                                                                          ├─► validate + encode ─► PreparedTask
    dataset (jsonl / parquet / builtin) ──► DatasetTasks (endless epochs) ─┘         │ bad: TaskError
                                                                                    ▼
                                                           counted by reason, logged, stream entry dead-lettered

A stream entry is acknowledged only when its group is on the `rollouts` stream (:meth:`TaskFeed.done`); a
sampler that stops before that leaves it pending, and a replica reclaims it. A task whose group had to be
given up (it grew too stale) goes back with :meth:`TaskFeed.retry` and is generated again; one whose
environment (or whose agents, over the agent API) failed it ``max_attempts`` times is dead-lettered
(``environment_failed``), not retried forever.

Tasks of tool-use environments: ``next(can_start)`` asks whether the task's environment can take a group now
(its circuit breaker is closed and it has sessions free). Tasks it cannot take yet wait here, per environment
(they stay this replica's: kept alive like any task in hand), at most ``max_waiting`` in all before the feed
stops reading the stream; among the environments that can take one, the next task is chosen by their
registered weights (smooth weighted round robin), so a heavy environment gets its share and a paused or
saturated one holds back none of the others.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.prompts import PromptEncoder, TaskError
from services.common.streams.consumer import StreamConsumer
from services.common.streams.specs import Entry
from services.sampler.tasks import DatasetTasks
from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)


@dataclass
class PreparedTask:
    task: rollout_pb2.Task
    prompt_tokens: list[int]
    entry_id: str | None = None  # the `tasks` stream entry, when it came from there
    failures: list[str] = field(default_factory=list)  # why its environment failed it, attempt by attempt


CanStart = Callable[[rollout_pb2.Task], bool]
Weight = Callable[[str], float]


class TaskFeed:
    def __init__(
        self,
        encoder: PromptEncoder,
        dataset: DatasetTasks | None = None,
        stream: StreamConsumer[rollout_pb2.Task] | None = None,
        on_error: Callable[[TaskError], None] | None = None,
        reclaim_every_s: float = 10.0,
        environment_known: Callable[[str], bool] | None = None,
        weight: Weight | None = None,
        max_attempts: int = 3,
        max_waiting: int = 64,
        on_settled: Callable[[str], None] | None = None,
    ) -> None:
        if dataset is None and stream is None:
            raise ValueError("a task feed needs a dataset, the tasks stream, or both")
        self.encoder, self.dataset, self.stream = encoder, dataset, stream
        self.on_error = on_error
        self.on_settled = on_settled  # a submitted task of this environment is done (drains count them)
        self.environment_known = environment_known
        self.weight = weight or (lambda name: 1.0)
        self.max_attempts, self.max_waiting = max_attempts, max_waiting
        self.waiting: dict[str, deque[PreparedTask]] = {}  # environment -> tasks it could not take yet
        self._credit: dict[str, float] = {}
        self.errors: dict[str, int] = {}
        self.last_error = ""
        self._retry: deque[PreparedTask] = deque()
        self._buffer: deque[Entry[rollout_pb2.Task]] = deque()
        self._reclaim_every_s, self._last_reclaim = reclaim_every_s, 0.0
        self._outstanding: set[str] = set()  # stream entries handed out and not done yet
        self._last_touch = time.monotonic()

    def next(self, can_start: CanStart | None = None) -> PreparedTask | None:
        """The next valid task, or None when there is none right now (bad tasks are counted and skipped).
        ``can_start``: whether a task's environment can take a group now (see the module docstring)."""
        self.keep_alive()
        while self._retry:  # given-up groups go first in their environment's line
            self._wait(self._retry.pop(), front=True)
        self._fill()
        if (chosen := self._choose(can_start)) is not None:
            return chosen
        if self.dataset is None or any(p.entry_id is None for q in self.waiting.values() for p in q):
            return None  # a dataset task already waits for its environment: no need to draw another
        for _ in range(len(self.dataset)):
            task = self.dataset.next()
            try:
                prepared = PreparedTask(task, self._encode(task))
            except TaskError as exc:
                self._reject(exc)
                continue
            if can_start is None or can_start(task):
                return prepared
            self._wait(prepared)
            return None
        raise RuntimeError(
            f"every one of the dataset's {len(self.dataset)} tasks was rejected: {self.last_error}"
        )

    def validate(self, task: rollout_pb2.Task) -> list[int]:
        """The task's prompt tokens; raises TaskError if it cannot be sampled (used at submission too)."""
        return self._encode(task)

    def done(self, prepared: PreparedTask) -> None:
        """Its group is on the `rollouts` stream: the task is finished."""
        if prepared.entry_id is not None and self.stream is not None:
            self.stream.ack([prepared.entry_id])
            self._outstanding.discard(prepared.entry_id)
            self._settled(prepared.task)

    def retry(self, prepared: PreparedTask, failure: str | None = None) -> None:
        """Generate this task again (its group was given up); ``failure``: its environment failed it, which
        only ``max_attempts`` times in all are retried."""
        if failure is not None:
            prepared.failures.append(failure)
            if len(prepared.failures) >= self.max_attempts:
                exc = TaskError(
                    "environment_failed",
                    prepared.task.task_id,
                    f"{_who(prepared.task)} failed it {len(prepared.failures)} times; last: {failure}",
                )
                entry = None
                if prepared.entry_id is not None:
                    entry = Entry(prepared.entry_id, 0, prepared.task)
                    self._outstanding.discard(prepared.entry_id)
                self._reject(exc, entry)
                return
        self._retry.append(prepared)

    def waiting_count(self, environment: str | None = None) -> int:
        if environment is not None:
            return len(self.waiting.get(environment, ()))
        return sum(len(q) for q in self.waiting.values())

    def _fill(self) -> None:
        """Tasks read from the stream (one read at most per call) join those waiting, up to ``max_waiting``."""
        reads = 0
        while self.waiting_count() < self.max_waiting:
            if not self._buffer:
                if reads:
                    return
                reads += 1
            entry = self._next_entry()
            if entry is None:
                return
            try:
                prepared = PreparedTask(entry.message, self._encode(entry.message), entry.id)
            except TaskError as exc:
                self._reject(exc, entry)
                continue
            self._outstanding.add(entry.id)
            self._wait(prepared)

    def _wait(self, prepared: PreparedTask, front: bool = False) -> None:
        queue = self.waiting.setdefault(prepared.task.environment, deque())
        if front:
            queue.appendleft(prepared)
        else:
            queue.append(prepared)

    def _choose(self, can_start: CanStart | None) -> PreparedTask | None:
        """A waiting task whose environment can take it now, by the environments' weights."""
        ready = [
            env
            for env, queue in self.waiting.items()
            if queue and (can_start is None or can_start(queue[0].task))
        ]
        if not ready:
            return None
        total = 0.0
        for env in ready:
            weight = self.weight(env) if env else 1.0
            self._credit[env] = self._credit.get(env, 0.0) + weight
            total += weight
        env = max(ready, key=lambda e: self._credit[e])
        self._credit[env] -= total
        return self.waiting[env].popleft()

    def keep_alive(self) -> None:
        """Tasks being generated (or held back by admission) stay this replica's: a long generation must not
        look like a stopped consumer's entry to the others."""
        if self.stream is None or not self._outstanding:
            return
        now = time.monotonic()
        if now - self._last_touch >= self.stream.reclaim_idle_ms / 3000:
            self._last_touch = now
            self.stream.touch(sorted(self._outstanding))

    def _next_entry(self) -> Entry[rollout_pb2.Task] | None:
        if self.stream is None:
            return None
        if not self._buffer:
            now = time.monotonic()
            if now - self._last_reclaim >= self._reclaim_every_s:  # tasks of a stopped replica
                self._last_reclaim = now
                self._buffer.extend(self.stream.reclaim(count=16))
            if not self._buffer:
                self._buffer.extend(self.stream.read(count=16))
        return self._buffer.popleft() if self._buffer else None

    def _encode(self, task: rollout_pb2.Task) -> list[int]:
        if task.environment and not (self.environment_known and self.environment_known(task.environment)):
            raise TaskError(
                "unknown_environment",
                task.task_id,
                f"environment {task.environment!r} is not registered (RegisterEnvironment it first)",
            )
        if task.payload_json:
            try:
                json.loads(task.payload_json)
            except json.JSONDecodeError as exc:
                raise TaskError("bad_payload", task.task_id, f"payload_json is not JSON: {exc}") from None
        if not task.prompt and not task.messages and task.task_id:  # a dataset row by id
            row = self.dataset.get(task.task_id) if self.dataset is not None else None
            if row is None:
                where = "the dataset" if self.dataset is not None else "any dataset (this sampler has none)"
                raise TaskError(
                    "unknown_task",
                    task.task_id,
                    f"no prompt given and the id is not in {where}",
                )
            merged = rollout_pb2.Task()
            merged.CopyFrom(row)
            merged.MergeFrom(task)  # the submission's own fields (split, metadata, scorer) win
            task.CopyFrom(merged)
        return self.encoder.encode(task)

    def _settled(self, task: rollout_pb2.Task) -> None:
        if task.environment and self.on_settled is not None:
            self.on_settled(task.environment)

    def _reject(self, exc: TaskError, entry: Entry[rollout_pb2.Task] | None = None) -> None:
        self.errors[exc.reason] = self.errors.get(exc.reason, 0) + 1
        self.last_error = str(exc)
        log.warning("task rejected (%s): %s", exc.reason, exc)
        if entry is not None and self.stream is not None:
            self.stream.reject(entry, exc.reason, str(exc))
            self._settled(entry.message)
        if self.on_error is not None:
            self.on_error(exc)


def _who(task: rollout_pb2.Task) -> str:
    return f"its environment {task.environment!r}" if task.environment else "its agents (the agent API)"
