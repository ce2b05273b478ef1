"""The weight group: one process group joining the learner's publishing rank and every receiving worker.

    GroupSpec (host, port, world_size, backend, epoch)  the same spec, from the control plane, to every member
    WeightGroup(spec, rank)     rank 0 hosts the epoch's TCP store; every rank counts itself in and waits, up
                                to ``form_timeout_s``, for all the others, then joins the process group
    announce(v) / next_announcement()   rank 0 sets ``announce/<n>`` = v in the store; receivers poll for it
    wait(work)                  a collective, given up as soon as any rank marks the store ``failed``

The group lives outside torch.distributed's default group (which ZeRO-3 or vLLM's tensor parallelism may own):
NCCL on GPU, gloo on CPU, the same code. An NCCL epoch whose ranks would share a GPU (which NCCL refuses)
runs on gloo instead, on every rank alike. Members wait for announcements in the store, never inside a
collective, so an idle group never reaches its timeout. Any failure is a :class:`TransferFailed`, raised to
the caller on every backend (an NCCL failure never takes the process down): the group is closed on every
member and the control plane (``group_control.py``) forms a new epoch. What travels over the group, and how,
is ``collective.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from services.weight_transport.group_store import FAILED, give_up
from services.weight_transport.group_store import AnnouncementWatch as AnnouncementWatch
from services.weight_transport.group_store import GroupSpec as GroupSpec
from services.weight_transport.group_store import TransferFailed as TransferFailed
from services.weight_transport.group_store import arrive as arrive
from services.weight_transport.group_store import first_line as first_line
from services.weight_transport.group_store import open_store as open_store
from services.weight_transport.members import device_identity, shared_gpus
from services.weight_transport.nccl_group import connect, nccl_backend
from services.weight_transport.nccl_group import failure as nccl_failure
from services.weight_transport.retired import retire

# how long closing the group waits for a collective another thread is issuing (NCCL forbids aborting a
# communicator while a thread enqueues onto it); an enqueue returns at once, so only a stuck one is left
ISSUE_WAIT_S = 10.0

log = logging.getLogger(__name__)


class WeightGroup:
    """This process's membership of the weight group: a process group outside torch.distributed's default
    one (which ZeRO-3 or vLLM's tensor parallelism may own), formed over its own TCP store."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        device: torch.device | None = None,
        store: Any = None,
    ) -> None:
        """Join as ``rank``: rank 0 hosts the store (or passes ``store``, a master it opened already, to learn a
        free port before announcing the spec). Every rank first waits, up to ``form_timeout_s``, until all
        ``world_size`` have arrived (:class:`TransferFailed` otherwise), so a member that never comes costs the
        others that long, not the collective timeout."""
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside the weight group of {spec.world_size}")
        import torch.distributed as dist

        self.spec, self.rank = spec, rank
        self._works: list[Any] = []  # collectives issued that may be pending
        self._issuing = threading.Lock()  # held while a collective is enqueued, and while the group is closed
        # where this member's buffers live: NCCL moves CUDA tensors only; gloo moves CPU tensors
        if spec.backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = device or torch.device("cpu")
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            self._store = store if store is not None else open_store(spec, master=rank == 0)
            prefixed = dist.PrefixStore(spec.prefix(), self._store)
            if spec.backend == "nccl":  # before arriving: every rank's is there once all have arrived
                prefixed.set(f"gpu/{rank}", device_identity(self.device))
            arrived = arrive(prefixed, "ranks_arrived", spec.world_size, spec.form_timeout_s)
        except Exception as exc:
            raise TransferFailed(
                f"weight group epoch {spec.epoch} at {spec.host}:{spec.port}: {exc}"
            ) from exc
        if arrived < spec.world_size:
            why = (
                f"weight group epoch {spec.epoch}: {arrived} of {spec.world_size} ranks arrived "
                f"within {spec.form_timeout_s:.0f}s"
            )
            give_up(prefixed, why)  # a rank arriving later fails at once
            raise TransferFailed(why)
        self.watch = AnnouncementWatch(prefixed, self.close)  # receivers: what rank 0 announces
        self._announcements = prefixed  # rank 0 sets announce/<n>
        self._seq = 0  # announcements made (rank 0)
        # rank 0: the control plane's word on the members (None: all alive; else why not), asked every
        # alive_every_s while a collective is pending (group_control.py sets it)
        self.members_gone: Callable[[], str | None] | None = None
        self.alive_every_s = 1.0
        self.backend = spec.backend  # what this epoch runs on: gloo when NCCL ranks would share a GPU
        self.broadcasts = 0  # versions whose broadcast started on this rank (every rank counts alike)
        # this member's GPU under NCCL, kept where the epoch falls back to gloo (its work's CUDA stream)
        self.gpu = self.device if spec.backend == "nccl" else None
        if spec.backend == "nccl":
            try:
                shared = shared_gpus(prefixed, spec.world_size)
            except Exception as exc:
                raise TransferFailed(f"weight group epoch {spec.epoch}: {exc}") from exc
            if shared:
                # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), as when a
                # learner and a sampler share a GPU (fractional gpus_per_rank/gpus_per_replica): every rank
                # read the same identities, so every rank falls back to gloo (through host memory and
                # sockets) alike
                self.backend, self.device = "gloo", torch.device("cpu")
                if rank == 0:
                    log.warning(
                        "weight group epoch %d runs on gloo, not NCCL: ranks %s share a GPU (versions go "
                        "through host memory and sockets)",
                        spec.epoch,
                        "; ".join(", ".join(map(str, ranks)) for ranks in shared),
                    )
        if self.backend == "nccl":
            self._pg: Any = nccl_backend(prefixed, rank, spec.world_size, timeout)
            self._connect()
        else:
            # connecting (every rank's address through the store) is bounded by the forming timeout, as the
            # arrival is: a member that arrived and then died would otherwise hold every other rank here for
            # the whole collective timeout
            try:
                self._pg = dist.ProcessGroupGloo(
                    prefixed,
                    rank,
                    spec.world_size,
                    timedelta(seconds=min(spec.form_timeout_s, spec.timeout_s)),
                )
            except Exception as exc:
                raise TransferFailed(
                    f"weight group epoch {spec.epoch}: the ranks did not connect within "
                    f"{spec.form_timeout_s:.0f}s: {exc}"
                ) from exc
            self._pg.set_timeout(timeout)
        self._closed = False

    def _connect(self) -> None:
        """NCCL builds its communicator at the first collective: one all-reduce now, so the first version's
        broadcast does not pay for it, and a rank that cannot connect (a wrong ``NCCL_SOCKET_IFNAME``, a
        firewall, a rank that died after arriving) fails the forming within ``form_timeout_s``, not the first
        broadcast after the group's timeout (the control plane then leaves the member out for a while)."""
        try:
            connect(self._pg, self.device, min(self.spec.form_timeout_s, self.spec.timeout_s))
        except Exception as exc:
            self._pg = retire(self._pg, self.spec.epoch)
            raise TransferFailed(
                f"weight group epoch {self.spec.epoch}: NCCL did not connect: {exc}"
            ) from exc

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (in place on the others); returns the work to wait on."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._issue(lambda: self._pg.broadcast([tensor], opts))

    def _issue(self, start: Callable[[], Any]) -> Any:
        """Start a collective; one the group refuses (torch raises for an NCCL communicator it has aborted)
        fails this rank's part, marked for the others, as a failed wait does."""
        error: Exception | None = None
        with self._issuing:  # not while another thread aborts the communicator (``close``)
            try:
                work = start()
                # those that may be pending: a closed group is destroyed once they have ended (retired.py)
                self._works = [w for w in self._works if not w.is_completed()] + [work]
            except Exception as exc:
                error = exc
        if error is not None:
            raise self.part_failed(first_line(error)) from error
        return work

    def part_failed(self, why: str) -> TransferFailed:
        """This rank's part of a collective failed: marked for the other ranks, the group closed; returns the
        error to raise."""
        why = f"rank {self.rank}'s part failed: {why}"
        self._mark_failed(why)
        self.close()
        return TransferFailed(why)

    def announce(self, version: int) -> None:
        """Rank 0, before each broadcast: tell every member a version is coming (:meth:`next_announcement`).
        Members wait for this, not inside a collective, so an idle group never reaches its timeout."""
        self._seq += 1
        self._announcements.set(f"announce/{self._seq}", str(version))

    def ready(self, seq: int, stage: str = "") -> None:
        """A receiver, in its receive: ready for broadcast ``seq`` (1, 2, ... in this group); ``stage``: for its
        part after the header ("data": its buffers made). Under CUDA, once what this thread queued on its GPU
        has run: its collectives start only after that (an engine's forward still running would otherwise hold
        rank 0's kernel, which rank 0 issues on this word, and every device-wide synchronize of its step). A
        worker receives on a stream of its own (``receiver.Background``): its engine's forward is not waited for."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._announcements.add(f"ready/{seq}/{stage}", 1)

    def wait_ready(self, seq: int, stage: str = "", poll_s: float = 0.002) -> None:
        """Rank 0, after announcing broadcast ``seq``: wait until every receiver is ready for it, in the store,
        before any of its collectives is issued. Under NCCL a collective waiting for a late receiver (an
        engine's loop in a long step) is a kernel on this rank's GPU, and every device-wide synchronize of the
        training step (DeepSpeed's gathers call them) waited for it: for a receiver stuck with its heartbeat
        alive, until the group's timeout. Gives up (:class:`TransferFailed`, the group closed) as :meth:`wait`
        does: a rank marked the collective failed, a member is gone, or the group's timeout passed."""
        expected = self.spec.world_size - 1
        deadline = asked = time.monotonic()
        deadline += self.spec.timeout_s
        with self._closed_on_failure():
            while (arrived := int(self._announcements.add(f"ready/{seq}/{stage}", 0))) < expected:
                now = time.monotonic()
                why = self._failure()
                if why is None and self.members_gone is not None and now - asked >= self.alive_every_s:
                    asked, why = now, self.members_gone()
                if why is None and now > deadline:
                    why = f"{arrived} of {expected} receivers were ready within {self.spec.timeout_s:.0f}s"
                if why:
                    self._mark_failed(why)  # the receivers waiting name the cause, not rank 0's abort
                    raise TransferFailed(why)
                time.sleep(poll_s)
                poll_s = min(poll_s * 2, 0.02)

    def next_announcement(self, timeout_s: float, poll_s: float = 0.02) -> int | None:
        """A receiver: the version of the next broadcast, once rank 0 announces it (then call ``receive``);
        None after ``timeout_s`` without one. Raises :class:`TransferFailed` (closing the group) if the
        store is gone with its host, the publisher."""
        return self.watch.next(timeout_s, poll_s)

    @contextlib.contextmanager
    def _closed_on_failure(self) -> Iterator[None]:
        """Waits in the store: a failure closes the group, raised as a :class:`TransferFailed`."""
        try:
            yield
        except TransferFailed:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise TransferFailed(f"the weight group's store is unreachable: {exc}") from exc

    def _failure(self) -> str | None:
        """Why a rank marked the collective failed in the store (None: none did); the store's failure too."""
        try:
            if not self._announcements.check([FAILED]):
                return None
            why = self._announcements.get(FAILED).decode(errors="replace")
        except Exception as exc:
            return f"the weight group's store is unreachable: {exc}"
        return why if why and why != "1" else "rank 0 declared the broadcast failed"

    def commit(self) -> None:
        """The vote: an all-reduce each rank enters once it holds the whole version. It completes on every
        rank only if every rank reached it; a rank whose part failed marked the group failed instead, and
        every other rank's wait here raises :class:`TransferFailed`."""
        import torch.distributed as dist

        t = torch.ones(1, dtype=torch.int64, device=self.device)
        self.wait(self._issue(lambda: self._pg.allreduce([t], dist.AllreduceOptions())))

    def wait(self, work: Any, check_every_s: float = 0.05) -> None:
        """Wait for a collective of this group, giving up (:class:`TransferFailed`, the group closed) as soon
        as another rank has declared it failed in the store: rank 0 after a failed broadcast, or a receiver
        whose own part failed (a peer died). Without it a rank waiting for bytes that will never come waits
        out the whole timeout, since neither a closed gloo group nor a dead peer wakes every rank: a chaos run
        saw rank 0 wait 120 s in a commit vote whose failure a receiver had seen at once. A rank whose
        collective fails marks it so, and raises the first mark (the cause, where another rank's failure broke
        this one's links)."""
        nap, last = 5e-5, time.monotonic()
        asked = last
        while not self._completed(work, nap, check_every_s):
            nap = min(nap * 2, 1e-3)
            if time.monotonic() - last < check_every_s:
                continue
            last = time.monotonic()
            why = self._failure()
            if why is None and self.backend == "nccl":  # the watchdog times a collective out before it ends
                broke = nccl_failure(self._pg, work)
                if broke:
                    raise self.part_failed(broke)
            if why is None and self.members_gone is not None and last - asked >= self.alive_every_s:
                # a member that hung, or died without its connections closing (NCCL between the GPUs of one
                # node notices neither), would hold every rank here until the timeout
                asked = last
                why = self.members_gone()
                if why:
                    self._mark_failed(why)
            if why:
                self.close()
                raise TransferFailed(why)
        try:
            # raises the collective's own error, if it had one: gloo's does, given a timeout, and NCCL's for an
            # error found by this thread's is_completed. A timeout (the watchdog's) NCCL's wait does not raise:
            # it returns as if the broadcast's bytes had arrived, so its result is read below. The collective
            # has completed here, so nothing waits.
            work.wait(timedelta(seconds=self.spec.timeout_s))
        except Exception as exc:  # the first rank's mark names the cause (a peer's closed link is its effect)
            self._mark_failed(f"rank {self.rank}'s part failed: {first_line(exc)}")
            raise TransferFailed(self._failure() or first_line(exc)) from exc
        why = nccl_failure(self._pg, work) if self.backend == "nccl" else None
        if why:  # NCCL raises nothing for a group built to survive its failures (nccl_group.failure)
            raise self.part_failed(why)
        if self._closed:  # by another thread meanwhile: its abort ended the collective, which reads as done
            raise TransferFailed(f"rank {self.rank}'s weight group was closed during the collective")

    def _completed(self, work: Any, nap: float, check_every_s: float) -> bool:
        """Whether ``work`` has completed, after waiting for it a while. Gloo's blocks in its own wait, woken as
        it completes, for up to ``check_every_s``; its timeout raises and leaves the collective going. (Polling
        it instead, a thread waking every millisecond or sooner, took a third off a loopback broadcast's rate
        with every core copying bytes: 0.27 s for 1 GiB against 0.20 s.) NCCL's wait only orders the current
        stream after the collective, or given a timeout spins on the host until it ends, checking nothing: it
        is polled every ``nap`` seconds."""
        if work.is_completed():
            return True
        if self.backend == "nccl":
            time.sleep(nap)
        else:
            with contextlib.suppress(Exception):  # not completed yet, or failed (raised again by the caller)
                # at least a millisecond: torch reads a wait of 0 ms as one without a timeout
                work.wait(timedelta(seconds=max(check_every_s, 1e-3)))
        return bool(work.is_completed())

    def _mark_failed(self, why: str) -> None:
        """Tell every rank still waiting in this group's collective to give up (the first mark stays)."""
        give_up(self._announcements, why)

    def abort(self) -> None:
        """Rank 0, after a failed broadcast: tell every receiver still waiting in it to give up, then close."""
        self._mark_failed("rank 0 declared the broadcast failed")
        self.close()

    @property
    def closed(self) -> bool:
        """Closed after a failed collective (or by ``close``): the control plane must form a new group."""
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # a communicator may not be aborted while another thread enqueues onto it (NCCL's thread safety: the
        # background broadcast issues collectives while the learner's thread may abort an overdue one)
        issuing = self._issuing.acquire(timeout=ISSUE_WAIT_S)
        if not issuing:
            log.warning("closing the weight group while a collective was being issued for %gs", ISSUE_WAIT_S)
        try:
            self._shut()
        finally:
            if issuing:
                self._issuing.release()

    def _shut(self) -> None:
        try:
            if self.backend == "nccl":
                # abort (ncclCommAbort), not shutdown: a communicator's destroy waits for its kernels, and a
                # kernel waiting for a dead or departed peer never finishes
                self._pg.abort()
            else:
                self._pg.shutdown()
        except Exception:  # a broken group may refuse a clean shutdown; it is dropped anyway
            log.debug("weight group shutdown raised", exc_info=True)
        # Never destroy a closed group here: ~ProcessGroupGloo joins its worker threads, which may still wait on
        # a peer that died, and whichever thread dropped the group last would run that destructor (a chaos run
        # saw a receiving thread stuck 75 s in it). The reaper thread destroys it (retired.py).
        self._pg, self._works = retire(self._pg, self.spec.epoch, self._works), []
