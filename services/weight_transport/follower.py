"""A sampler's side of weight sync: notice newer versions, load each whole, and say why it is waiting.

    weights stream (announcements) ─┐
    transport.latest() (fallback) ──┴─► newer than loaded? ─► transport.fetch(loader.begin(v)) ─► loader.commit(v)
                                                               any failure ─► loader.abort(v), reason kept

The loader stages a version and switches the engine to it only in ``commit``, so a version is never
half-applied. If the broker cannot be reached, the follower keeps the weights it has and records why;
admission control then lets the sampler start groups only while its loaded version is within the lag
bound, and :meth:`WeightFollower.waiting_reason` says why it stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from services.common.admission import Admission
from services.common.streams.consumer import StreamTail
from services.weight_transport.protocol import Sink
from services.weight_transport.store import VersionNotFound
from services.weight_transport.transports import BrokerUnavailable, WeightTransport
from vcpo.v1 import weights_pb2

log = logging.getLogger(__name__)


class VersionLoader(Protocol):
    """Where fetched tensors go: staged by ``begin``'s sink, applied together by ``commit``."""

    def begin(self, version: int) -> Sink: ...

    def commit(self, version: int) -> None: ...

    def abort(self, version: int) -> None: ...


class WeightFollower:
    def __init__(
        self,
        transport: WeightTransport,
        loader: VersionLoader,
        announcements: StreamTail[weights_pb2.WeightAnnouncement] | None = None,
        loaded_version: int | None = None,
        wanted: Callable[[int], bool] | None = None,
        latest_every_s: float = 10.0,
    ) -> None:
        """``latest_every_s``: how often the broker's latest version is asked for beside the announcements (one
        the broker could not announce, Redis out of reach for a moment, is not missed until the next)."""
        self.transport, self.loader, self.announcements = transport, loader, announcements
        self.latest_every_s, self._asked = latest_every_s, float("-inf")
        self.loaded_version = loaded_version
        # None: every newer version; else only those it accepts (the dedicated evaluator's due ones)
        self.wanted = wanted
        self.declined: int | None = None  # the newest version `wanted` refused (not fetched)
        self.declined_total = 0
        self.newest_known: int | None = loaded_version
        self.last_error = ""
        self.unreachable_since: float | None = None

    def poll(self) -> bool:
        """Load the newest version if there is a newer one; True if the loaded version changed."""
        try:
            newest = self._newest()
        except BrokerUnavailable as exc:
            self._failed(str(exc))
            return False
        if newest is None or (self.loaded_version is not None and newest <= self.loaded_version):
            self._ok()
            return False
        if not self._wants(newest):
            self._ok()
            return False
        sink = self.loader.begin(newest)
        try:
            manifest = self.transport.fetch(sink, newest)
        except (BrokerUnavailable, VersionNotFound) as exc:
            self.loader.abort(newest)
            self._failed(str(exc))
            return False
        except BaseException:
            self.loader.abort(newest)
            raise
        self.loader.commit(int(manifest.policy_version))
        self.loaded_version = int(manifest.policy_version)
        self._ok()
        log.info("loaded weights of version %d (%d bytes)", self.loaded_version, manifest.total_bytes)
        return True

    def _wants(self, version: int) -> bool:
        """Whether to fetch ``version``; each refused one is asked about once (a refusal is final)."""
        if self.wanted is None:
            return True
        if version == self.declined:
            return False
        if self.wanted(version):
            return True
        self.declined, self.declined_total = version, self.declined_total + 1
        log.debug("version %d is not wanted: not fetched", version)
        return False

    def _newest(self) -> int | None:
        if self.announcements is not None:
            for entry in self.announcements.read(count=1000):
                self.newest_known = max(self.newest_known or 0, entry.policy_version)
        now = time.monotonic()
        if (
            self.announcements is None
            or self.newest_known is None
            or now - self._asked >= self.latest_every_s
        ):
            self._asked = now
            latest = self.transport.latest()
            if latest is not None:
                self.newest_known = max(self.newest_known or 0, latest)
        return self.newest_known

    def _failed(self, error: str) -> None:
        self.last_error = error
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        log.warning("weights stay at version %s: %s", self.loaded_version, error)

    def _ok(self) -> None:
        self.last_error, self.unreachable_since = "", None

    def waiting_reason(self, admission: Admission) -> str:
        """Why a sampler refused by admission control is waiting, for its status and logs."""
        why = f"{admission.reason} (loaded weights: version {self.loaded_version})"
        if self.last_error:
            down = time.monotonic() - (self.unreachable_since or time.monotonic())
            return f"{why}; cannot get newer weights for {down:.0f}s: {self.last_error}"
        if (
            self.newest_known is not None
            and self.loaded_version is not None
            and self.newest_known > self.loaded_version
        ):
            return f"{why}; loading version {self.newest_known}"
        return f"{why}; the learner has not published a newer version yet"
