"""Weight sync for a sampler: notice newer versions, fetch them in the background, apply them at the loop's
safe points.

    fetch thread:  announcements (weights stream) ─┐
                   transport.latest() (fallback) ──┴─► newer and wanted? ─► transport.fetch(engine.stage(v))
                                                       complete ─► ready(v); any failure ─► engine.discard(v)
    sampler loop:  ready() ─► prepare(v)                                    the engine still generating
                             ─► engine.apply(v) between two engine steps  the whole version at once

Generation keeps running while a version downloads and while ``prepare`` writes what the engine's workers
read it from (engines whose workers are other processes); only ``apply`` (the load itself) stops it. A
fetch that fails or is cut off leaves nothing applied: the engine keeps serving its version and the reason
is kept; admission control then lets the sampler start groups only while that version is within the lag
bound, and :meth:`WeightSync.waiting_reason` says why it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

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
        """``wanted``: None fetches every newer version; else only those it accepts (the dedicated
        evaluator's due ones). ``latest_every_s``: how often the broker's latest version is asked for beside
        the announcements (one the broker could not announce, Redis out of reach for a moment, is not missed
        until the next)."""
        self.engine, self.transport, self.announcements = engine, transport, announcements
        self.poll_interval_s, self.latest_every_s = poll_interval_s, latest_every_s
        self.wanted = wanted
        self.fetched: int | None = None  # the newest version fetched and staged whole
        self.newest_known: int | None = None  # the newest version published, as far as this sampler knows
        self.declined: int | None = None  # the newest version `wanted` refused (not fetched)
        self.declined_total = 0
        self.unreachable_since: float | None = (
            None  # since when the broker is out of reach (None: it answers)
        )
        self.error = ""  # why the last fetch or apply failed ("" after a success)
        self.last_path = "broker"  # how the version last applied arrived
        self._fetch_seconds = 0.0
        self._asked = float("-inf")  # when the broker's latest version was last asked for
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

    def pump(self) -> None:
        """The loop's turn between engine steps (the collective transport receives here; nothing to do on the
        broker's path, whose fetches run in the background)."""

    @property
    def fetch_seconds(self) -> float:
        """How long the version last made ready took to fetch and stage."""
        return self._fetch_seconds

    def poll_now(self) -> None:
        """Look for a newer version without waiting for the next poll."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # a bad version (e.g. tensors the model does not have): keep going
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("fetching weights failed: %s", self.error)
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def poll(self) -> bool:
        """Fetch the newest version into ``engine.stage`` if there is a newer one; True if one was staged
        whole. A fetch the broker fails leaves nothing staged and its reason kept; any other failure (tensors
        the model does not have) is raised, nothing staged either."""
        try:
            newest = self._newest()
        except BrokerUnavailable as exc:
            self._failed(str(exc))
            return False
        if newest is None or (self.fetched is not None and newest <= self.fetched) or not self._wants(newest):
            self._ok()
            return False
        t0 = time.monotonic()
        sink = self.engine.stage(newest)
        try:
            manifest = self.transport.fetch(sink, newest)
        except (BrokerUnavailable, VersionNotFound) as exc:
            self.engine.discard(newest)
            self._failed(str(exc))
            return False
        except BaseException:
            self.engine.discard(newest)
            raise
        self._fetch_seconds = time.monotonic() - t0
        self.fetched, self.error = int(manifest.policy_version), ""
        self._ok()
        log.info(
            "fetched version %d (%d bytes in %.2fs)", self.fetched, manifest.total_bytes, self._fetch_seconds
        )
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
        self.error = error
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        log.warning("weights stay at version %s: %s", self.engine.loaded_version, error)

    def _ok(self) -> None:
        self.unreachable_since = None

    def ready(self) -> int | None:
        """A completely staged version newer than the engine's, if there is one."""
        version = self.fetched
        if version is None or self.engine.staged_version() != version:
            return None
        if self.engine.loaded_version is not None and version <= self.engine.loaded_version:
            return None
        return version

    def prepare(self, version: int) -> None:
        """What can be done towards loading ``version`` while the engine generates (call before ``quiesce``).
        Raises LoadNotStarted if it fails; the version is then dropped and the engine serves on."""
        try:
            self.engine.prepare(version)
        except Exception as exc:
            self.error = f"version {version} could not be loaded: {type(exc).__name__}: {exc}"
            raise

    def apply(self, version: int) -> float:
        """Load the staged ``version`` into the engine (call between engine steps); seconds it took."""
        try:
            seconds = self.engine.apply(version)
        except Exception as exc:
            self.error = f"version {version} could not be loaded: {type(exc).__name__}: {exc}"
            raise
        self.last_path = "broker"
        log.info(
            "serving version %d (fetched in %.2fs, loaded in %.2fs)", version, self._fetch_seconds, seconds
        )
        return seconds

    def waiting_reason(self, admission: Admission) -> str:
        """Why admission control holds this sampler back, and what it is doing about it."""
        loaded, newest = self.engine.loaded_version, self.newest_known
        why = f"{admission.reason} (serving version {loaded})"
        if self.error:
            since = self.unreachable_since
            down = f" for {time.monotonic() - since:.0f}s" if since is not None else ""
            return f"{why}; cannot get newer weights{down}: {self.error}"
        if newest is not None and loaded is not None and newest > loaded:
            return f"{why}; loading version {newest}"
        return f"{why}; the learner has not published a newer version yet"


SEAT_RETRY_S = 5.0  # a registration the registry refused is tried again this much later


class CollectiveWeightSync(WeightSync):
    """Weight sync with the collective transport: versions the learner broadcasts are received into the
    engine's workers between engine steps, and applied at the loop's safe points like fetched ones.

        seat thread:  registration heartbeat; an epoch naming this engine ─► every member arrived ─► take()
        sampler loop: pump(): join a formed epoch (engine.begin_join), leave a superseded or broken one;
                      an announced version ─► engine.begin_receive(v)   the broadcast cannot wait: received
                                                                        now, on the workers' own threads,
                                                                        the engine stepping, the model untouched
                      engine.weight_work_done() ─► staged             asked at later turns
                      ready() ─► apply(v)                               in the weight_update mode's time
        fetch thread: the broker's path for what the group did not carry (published while it formed, or after
                      a failed broadcast, or before this replica joined); versions the group delivered are
                      not fetched again, unless their load failed

    A broadcast that fails leaves the engine on its version (nothing was loaded before the group's vote),
    is counted in ``broadcast_failures``, and the engine leaves the group until the learner forms a new one.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        transport: WeightTransport,
        announcements: StreamTail[weights_pb2.WeightAnnouncement] | None,
        seat: MemberSeat,
        poll_interval_s: float = 0.2,
        announce_poll_s: float = 0.005,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(engine, transport, announcements, poll_interval_s, wanted=self._fetch_wanted)
        self.seat, self.announce_poll_s = seat, announce_poll_s
        self.on_failure = on_failure or (lambda: None)
        self.watch: AnnouncementWatch | None = None
        self.epoch = 0  # of the group this engine is in (0: none)
        self.received: int | None = None  # the newest version the group delivered
        self.broadcast_failures = 0
        self.received_total = 0
        self._receive_seconds = 0.0
        self._last_look = 0.0
        # the join or receive the engine's workers are doing: (seat or version, when it began); None: none
        self._busy: tuple[Seat | int, float] | None = None
        self._seated = False  # registered for the group (start)
        self._seat_tried = float("-inf")
        self.withdrawn: str | None = None  # why this engine left the group for good: its GPU has no room

    def start(self) -> None:
        """Fetch through the broker; register for the group once the engine serves a version (at once if it
        does already). A replica that starts or restarts catches up from the broker first: a member's loop
        that spent its ticks in that first load (the whole model through the staging file) would hold every
        broadcast of an epoch naming it, and every other engine's loop inside it."""
        super().start()
        if self.engine.loaded_version is not None:
            self._seat()

    def _seat(self) -> None:
        """Register (once the engine serves a version); where the registry is out of reach, again at the loop's
        turn ``SEAT_RETRY_S`` later."""
        if self._seated or self.withdrawn or time.monotonic() - self._seat_tried < SEAT_RETRY_S:
            return
        try:
            self.seat.start()
        except Exception as exc:
            log.warning(
                "could not register for the weight group (trying again in %.0fs): %s", SEAT_RETRY_S, exc
            )
            self._seat_tried = (
                time.monotonic()
            )  # after the attempt, which may have waited out Redis's timeouts
            return
        self._seated = True

    def stop(self) -> None:
        if self._seated:
            self.seat.stop()
        super().stop()
        self.watch = None

    def _fetch_wanted(self, version: int) -> bool:
        return self.received is None or version > self.received

    def pump(self) -> None:
        if not self._seated and self.engine.loaded_version is not None:
            self._seat()
        now = time.monotonic()
        if self._busy is not None:
            if now - self._last_look >= self.announce_poll_s:
                self._last_look = now
                self._settle()
            return
        seat = self.seat.take()
        if seat is not None:
            self._join(seat)
            return
        if self.watch is None:
            return
        if self.seat.superseded(self.epoch):
            self._leave(f"epoch {self.epoch} was superseded by {self.seat.newest_epoch}", failed=False)
            return
        if now - self._last_look < self.announce_poll_s:
            return
        self._last_look = now
        try:
            version = self.watch.next(0)
        except TransferFailed as exc:  # its store (on rank 0's host) is out of reach: telling the ranks
            self._leave(str(exc), tell=False)  # through it would wait out its timeout, in every worker
            return
        if version is None:
            return
        try:
            self.engine.begin_receive(version)  # type: ignore[attr-defined]
        except Exception as exc:
            self._leave(f"version {version}: {type(exc).__name__}: {exc}")
            return
        self._busy = (version, time.monotonic())

    def _settle(self) -> None:
        """The join or receive under way: once it has ended, what it brought (a group, a staged version)."""
        assert self._busy is not None
        what, t0 = self._busy
        try:
            if not self.engine.weight_work_done():  # type: ignore[attr-defined]
                return
        except Exception as exc:
            self._busy = None
            if isinstance(what, int):
                self._leave(f"version {what}: {type(exc).__name__}: {exc}")
                if isinstance(exc, NoRoom):
                    self._withdraw(str(exc))
            else:
                self._join_failed(what, f"{type(exc).__name__}: {exc}", t0)
            return
        self._busy = None
        if isinstance(what, int):
            self._receive_seconds = time.monotonic() - t0
            self.received = what
            self.received_total += 1
        else:
            self.watch = AnnouncementWatch.of(what.spec)
            self.epoch = what.spec.epoch
            log.info("joined weight group epoch %d as ranks from %d", self.epoch, what.rank_offset)

    def _withdraw(self, why: str) -> None:
        """Leave the weight group for good: a version does not fit beside this engine, and as a member it would
        fail every broadcast, for every engine in it. Versions come through the broker from now on."""
        self.withdrawn = why
        if self._seated:
            self.seat.stop()
            self._seated = False
        log.error(
            "this engine takes every version through the broker from now on, not the weight group: %s", why
        )

    def _join(self, seat: Seat) -> None:
        log.info("joining weight group epoch %d", seat.spec.epoch)
        self.watch, t0 = None, time.monotonic()
        try:
            self.engine.begin_join(seat.init_info())  # type: ignore[attr-defined]
        except Exception as exc:
            self._join_failed(seat, f"{type(exc).__name__}: {exc}", t0)
            return
        self._busy = (seat, t0)

    def _join_failed(self, seat: Seat, why: str, t0: float) -> None:
        self.watch = None
        self.error = (
            f"could not join weight group epoch {seat.spec.epoch} (tried for "
            f"{time.monotonic() - t0:.1f}s): {why}"
        )
        self.broadcast_failures += 1
        self.on_failure()
        log.warning("%s; weights come through the broker", self.error)
        self._quit_group(self.error)  # where some workers (or all) joined

    def _leave(self, why: str, failed: bool = True, tell: bool = True) -> None:
        self.watch = None
        if failed:
            self.broadcast_failures += 1
            self.on_failure()
            self.error = f"weight group epoch {self.epoch} failed: {why}"
            log.warning("%s; weights come through the broker until a new group forms", self.error)
        else:
            log.info("leaving weight group: %s", why)
        # the workers' groups too: a failure outside the group's collectives (a worker's own) left them open,
        # and rank 0 would wait for them in its next broadcast until the group's timeout; a superseded epoch's
        # group is let go of rather than held until the next join
        self._quit_group(self.error if failed and tell else None)
        self.epoch = 0
        self.poll_now()  # what the group would have carried may be on the broker already

    def _quit_group(self, why: str | None) -> None:
        leave = getattr(self.engine, "leave_weight_group", None)
        if leave is not None:
            leave(why)

    def ready(self) -> int | None:
        staged = getattr(self.engine, "collective_staged", None)
        fetched = super().ready()
        loaded = self.engine.loaded_version
        if (
            staged is not None
            and (loaded is None or staged > loaded)
            and (fetched is None or staged >= fetched)
        ):
            return int(staged)
        return fetched

    def prepare(self, version: int) -> None:
        if getattr(self.engine, "collective_staged", None) != version:  # the broker's copy is applied
            super().prepare(version)

    def apply(self, version: int) -> float:
        if getattr(self.engine, "collective_staged", None) != version:
            seconds = super().apply(version)
            self._seat()  # caught up: a member from now on
            return seconds
        try:
            seconds = float(self.engine.apply_collective(version))  # type: ignore[attr-defined]
        except Exception as exc:
            # the broker's copy is wanted again, though the fetch thread passed over it when the group had
            # delivered it (a refusal is otherwise final): the sampler would admit nothing until a newer one
            self.received, self.declined = None, None
            self.error = f"version {version} could not be loaded: {type(exc).__name__}: {exc}"
            try:  # under NCCL the broker holds only what the group did not carry: the learner gives it this
                self.seat.renew()
            except Exception as renew_exc:
                log.warning("could not register again after a failed load: %s", renew_exc)
            self.poll_now()
            raise
        self.error, self.last_path = "", "collective"
        log.info(
            "serving version %d (broadcast in %.2fs, loaded in %.2fs)",
            version,
            self._receive_seconds,
            seconds,
        )
        return seconds

    @property
    def fetch_seconds(self) -> float:
        return (
            self._receive_seconds
            if self.received is not None and self.received == self.engine.loaded_version
            else self._fetch_seconds
        )
