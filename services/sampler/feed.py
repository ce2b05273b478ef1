"""Where the sampler's prompts come from: the `tasks` stream first (gRPC submissions), then the dataset.

    `tasks` stream ──► StreamConsumer (group "sampler", shared by replicas) ─┐
                                                                          ├─► validate + encode ─► PreparedTask
    dataset (jsonl / parquet / builtin) ──► DatasetTasks (endless epochs) ─┘         │ bad: TaskError
                                                                                    ▼
                                                           counted by reason, logged, stream entry dead-lettered

A stream entry is acknowledged only when its group is on the `rollouts` stream (:meth:`TaskFeed.done`); a
sampler that stops before that leaves it pending, and a replica reclaims it. A task whose group had to be
given up (it grew too stale) goes back with :meth:`TaskFeed.retry` and is generated again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.common.streams import Entry, StreamConsumer
from services.sampler.tasks import DatasetTasks, PromptEncoder, TaskError
from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)


@dataclass
class PreparedTask:
    task: rollout_pb2.Task
    prompt_tokens: list[int]
    entry_id: str | None = None  # the `tasks` stream entry, when it came from there


class TaskFeed:
    def __init__(
        self,
        encoder: PromptEncoder,
        dataset: DatasetTasks | None = None,
        stream: StreamConsumer[rollout_pb2.Task] | None = None,
        on_error: Callable[[TaskError], None] | None = None,
        reclaim_every_s: float = 10.0,
    ) -> None:
        if dataset is None and stream is None:
            raise ValueError("a task feed needs a dataset, the tasks stream, or both")
        self.encoder, self.dataset, self.stream = encoder, dataset, stream
        self.on_error = on_error
        self.errors: dict[str, int] = {}
        self.last_error = ""
        self._retry: deque[PreparedTask] = deque()
        self._buffer: deque[Entry[rollout_pb2.Task]] = deque()
        self._reclaim_every_s, self._last_reclaim = reclaim_every_s, 0.0
        self._outstanding: set[str] = set()  # stream entries handed out and not done yet
        self._last_touch = time.monotonic()

    def next(self) -> PreparedTask | None:
        """The next valid task, or None when there is none right now (bad tasks are counted and skipped)."""
        self.keep_alive()
        if self._retry:
            return self._retry.popleft()
        while (entry := self._next_entry()) is not None:
            try:
                prepared = PreparedTask(entry.message, self._encode(entry.message), entry.id)
            except TaskError as exc:
                self._reject(exc, entry)
                continue
            self._outstanding.add(entry.id)
            return prepared
        if self.dataset is None:
            return None
        for _ in range(len(self.dataset)):
            task = self.dataset.next()
            try:
                return PreparedTask(task, self._encode(task))
            except TaskError as exc:
                self._reject(exc)
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

    def retry(self, prepared: PreparedTask) -> None:
        """Generate this task again (its group was given up)."""
        self._retry.append(prepared)

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
        if task.environment:
            raise TaskError(
                "unknown_environment",
                task.task_id,
                f"environment {task.environment!r} is not registered "
                '(only single-turn tasks, environment "", are served)',
            )
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

    def _reject(self, exc: TaskError, entry: Entry[rollout_pb2.Task] | None = None) -> None:
        self.errors[exc.reason] = self.errors.get(exc.reason, 0) + 1
        self.last_error = str(exc)
        log.warning("task rejected (%s): %s", exc.reason, exc)
        if entry is not None and self.stream is not None:
            self.stream.reject(entry, exc.reason, str(exc))
        if self.on_error is not None:
            self.on_error(exc)
