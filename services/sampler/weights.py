"""Weight sync for a sampler: notice newer versions, fetch them in the background, apply them at the loop's
safe points.

    fetch thread:  announcements (weights stream) ─┐
                   transport.latest() (fallback) ──┴─► newer and wanted? ─► transport.fetch(engine.stage(v))
                                                       complete ─► ready(v); any failure ─► engine.discard(v)
    sampler loop:  ready() ─► prepare(v)                                    the engine still generating
                             ─► engine.apply(v) between two engine steps  the whole version at once

Only ``apply`` (the load itself) stops generation. A failed fetch leaves the engine on its version: admission
starts groups only while that is within the lag bound, and :meth:`WeightSync.waiting_reason` says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.admission import Admission
from services.common.streams.consumer import StreamTail
from services.sampler.engine import GenerationEngine
from services.weight_transport import (
    AnnouncementWatch,
    BrokerUnavailable,
    MemberSeat,
    NoRoom,
    Seat,
    TransferFailed,
    VersionNotFound,
    WeightTransport,
)
from vcpo.v1 import weights_pb2

log = logging.getLogger(__name__)


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class WeightSync:
    def __init__(
        self,
        engine: GenerationEngine,
        transport: WeightTransport,
        announcements: StreamTail[weights_pb2.WeightAnnouncement] | None,
        poll_interval_s: float = 0.2,
        wanted: Callable[[int], bool] | None = None,
        latest_every_s: float = 10.0,
    ) -> None:
        """``wanted``: which newer versions to fetch (None: all; the dedicated evaluator's: its due ones).
        ``latest_every_s``: how often the broker's latest version is asked for beside the announcements."""
        self.engine, self.transport, self.announcements = engine, transport, announcements
        self.poll_interval_s, self.latest_every_s, self.wanted = poll_interval_s, latest_every_s, wanted
        self.fetched: int | None = None  # the newest version fetched and staged whole
        self.newest_known: int | None = None  # the newest version published, as far as this sampler knows
        self.declined: int | None = None  # the newest version `wanted` refused (not fetched)
        self.declined_total = 0
        self.unreachable_since: float | None = None  # since when the broker is out of reach
        self.error = ""  # why the last fetch or apply failed ("" after a success)
        self.last_path = "broker"  # how the version last applied arrived
        self.fetch_seconds = 0.0  # how long the version last fetched (or, once applied, received) took
        self._asked = float("-inf")  # when the broker's latest version was last asked for
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weight-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def pump(self) -> None:
        """The loop's turn between engine steps (the collective transport's: fetches run in the background)."""

    def poll_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a bad version (e.g. tensors the model does not have): keep going
                self.error = _text(exc)
                log.error("fetching weights failed: %s", self.error)
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def poll(self) -> bool:
        """Fetch the newest version into ``engine.stage`` if there is a newer one; True if one was staged
        whole. A failed fetch leaves nothing staged: the broker's reason is kept, any other error raised."""
        try:
            newest = self._newest()
        except BrokerUnavailable as exc:
            self._failed(str(exc))
            return False
        if newest is None or (self.fetched is not None and newest <= self.fetched) or not self._wants(newest):
            self.unreachable_since = None
            return False
        t0 = time.monotonic()
        sink = self.engine.stage(newest)
        try:
            manifest = self.transport.fetch(sink, newest)
        except BaseException as exc:
            self.engine.discard(newest)
            if not isinstance(exc, (BrokerUnavailable, VersionNotFound)):
                raise
            self._failed(str(exc))
            return False
        self.fetch_seconds = time.monotonic() - t0
        self.fetched, self.error, self.unreachable_since = int(manifest.policy_version), "", None
        size, seconds = manifest.total_bytes, self.fetch_seconds
        log.info("fetched version %d (%d bytes in %.2fs)", self.fetched, size, seconds)
        return True

    def _wants(self, version: int) -> bool:
        """Whether to fetch ``version``; each refused one is asked about once (a refusal is final)."""
        if self.wanted is None or (version != self.declined and self.wanted(version)):
            return True
        if version != self.declined:
            self.declined, self.declined_total = version, self.declined_total + 1
            log.debug("version %d is not wanted: not fetched", version)
        return False

    def _newest(self) -> int | None:
        if self.announcements is not None:
            for entry in self.announcements.read(count=1000):
                self.newest_known = max(self.newest_known or 0, entry.policy_version)
        now = time.monotonic()
        stale = now - self._asked >= self.latest_every_s
        if self.announcements is None or self.newest_known is None or stale:
            self._asked = now
            latest = self.transport.latest()
            if latest is not None:
                self.newest_known = max(self.newest_known or 0, latest)
        return self.newest_known

    def _failed(self, error: str) -> None:
        self.error, self.unreachable_since = error, self.unreachable_since or time.monotonic()
        log.warning("weights stay at version %s: %s", self.engine.loaded_version, error)

    def ready(self) -> int | None:
        """A completely staged version newer than the engine's, if there is one."""
        version, loaded = self.fetched, self.engine.loaded_version
        if version is None or self.engine.staged_version() != version:
            return None
        return version if loaded is None or version > loaded else None

    def prepare(self, version: int) -> None:
        """What can be done towards loading ``version`` while the engine generates (call before ``quiesce``).
        Raises LoadNotStarted if it fails; the version is then dropped and the engine serves on."""
        try:
            self.engine.prepare(version)
        except Exception as exc:
            self.error = f"version {version} could not be loaded: {_text(exc)}"
            raise

    def apply(self, version: int) -> float:
        """Load the staged ``version`` into the engine (call between engine steps); seconds it took."""
        try:
            seconds = self.engine.apply(version)
        except Exception as exc:
            self.error = f"version {version} could not be loaded: {_text(exc)}"
            raise
        self.last_path, took = "broker", self.fetch_seconds
        log.info("serving version %d (fetched in %.2fs, loaded in %.2fs)", version, took, seconds)
        return seconds

    def waiting_reason(self, admission: Admission) -> str:
        """Why admission control holds this sampler back, and what it is doing about it."""
        loaded, newest = self.engine.loaded_version, self.newest_known
        why = f"{admission.reason} (serving version {loaded})"
        if self.error:
            down = f" for {time.monotonic() - self.unreachable_since:.0f}s" if self.unreachable_since else ""
            return f"{why}; cannot get newer weights{down}: {self.error}"
        if newest is not None and loaded is not None and newest > loaded:
            return f"{why}; loading version {newest}"
        return f"{why}; the learner has not published a newer version yet"


SEAT_RETRY_S = 5.0  # a registration the registry refused is tried again this much later
LOOK_S = 0.005  # how often the loop asks the workers about their work, and the group for announcements


class CollectiveWeightSync(WeightSync):
    """Weight sync with the collective transport: at each turn of the loop (``pump``) join the epoch the seat
    was given, leave a superseded or failed one, begin receiving each announced version, and apply it once
    received like a fetched one; the fetch thread takes through the broker what the group did not carry (design:
    docs/design/weight-transport.md, "In a run"). A replica registers only once it serves a version: a member
    whose loop spent its ticks in that first load would hold every broadcast of an epoch naming it."""

    def __init__(
        self,
        engine: GenerationEngine,
        transport: WeightTransport,
        announcements: StreamTail[weights_pb2.WeightAnnouncement] | None,
        seat: MemberSeat,
        poll_interval_s: float = 0.2,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        def wanted(version: int) -> bool:  # not versions the group delivered (unless their load failed)
            return self.received is None or version > self.received

        super().__init__(engine, transport, announcements, poll_interval_s, wanted)
        self.member: Any = engine  # the engine's collective methods (engine_collective.py)
        self.seat = seat
        self.on_failure = on_failure or (lambda: None)
        self.watch: AnnouncementWatch | None = None
        self.epoch = 0  # of the group this engine is in (0: none)
        self.received: int | None = None  # the newest version the group delivered
        self.broadcast_failures = 0
        self._receive_seconds = 0.0
        self._last_look = 0.0
        # the join or receive the engine's workers are doing: (seat or version, when it began); None: none
        self._busy: tuple[Seat | int, float] | None = None
        self._seated = False  # registered for the group
        self._seat_tried = float("-inf")
        self.withdrawn: str | None = None  # why this engine left the group for good: its GPU has no room

    def stop(self) -> None:
        if self._seated:
            self.seat.stop()
        super().stop()
        self.watch = None

    def pump(self) -> None:
        now = time.monotonic()
        serving = self.engine.loaded_version is not None
        if serving and not (self._seated or self.withdrawn) and now - self._seat_tried >= SEAT_RETRY_S:
            try:
                self.seat.start()
                self._seated = True
            except Exception as exc:
                log.warning("could not register for the weight group: %s", exc)
                self._seat_tried = time.monotonic()  # after the attempt, which may have waited out Redis
        if self._busy is not None:
            if now - self._last_look >= LOOK_S:
                self._last_look = now
                try:
                    if self.member.weight_work_done():
                        self._settled()
                except Exception as exc:
                    self._work_failed(exc)
            return
        seat = self.seat.take()
        if seat is not None:
            log.info("joining weight group epoch %d", seat.spec.epoch)
            self._begin(seat, lambda: self.member.begin_join(seat.init_info()))
            return
        if self.watch is None:
            return
        if self.seat.superseded(self.epoch):
            self._leave(f"epoch {self.epoch} was superseded by {self.seat.newest_epoch}", failed=False)
            return
        if now - self._last_look < LOOK_S:
            return
        self._last_look = now
        try:
            version = self.watch.next(0)
        except TransferFailed as exc:  # its store (on rank 0's host) is out of reach: telling the ranks
            self._leave(str(exc), tell=False)  # through it would wait out its timeout, in every worker
            return
        if version is not None:
            self._begin(version, lambda: self.member.begin_receive(version))

    def _begin(self, what: Seat | int, begin: Callable[[], None]) -> None:
        self._busy = (what, time.monotonic())
        try:
            begin()
        except Exception as exc:
            self._work_failed(exc)

    def _settled(self) -> None:
        assert self._busy is not None
        (what, t0), self._busy = self._busy, None
        if isinstance(what, int):
            self._receive_seconds, self.received = time.monotonic() - t0, what
        else:
            self.watch, self.epoch = AnnouncementWatch.of(what.spec), what.spec.epoch
            log.info("joined weight group epoch %d as ranks from %d", self.epoch, what.rank_offset)

    def _work_failed(self, exc: Exception) -> None:
        assert self._busy is not None
        (what, t0), self._busy = self._busy, None
        if not isinstance(what, int):
            tried = f"tried for {time.monotonic() - t0:.1f}s"
            self._leave(_text(exc), why=f"could not join weight group epoch {what.spec.epoch} ({tried})")
            return
        self._leave(f"version {what}: {_text(exc)}")
        if isinstance(exc, NoRoom):
            # as a member it would fail every broadcast, for every engine in the group: out of it for good
            self.withdrawn = str(exc)
            if self._seated:
                self.seat.stop()
                self._seated = False
            log.error("this engine takes every version through the broker from now on: %s", exc)

    def _leave(self, what: str, failed: bool = True, tell: bool = True, why: str = "") -> None:
        """Out of the group: ``failed``, its epoch failed (``why``: how, if not in a broadcast), counted and,
        with ``tell``, told every rank; otherwise the epoch was superseded."""
        self.watch = None
        if failed:
            self.broadcast_failures += 1
            self.on_failure()
            self.error = f"{why or f'weight group epoch {self.epoch} failed'}: {what}"
            log.warning("%s; weights come through the broker until a new group forms", self.error)
        else:
            log.info("leaving weight group: %s", what)
        # the workers' groups too: a failure outside the group's collectives (a worker's own) left them open,
        # and rank 0 would wait for them in its next broadcast until the group's timeout
        self.member.leave_weight_group(self.error if failed and tell else None)
        self.epoch = 0
        self.poll_now()  # what the group would have carried may be on the broker already

    def ready(self) -> int | None:
        staged, fetched, loaded = self.member.collective_staged, super().ready(), self.engine.loaded_version
        newer = staged is not None and (loaded is None or staged > loaded)
        return int(staged) if newer and (fetched is None or staged >= fetched) else fetched

    def prepare(self, version: int) -> None:
        if self.member.collective_staged != version:  # the broker's copy is applied
            super().prepare(version)

    def apply(self, version: int) -> float:
        if self.member.collective_staged != version:
            return super().apply(version)
        try:
            seconds = float(self.member.apply_collective(version))
        except Exception as exc:
            # the broker's copy is wanted again, though the fetch thread passed over it when the group had
            # delivered it (a refusal is otherwise final): the sampler would admit nothing until a newer one
            self.received, self.declined = None, None
            self.error = f"version {version} could not be loaded: {_text(exc)}"
            try:  # under NCCL the broker holds only what the group did not carry: the learner gives it this
                self.seat.renew()
            except Exception as renew_exc:
                log.warning("could not register again after a failed load: %s", renew_exc)
            self.poll_now()
            raise
        self.error, self.last_path, self.fetch_seconds = "", "collective", self._receive_seconds
        took = self.fetch_seconds
        log.info("serving version %d (broadcast in %.2fs, loaded in %.2fs)", version, took, seconds)
        return seconds
