"""How a run is asked to stop: SIGINT or SIGTERM (Ctrl-C, or Kubernetes stopping the pod), or a part of the
launcher that saw a stop condition (max_steps, max_minutes, a service that failed for good).

Decides: the first request wins and its reason is what the run reports as ``stopped_by``; a second Ctrl-C
while stopping is ignored, with a note, because cutting the learner's checkpoint short would lose what it
consumed. Every wait of the launcher (start-up, the progress loop, a restart's backoff) waits on
``Stopping.event``, so a request is seen within one poll.
"""

from __future__ import annotations

import re
import signal
import threading
from typing import Any


class Stopping:
    """SIGINT/SIGTERM ask the run to stop (once: a second Ctrl-C while stopping is ignored, with a note,
    because cutting the learner's checkpoint short would lose what it consumed)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            print("  (already stopping: waiting for the learner's checkpoint)", flush=True)
            return
        self.stop(signal.Signals(signum).name)

    def stop(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()


def failure_reason(exc: BaseException) -> str:
    """What ``stopping (failed: ...)`` says: for an error raised in a Ray task or actor, where and what it
    was (``LearnerRankActor.run raised OSError: [Errno 98] Address already in use``), not Ray's remote
    traceback, whose first line names only the actor (the traceback goes to the log)."""
    from ray.exceptions import RayTaskError

    where: list[str] = []
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        where.append(_task_name(exc))
        exc = exc.cause
    if not where:
        return str(exc)
    return f"{' → '.join(where)} raised {type(exc).__name__}: {exc}"


def _task_name(exc: BaseException) -> str:
    """The task or actor method a RayTaskError came from. ``ray.get`` raises it as an instance of its cause's
    class too, which keeps only its message (``ray::LearnerRankActor.run() (pid=..., ip=...)`` in colour)."""
    name = vars(exc).get("function_name")
    if name:
        return str(name)
    first = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split("\n", 1)[0]
    return first.split(" (pid=", 1)[0].removeprefix("ray::").removesuffix("()")
