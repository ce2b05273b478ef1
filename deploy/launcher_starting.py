"""A service's start that blocks (Serve's deploy waits for its replicas) run on a thread of its own, so the
launcher starts the others meanwhile (deploy/launcher_services.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Starting:
    """A blocking start (Serve's deploy waits for its replicas) on a thread of its own, so that other services
    start meanwhile; :meth:`result` raises what the start raised."""

    def __init__(self, name: str, start: Callable[[], Any]) -> None:
        self._error: BaseException | None = None
        self._start = start
        self._thread = threading.Thread(target=self._run, name=f"start-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._start()
        except BaseException as exc:  # handed to the waiting thread by result()
            self._error = exc

    def done(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
