"""Weight sync for a sampler: fetch newer versions in the background, apply them at the loop's safe points.

    fetch thread:  WeightFollower.poll ─► transport.fetch(engine.stage(v))    tensors staged on the host
                                          complete and verified ─► ready(v)
    sampler loop:  ready() ─► prepare(v)                                      the engine still generating
                             ─► engine.apply(v) between two engine steps    the whole version at once

Generation keeps running while a version downloads and while ``prepare`` writes what the engine's workers
read it from (engines whose workers are other processes); only ``apply`` (the load itself) stops it. A
fetch that fails or is cut off leaves nothing applied: the engine keeps serving its version and the
follower records why, for the sampler's waiting reason.
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
    MemberSeat,
    NoRoom,
    Seat,
    Sink,
    TransferFailed,
    WeightFollower,
    WeightTransport,
)
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
        self.last_path = "broker"  # how the version last applied arrived
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
        return self.loader.fetch_seconds

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
            "serving version %d (fetched in %.2fs, loaded in %.2fs)",
            version,
            self.loader.fetch_seconds,
            seconds,
        )
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
            self.received, self.follower.declined = None, None
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
            else self.loader.fetch_seconds
        )
