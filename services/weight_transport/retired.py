"""Closed weight groups' process groups, destroyed on a reaper thread of their own (:func:`retire`).

A process group's destructor may block: ~ProcessGroupGloo joins its worker threads, one of which may wait, until
the group's timeout, on a peer that hung or died mid-collective. Dropped by whoever held it last, it would run
on that thread (a receiving thread, and the learner's next broadcast, stuck for the timeout). Kept forever,
every failed or re-formed epoch kept its threads and sockets (about 3 threads and 10 descriptors per rank on
gloo): a long run whose samplers restart now and then would reach a container's open-files limit. The reaper
destroys a group once it holds the last reference (CPython's reference count tells) and the collectives issued
on it have ended (gloo ends a pending one at the group's timeout), so the destructor has nothing to wait for.

At interpreter exit the reaper is stopped and a destroy under way waited for: a thread that takes the GIL back
while Python finalizes is ended by a forced unwind, which torch's destructor frames turn into std::terminate.
Groups still held then are never destroyed (the process's end frees what they hold).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
# retired process groups not yet destroyed, each with the collectives issued on it
_HELD: list[tuple[Any, Sequence[Any]]] = []
_REAPER: threading.Thread | None = None
_STOP = threading.Event()  # set at interpreter exit
_POLL_S = 0.5
_EXIT_WAIT_S = 10.0  # the longest the interpreter's exit waits for a destroy under way (they take ms)
_SLOW_S = 10.0  # a destroy that took longer is logged
_ONLY_HERE = 2  # sys.getrefcount of a group held by _HELD alone: its tuple's slot and the call's argument
destroyed = 0  # retired groups destroyed so far (tests read it)


class Closed:
    """What a closed weight group holds in its process group's place: any collective on it is refused."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"weight group epoch {self.epoch} is closed")


def retire(pg: Any, epoch: int, works: Sequence[Any] = ()) -> Closed:
    """Destroy ``pg`` (epoch ``epoch``'s process group, closed or never connected) on the reaper thread once
    nothing else holds it and ``works``, the collectives issued on it that may be pending, have ended; returns
    what the weight group keeps in its place (its own reference must go)."""
    global _REAPER
    with _LOCK:
        _HELD.append((pg, list(works)))
        if not _STOP.is_set() and (_REAPER is None or not _REAPER.is_alive()):
            _REAPER = threading.Thread(target=_reap, name="weight-group-reaper", daemon=True)
            _REAPER.start()
    return Closed(epoch)


def waiting() -> int:
    """Retired groups not destroyed yet (something still holds them, or a collective of theirs is pending)."""
    with _LOCK:
        return len(_HELD)


def _reap() -> None:
    global destroyed
    while not _STOP.wait(_POLL_S):
        while not _STOP.is_set():
            with _LOCK:
                free = next((i for i in range(len(_HELD)) if _idle(i)), None)
                if free is None:
                    break
                pg, works = _HELD.pop(free)
            t0 = time.monotonic()
            # the last reference: the destructor runs here (the GIL released), with nothing pending; then the
            # works, which hold the group's connections
            del pg, works
            took = time.monotonic() - t0
            destroyed += 1
            (log.info if took > _SLOW_S else log.debug)(
                "destroyed a retired weight group's process group in %.1fs", took
            )


def _idle(i: int) -> bool:
    """Whether ``_HELD[i]``'s group is held there alone and its collectives have ended (under ``_LOCK``)."""
    if sys.getrefcount(_HELD[i][0]) > _ONLY_HERE:
        return False
    try:
        return all(work.is_completed() for work in _HELD[i][1])
    except Exception:  # a work that cannot tell: it has ended as far as this group goes
        return True


def _stop() -> None:
    """At interpreter exit (see the module's docstring): no destroy starts on the reaper after this, and one
    under way has ended (or ``_EXIT_WAIT_S`` has passed)."""
    _STOP.set()
    reaper = _REAPER
    if reaper is not None and reaper.is_alive():
        reaper.join(_EXIT_WAIT_S)
        if reaper.is_alive():
            log.warning("a retired weight group was still being destroyed at exit")
    with _LOCK:
        for pg, _ in _HELD:  # never destroyed: the process's end frees what they hold
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


atexit.register(_stop)
