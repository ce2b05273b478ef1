"""How a run is asked to stop: SIGINT or SIGTERM (Ctrl-C, or Kubernetes stopping the pod), or a part of the
launcher that saw a stop condition (max_steps, max_minutes, a service that failed for good).

Decides: the first request wins and its reason is what the run reports as ``stopped_by``; a second Ctrl-C
while stopping is ignored, with a note, because cutting the learner's checkpoint short would lose what it
consumed. Every wait of the launcher (start-up, the progress loop, a restart's backoff) waits on
``Stopping.event``, so a request is seen within one poll.

How long the learner's stop is waited for (:func:`learner_stop_wait`): its final checkpoint must be on disk
before the ranks are killed, and at 7B that is ~91 GB (12 B per parameter,
``checkpoints.BYTES_PER_PARAMETER``), minutes on a network volume. The wait is ``launcher.stop_timeout_s`` or,
where longer, the checkpoint's bytes (from the model's parameter count, as the learner's memory estimator
counts them) at :data:`CHECKPOINT_WRITE_BYTES_PER_S` plus :data:`CHECKPOINT_WAIT_MARGIN_S`. A learner whose
checkpoint is done sooner is not waited for longer; a kill that comes anyway leaves the previous checkpoint the
one a start resumes from (services/learner/checkpoints.py).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# a conservative aggregate write bandwidth of a checkpoint volume: a cloud disk or NFS at its baseline (local
# NVMe writes ten times faster); where the volume is slower, launcher.stop_timeout_s is raised to cover it
CHECKPOINT_WRITE_BYTES_PER_S = 200e6
# beyond the writes: the step in flight when the stop came, DeepSpeed's gathers of the state before writing
CHECKPOINT_WAIT_MARGIN_S = 60.0


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


@dataclass(frozen=True)
class LearnerStopWait:
    """How long the launcher waits for the learner to stop, and why (the line it prints)."""

    seconds: float
    detail: str


def learner_stop_wait(stop_timeout_s: float, checkpoint_bytes: int | None) -> LearnerStopWait:
    """``launcher.stop_timeout_s``, or the time to write ``checkpoint_bytes`` at
    :data:`CHECKPOINT_WRITE_BYTES_PER_S` plus :data:`CHECKPOINT_WAIT_MARGIN_S` where that is longer."""
    if checkpoint_bytes is None:
        return LearnerStopWait(
            stop_timeout_s,
            f"{stop_timeout_s:.0f}s (launcher.stop_timeout_s; the checkpoint's size is unknown)",
        )
    needed = checkpoint_bytes / CHECKPOINT_WRITE_BYTES_PER_S + CHECKPOINT_WAIT_MARGIN_S
    seconds = max(stop_timeout_s, needed)
    return LearnerStopWait(
        seconds,
        f"{seconds:.0f}s: its checkpoint of ~{checkpoint_bytes / 1e9:.1f} GB takes {needed:.0f}s at "
        f"{CHECKPOINT_WRITE_BYTES_PER_S / 1e6:.0f} MB/s with {CHECKPOINT_WAIT_MARGIN_S:.0f}s of margin "
        f"(launcher.stop_timeout_s = {stop_timeout_s:g}; raise it for a slower volume)",
    )


def learner_checkpoint_bytes(model: str, checkpoint_dir: Path, lora: Any = None) -> int | None:
    """Bytes of the learner's next checkpoint: the parameters it holds (a LoRA run's adapters, ``lora`` being
    its ``learner.lora``) × ``checkpoints.BYTES_PER_PARAMETER``;
    where its config cannot be read here (a hub id and no network on the launcher's node), the size of the
    last checkpoint on disk; None without either."""
    from services.learner import checkpoints

    try:
        return checkpoints.checkpoint_bytes(checkpoints.model_parameters(model, lora))
    except Exception as exc:  # the stop goes on: the wait falls back to what is on disk, or the setting
        log.warning("could not count the parameters of %s to size the learner's stop wait: %s", model, exc)
    found = checkpoints.resolve(checkpoint_dir).tag
    if found is None:
        return None
    return sum(f.stat().st_size for f in (checkpoint_dir / found).iterdir() if f.is_file())
