"""The run's training clock: when each policy version was published, and the GPUs the run holds.

    learner rank 0, after publishing version v ─► HSET vcpo:<run>:clock v:<v> <unix time>
                                                  (version 0 of a fresh run also sets `start`, once)
    launcher, at start-up                      ─► HSET vcpo:<run>:clock gpus <GPUs the run holds>
    evaluator / launcher                       ─► train_seconds(v) = time(v) - start
                                                  gpu_hours(v)     = train_seconds(v) / 3600 x gpus

This is the x axis of held-out accuracy curves: the training wall time (and GPU-hours) at which a version
existed, measured from the first publish of version 0, so the warm start and service start-up are not in it
(a resumed run's downtime between its stop and its restart is). Kept in the run's Redis, which every
service already reaches and which survives restarts (its append-only file).
"""

from __future__ import annotations

import time

import redis


def clock_key(run_id: str) -> str:
    return f"vcpo:{run_id}:clock"


def eval_results_key(run_id: str) -> str:
    """Redis list of the run's evaluation records (JSON, oldest first; services/evaluator/metrics.py),
    which the launcher copies into the metrics log with the steps, on this clock's axis."""
    return f"vcpo:{run_id}:eval:results"


class RunClock:
    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self.client, self.key = client, clock_key(run_id)

    def published(self, version: int, unix: float | None = None) -> None:
        """Version ``version`` exists from ``unix`` (now by default); version 0 starts the clock, once."""
        unix = time.time() if unix is None else unix
        pipe = self.client.pipeline(transaction=False)
        if version == 0:
            pipe.hsetnx(self.key, "start", repr(unix))
        pipe.hsetnx(self.key, f"v:{version}", repr(unix))  # a republish after a restart keeps the first time
        pipe.execute()

    def set_gpus(self, gpus: float) -> None:
        self.client.hset(self.key, "gpus", repr(float(gpus)))

    def at(self, version: int) -> tuple[float | None, float | None]:
        """``(train_seconds, gpu_hours)`` when ``version`` was published; None for what is not known."""
        start, when, gpus = self.client.hmget(self.key, ["start", f"v:{version}", "gpus"])
        if start is None or when is None:
            return None, None
        seconds = max(0.0, float(when) - float(start))
        return seconds, (None if gpus is None else seconds / 3600.0 * float(gpus))
