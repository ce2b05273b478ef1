"""Closed weight groups' process groups, destroyed on a thread of their own.

A process group's destructor may block: ~ProcessGroupGloo joins its worker threads, and one of them may still
wait, until the group's timeout, on a peer that hung or died mid-collective. Dropped by whoever held it last,
the destructor would run on that thread: a chaos run saw the broker's receiving thread stuck 75 s in it,
and the learner's next broadcast waited as long. Kept forever instead, every failed or re-formed epoch kept
its threads and sockets (about 3 threads and 10 descriptors per rank on gloo; rank 0's rendezvous store also
kept every member's connection of every closed epoch): a long run whose samplers restart now and then would
reach a container's open-files limit.

So :func:`retire` hands a closed group to one daemon thread, which destroys it once nothing else holds it
(the weight group, a collective being issued, a thread aborting it): the last reference is the reaper's, and
the destructor runs there. torch releases the GIL while it destroys a process group, so a destructor that
waits out a timeout holds up only the groups retired after it, never the caller. CPython's reference counts
tell when a group is the reaper's alone.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_HELD: list[Any] = []  # retired process groups not yet destroyed
_REAPER: threading.Thread | None = None
_POLL_S = 0.5
_SLOW_S = 10.0  # a destroy that took longer is logged
_ONLY_HERE = 2  # sys.getrefcount of a group held by _HELD alone: the list's slot and the call's argument
destroyed = 0  # retired groups destroyed so far (tests read it)


class Closed:
    """What a closed weight group holds in its process group's place: any collective on it is refused."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"weight group epoch {self.epoch} is closed")


def retire(pg: Any, epoch: int) -> Closed:
    """Destroy ``pg`` (epoch ``epoch``'s process group, closed or never connected) on the reaper thread once
    nothing else holds it; returns what the weight group keeps in its place (its own reference must go)."""
    global _REAPER
    with _LOCK:
        _HELD.append(pg)
        if _REAPER is None or not _REAPER.is_alive():
            _REAPER = threading.Thread(target=_reap, name="weight-group-reaper", daemon=True)
            _REAPER.start()
    return Closed(epoch)


def waiting() -> int:
    """Retired groups not destroyed yet (something still holds them, or one ahead of them is being destroyed)."""
    with _LOCK:
        return len(_HELD)


def _reap() -> None:
    global destroyed
    while True:
        time.sleep(_POLL_S)
        while True:
            with _LOCK:
                free = next((i for i in range(len(_HELD)) if sys.getrefcount(_HELD[i]) <= _ONLY_HERE), None)
                if free is None:
                    break
                pg = _HELD.pop(free)
            t0 = time.monotonic()
            del pg  # the last reference: the destructor runs here, the GIL released
            took = time.monotonic() - t0
            destroyed += 1
            (log.info if took > _SLOW_S else log.debug)(
                "destroyed a retired weight group's process group in %.1fs", took
            )
