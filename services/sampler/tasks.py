"""The sampler's task order: every task once per epoch, each epoch reshuffled, for as long as the run goes.

    load_dataset(...) ─► list[Task] ─► DatasetTasks(tasks, seed).next() ─► Task

Loading lives in :mod:`services.common.datasets` and prompt encoding in :mod:`services.common.prompts`
(the evaluator and the learner's warm start use them too).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

from vcpo.v1 import rollout_pb2


class DatasetTasks:
    """Endless iterator over a dataset's tasks, each epoch in a fresh ``random.Random(seed + epoch)`` order.

    ``epoch`` is the epoch of the task last returned (0 at the start); it moves on when the next call finds
    the current epoch used up. Returned tasks are copies, so callers may modify them freely.
    """

    def __init__(self, tasks: list[rollout_pb2.Task], seed: int = 0) -> None:
        if not tasks:
            raise ValueError("DatasetTasks needs at least one task; the dataset is empty")
        self._index: dict[str, int] = {}
        for i, task in enumerate(tasks):
            if not task.task_id:
                raise ValueError(f"task at index {i} has an empty task_id")
            first = self._index.setdefault(task.task_id, i)
            if first != i:
                raise ValueError(f"duplicate task_id {task.task_id!r} (at indices {first} and {i})")
        self._tasks = list(tasks)
        self._seed = seed
        self._lock = threading.Lock()
        self.epoch = 0
        self._order = self._shuffled(0)
        self._position = 0

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self._tasks)))
        random.Random(self._seed + epoch).shuffle(order)
        return order

    def next(self) -> rollout_pb2.Task:
        """The next task, starting a new, reshuffled epoch when this one is used up."""
        with self._lock:
            if self._position == len(self._order):
                self.epoch += 1
                self._order = self._shuffled(self.epoch)
                self._position = 0
            task = self._tasks[self._order[self._position]]
            self._position += 1
        return _copy(task)

    def get(self, task_id: str) -> rollout_pb2.Task | None:
        """The task with this id, or None."""
        index = self._index.get(task_id)
        return None if index is None else _copy(self._tasks[index])

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[rollout_pb2.Task]:
        return self

    def __next__(self) -> rollout_pb2.Task:
        return self.next()


def _copy(task: rollout_pb2.Task) -> rollout_pb2.Task:
    out = rollout_pb2.Task()
    out.CopyFrom(task)
    return out
