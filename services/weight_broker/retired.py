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

At interpreter exit the reaper is stopped, and a destroy under way is waited for (up to ``_EXIT_WAIT_S``):
a thread that reacquires the GIL while Python finalizes is ended by a forced unwind, which torch's destructor
frames do not allow (std::terminate: the process aborts, as a test session's did after all its tests had
passed). Groups still held then are destroyed with the rest of the process's objects.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_HELD: list[Any] = []  # retired process groups not yet destroyed
_REAPER: threading.Thread | None = None
_STOP = threading.Event()  # set at interpreter exit
_POLL_S = 0.5
_EXIT_WAIT_S = 10.0  # the longest the interpreter's exit waits for a destroy under way
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
        if not _STOP.is_set() and (_REAPER is None or not _REAPER.is_alive()):
            _REAPER = threading.Thread(target=_reap, name="weight-group-reaper", daemon=True)
            _REAPER.start()
    return Closed(epoch)


def waiting() -> int:
    """Retired groups not destroyed yet (something still holds them, or one ahead of them is being destroyed)."""
    with _LOCK:
        return len(_HELD)


def _reap() -> None:
    global destroyed
    while not _STOP.wait(_POLL_S):
        while not _STOP.is_set():
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


def _stop() -> None:
    """At interpreter exit (see the module's docstring): no destroy starts on the reaper after this, and one
    under way has ended (or ``_EXIT_WAIT_S`` has passed)."""
    _STOP.set()
    reaper = _REAPER
    if reaper is not None and reaper.is_alive():
        reaper.join(_EXIT_WAIT_S)
        if reaper.is_alive():
            log.warning("a retired weight group was still being destroyed at exit")


atexit.register(_stop)
