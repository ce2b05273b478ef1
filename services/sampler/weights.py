"""Weight sync for a sampler: fetch newer versions in the background, apply them at the loop's safe points.

    fetch thread:  WeightFollower.poll ─► transport.fetch(engine.stage(v))    tensors staged on the host
                                          complete and verified ─► ready(v)
    sampler loop:  ready() ─► engine.apply(v) between two engine steps          the whole version at once

Generation keeps running while a version downloads; only ``apply`` (a host-to-engine copy) stops it. A
fetch that fails or is cut off leaves nothing applied: the engine keeps serving its version and the
follower records why, for the sampler's waiting reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from services.common.admission import Admission
from services.common.streams import StreamTail
from services.sampler.engine import GenerationEngine
from services.weight_broker.client import WeightTransport
from services.weight_broker.follower import WeightFollower
from services.weight_broker.protocol import Sink
from vcpo.v1 import weights_pb2

log = logging.getLogger(__name__)


class _StagingLoader:
    """The follower's loader: stage into the engine; "commit" means completely staged, not yet applied."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.complete: int | None = None
        self.fetch_seconds = 0.0
        self._t0 = 0.0

    def begin(self, version: int) -> Sink:
        self._t0 = time.monotonic()
        return self.engine.stage(version)

    def commit(self, version: int) -> None:
        self.fetch_seconds = time.monotonic() - self._t0
        self.complete = version

    def abort(self, version: int) -> None:
        self.engine.discard(version)


class WeightSync:
    def __init__(
        self,
        engine: GenerationEngine,
        transport: WeightTransport,
        announcements: StreamTail[weights_pb2.WeightAnnouncement] | None,
        poll_interval_s: float = 0.2,
        wanted: Callable[[int], bool] | None = None,
    ) -> None:
        self.engine, self.poll_interval_s = engine, poll_interval_s
        self.loader = _StagingLoader(engine)
        self.follower = WeightFollower(transport, self.loader, announcements, wanted=wanted)
        self.error = ""  # why the last fetch or apply failed ("" after a success)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weight-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def poll_now(self) -> None:
        """Look for a newer version without waiting for the next poll."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.follower.poll():
                    self.error = ""
                elif self.follower.last_error:
                    self.error = self.follower.last_error
            except Exception as exc:  # a bad version (e.g. tensors the model does not have): keep going
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("fetching weights failed: %s", self.error)
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    @property
    def newest_known(self) -> int | None:
        """The newest version published, as far as this sampler knows."""
        return self.follower.newest_known

    def ready(self) -> int | None:
        """A completely staged version newer than the engine's, if there is one."""
        version = self.loader.complete
        if version is None or self.engine.staged_version() != version:
            return None
        if self.engine.loaded_version is not None and version <= self.engine.loaded_version:
            return None
        return version

    def apply(self, version: int) -> float:
        """Load the staged ``version`` into the engine (call between engine steps); seconds it took."""
        try:
            seconds = self.engine.apply(version)
        except Exception as exc:
            self.error = f"version {version} could not be loaded: {type(exc).__name__}: {exc}"
            raise
        log.info("serving version %d (fetched in %.2fs, loaded in %.2fs)", version, self.loader.fetch_seconds,
                 seconds)  # fmt: skip
        return seconds

    def waiting_reason(self, admission: Admission) -> str:
        """Why admission control holds this sampler back, and what it is doing about it."""
        loaded, newest = self.engine.loaded_version, self.newest_known
        why = f"{admission.reason} (serving version {loaded})"
        if self.error:
            since = self.follower.unreachable_since
            down = f" for {time.monotonic() - since:.0f}s" if since is not None else ""
            return f"{why}; cannot get newer weights{down}: {self.error}"
        if newest is not None and loaded is not None and newest > loaded:
            return f"{why}; loading version {newest}"
        return f"{why}; the learner has not published a newer version yet"
