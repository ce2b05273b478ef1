"""The thread a background broadcast runs on (``CollectivePublisher.send_background``), one per version.

Not an executor's: the interpreter's exit joins those without bound, and a broadcast that did not give up
after its group was aborted is left behind (``CollectivePublisher.abort_overdue``). A daemon instead, waited
for at exit at most :data:`EXIT_WAIT_S` (a daemon that takes the GIL back while Python finalizes is ended by a
forced unwind, which torch's frames turn into std::terminate). What the thread was given (the staged version:
a model's size) is let go of before it reports, and a failure's frames are cleared of their locals: the
traceback would otherwise hold it until the garbage collector ran, the next version staged beside it."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
EXIT_WAIT_S = 10.0  # the longest the interpreter's exit waits for broadcasts left behind
_BEHIND: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_LOCK = threading.Lock()


def start(name: str, fn: Callable[..., T], *args: Any) -> tuple[threading.Thread, Future[T]]:
    """``fn(*args)`` on a daemon thread of its own; its result, or its failure, in the future returned."""
    future: Future[T] = Future()
    work = [args]  # let go of before the future is set

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            result = fn(*work.pop())  # held by fn's frame alone
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, future


def cleared(error: BaseException) -> BaseException:
    """A background broadcast's failure, its traceback's frames cleared of their locals (the module's)."""
    traceback.clear_frames(error.__traceback__)
    return error


def leave_behind(thread: threading.Thread, future: Future[Any], let_go: Callable[[], None]) -> None:
    """Stop waiting for ``thread`` (its broadcast did not give up after its group was aborted): ``let_go``
    runs once it ends, if it does; the interpreter's exit waits for it at most :data:`EXIT_WAIT_S`."""
    with _LOCK:
        _BEHIND.add(thread)

    def ended(done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            cleared(error)
        let_go()

    future.add_done_callback(ended)


def left_behind() -> list[threading.Thread]:
    """The broadcast threads left behind that are still going."""
    with _LOCK:
        return [t for t in _BEHIND if t.is_alive()]


def _at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in left_behind():
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning(
                "a weight broadcast left behind after an abort was still going at exit: %s", thread.name
            )


atexit.register(_at_exit)
