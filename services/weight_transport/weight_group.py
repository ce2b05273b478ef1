"""The weight group: a process group of the learner's publishing rank and every receiving worker, outside
torch.distributed's default one (which ZeRO-3 or vLLM's tensor parallelism may own). Design:
docs/design/weight-transport.md, "The weight group"; what travels over it: ``collective.py``.

Not torch.distributed's own rendezvous and waits: those wait the whole timeout for a rank that died, and a
failed NCCL collective ends the process. Here every rank counts itself in at the epoch's TCP store on rank 0,
waiting at most ``form_timeout_s``; any rank that gives up marks the store ``failed``, every other rank's wait
ends at once, and any failure is a :class:`TransferFailed`: the group closes on every member and the control
plane (``group_control.py``) forms a new epoch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.weight_transport.nccl_group import connect, nccl_backend
from services.weight_transport.nccl_group import failure as nccl_failure
from services.weight_transport.retired import retire

# how long closing the group waits for a collective another thread is issuing (NCCL forbids aborting a
# communicator while a thread enqueues onto it); an enqueue returns at once, so only a stuck one is left
ISSUE_WAIT_S = 10.0
FAILED = "failed"  # an epoch's key: why a rank gave it up (while forming, or a broadcast that failed)

log = logging.getLogger(__name__)


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


class TransferFailed(RuntimeError):
    """A version did not reach every member of the group; no member applied it. The group must be re-formed."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the weight group meets, the same for every member. ``world_size`` counts the publisher
    and every receiving worker; ``epoch`` names this forming of the group (its keys in the store)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"  # "gloo" | "nccl"
    epoch: int = 0
    timeout_s: float = 120.0
    form_timeout_s: float = 30.0  # how long every rank waits for all the others to arrive at the rendezvous

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(
                f"a weight group needs the publisher and at least one receiver, got {self.world_size}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"weight group port must be in 1..65535, got {self.port}")
        if self.timeout_s <= 0 or self.form_timeout_s <= 0:
            raise ValueError(
                f"weight group timeouts must be > 0, got timeout_s={self.timeout_s}, "
                f"form_timeout_s={self.form_timeout_s}"
            )

    def prefix(self) -> str:
        """The key prefix of this epoch's rendezvous and announcements in the group's store."""
        return f"vcpo-weights/{self.epoch}"


def open_store(spec: GroupSpec, master: bool = False, port: int | None = None) -> Any:
    """A TCP store client of ``spec``'s rendezvous (or, ``master``, the store itself, listening on ``port``:
    0 binds a free one, read back from ``.port``)."""
    return dist.TCPStore(
        spec.host,
        spec.port if port is None else port,
        spec.world_size,
        is_master=master,
        timeout=timedelta(seconds=spec.form_timeout_s),
        wait_for_workers=False,
    )


def arrive(store: Any, key: str, expected: int, timeout_s: float, poll_s: float = 0.02) -> int:
    """Count this process in at ``key`` of ``store`` and wait until ``expected`` have arrived; returns how many
    had arrived (fewer than ``expected`` after ``timeout_s``). Raises :class:`TransferFailed` once a rank gave
    the epoch up (:func:`give_up`): a member arriving after rank 0 stopped waiting for it would otherwise wait
    out the whole timeout, its engine's loop standing still, for an epoch that can no longer form."""
    arrived = int(store.add(key, 1))
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([FAILED]):  # also for the last to arrive: those before it may have given up
            raise TransferFailed(f"the epoch was given up ({store.get(FAILED).decode(errors='replace')})")
        if arrived >= expected or time.monotonic() >= deadline:
            return arrived
        time.sleep(poll_s)
        arrived = int(store.add(key, 0))


def give_up(store: Any, why: str) -> None:
    """Mark the epoch of ``store`` failed (the first mark stays): every rank still arriving at it, or waiting in
    one of its collectives, stops waiting."""
    try:
        store.compare_set(FAILED, "", why)
    except Exception:  # the store gone too: nothing waits in it then
        log.debug("could not mark the epoch failed", exc_info=True)


class AnnouncementWatch:
    """A receiver's view of rank 0's announcements (``announce/<n>`` = version, in order) in one epoch's
    store: the weight group's own, or a client of the store held by a process that is not a rank itself (a
    sampler's driver, whose engine workers are the ranks)."""

    def __init__(self, store: Any, closed: Callable[[], None] | None = None) -> None:
        self._store = store
        self._on_failure = closed  # called once the store is gone (e.g. to close the group)
        self.seq = 0  # announcements taken

    @classmethod
    def of(cls, spec: GroupSpec) -> AnnouncementWatch:
        try:
            return cls(dist.PrefixStore(spec.prefix(), open_store(spec)))
        except Exception as exc:
            raise TransferFailed(
                f"the weight group's store at {spec.host}:{spec.port} is unreachable: {exc}"
            ) from exc

    def next(self, timeout_s: float, poll_s: float = 0.02) -> int | None:
        """The version of the next broadcast once rank 0 announced it (then receive it); None after
        ``timeout_s`` (0: look once) without one. Raises :class:`TransferFailed` if the store is gone with its
        host, the publisher."""
        key = f"announce/{self.seq + 1}"
        deadline = time.monotonic() + timeout_s
        try:
            while not self._store.check([key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(poll_s)
            version = int(self._store.get(key))
        except Exception as exc:
            if self._on_failure is not None:
                self._on_failure()
            raise TransferFailed(f"the weight group's store is unreachable: {exc}") from exc
        self.seq += 1
        return version


def device_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES
    numbers it as)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class WeightGroup:
    """This process's membership of the weight group, formed over its own TCP store."""

    def __init__(
        self, spec: GroupSpec, rank: int, device: torch.device | None = None, store: Any = None
    ) -> None:
        """Join as ``rank``: rank 0 hosts the store (or passes ``store``, a master it opened already, to learn a
        free port before announcing the spec). :class:`TransferFailed` unless all ranks arrive and connect."""
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside the weight group of {spec.world_size}")
        self.spec, self.rank, self.backend = spec, rank, spec.backend
        self._works: list[Any] = []  # collectives issued that may be pending
        self._issuing = threading.Lock()  # held while a collective is enqueued, and while the group is closed
        self._closed = False
        self._seq = 0  # announcements made (rank 0)
        self.broadcasts = 0  # versions whose broadcast started on this rank (every rank counts alike)
        # rank 0: the control plane's word on the members (None: all alive; else why not), asked every
        # alive_every_s while a collective is pending (group_control.py sets it)
        self.members_gone: Callable[[], str | None] | None = None
        self.alive_every_s = 1.0
        nccl = spec.backend == "nccl"  # NCCL moves CUDA tensors only; gloo moves CPU tensors
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device
        self.gpu = self.device if nccl else None  # kept where the epoch falls back to gloo (its stream's)
        try:
            self._store = store if store is not None else open_store(spec, master=rank == 0)
            # the epoch's keys: arrivals, GPUs, announcements, readiness, the failed mark
            self._announcements = kv = dist.PrefixStore(spec.prefix(), self._store)
            if nccl:  # before arriving: every rank's is there once all have arrived
                kv.set(f"gpu/{rank}", device_identity(self.device))
            arrived = arrive(kv, "ranks_arrived", spec.world_size, spec.form_timeout_s)
        except Exception as exc:
            raise TransferFailed(
                f"weight group epoch {spec.epoch} at {spec.host}:{spec.port}: {exc}"
            ) from exc
        if arrived < spec.world_size:
            why = (
                f"weight group epoch {spec.epoch}: {arrived} of {spec.world_size} ranks arrived "
                f"within {spec.form_timeout_s:.0f}s"
            )
            give_up(kv, why)  # a rank arriving later fails at once
            raise TransferFailed(why)
        self.watch = AnnouncementWatch(kv, self.close)  # receivers: what rank 0 announces
        if nccl:
            try:
                by_gpu: dict[str, list[int]] = {}
                for r in range(spec.world_size):
                    by_gpu.setdefault(kv.get(f"gpu/{r}").decode(), []).append(r)
            except Exception as exc:
                raise TransferFailed(f"weight group epoch {spec.epoch}: {exc}") from exc
            shared = [ranks for ranks in by_gpu.values() if len(ranks) > 1]
            if shared:
                # NCCL refuses two ranks of one communicator on one GPU (a learner and a sampler sharing one:
                # fractional gpus_per_rank/gpus_per_replica); every rank read the same identities alike
                self.backend, self.device = "gloo", torch.device("cpu")
                if rank == 0:
                    log.warning(
                        "weight group epoch %d runs on gloo, not NCCL: ranks %s share a GPU (versions go "
                        "through host memory and sockets)",
                        spec.epoch,
                        "; ".join(", ".join(map(str, ranks)) for ranks in shared),
                    )
        # connecting is bounded by the forming timeout, as the arrival is: a member that arrived and then died
        # (or a wrong NCCL_SOCKET_IFNAME) fails the forming, not the first broadcast after the group's timeout
        limit = timedelta(seconds=min(spec.form_timeout_s, spec.timeout_s))
        timeout = timedelta(seconds=spec.timeout_s)
        if self.backend == "nccl":
            self._pg: Any = nccl_backend(kv, rank, spec.world_size, timeout)
            try:  # NCCL makes its communicator at the first collectives: now, not in the first version's
                connect(self._pg, self.device, limit.total_seconds())
            except Exception as exc:
                self._pg = retire(self._pg, spec.epoch)
                raise TransferFailed(f"weight group epoch {spec.epoch}: NCCL did not connect: {exc}") from exc
        else:
            try:
                self._pg = dist.ProcessGroupGloo(kv, rank, spec.world_size, limit)
            except Exception as exc:
                raise TransferFailed(
                    f"weight group epoch {spec.epoch}: the ranks did not connect within "
                    f"{spec.form_timeout_s:.0f}s: {exc}"
                ) from exc
            self._pg.set_timeout(timeout)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (in place on the others); returns the work to wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._issue(lambda: self._pg.broadcast([tensor], opts))

    def _issue(self, start: Callable[[], Any]) -> Any:
        """Start a collective; one the group refuses (an NCCL communicator torch aborted) fails this rank's part."""
        with self._issuing:  # not while another thread aborts the communicator (``close``)
            try:
                work = start()
                # those that may be pending: a closed group is destroyed once they have ended (retired.py)
                self._works = [w for w in self._works if not w.is_completed()] + [work]
                return work
            except Exception as exc:
                error = exc
        raise self.part_failed(first_line(error)) from error

    def part_failed(self, why: str) -> TransferFailed:
        """This rank's part failed: marked for the other ranks, the group closed; returns the error to raise."""
        why = f"rank {self.rank}'s part failed: {why}"
        self._mark_failed(why)
        self.close()
        return TransferFailed(why)

    def announce(self, version: int) -> None:
        """Rank 0, before each broadcast: a version is coming (receivers wait for this in ``watch.next``)."""
        self._seq += 1
        self._announcements.set(f"announce/{self._seq}", str(version))

    def next_announcement(self, timeout_s: float, poll_s: float = 0.02) -> int | None:
        return self.watch.next(timeout_s, poll_s)

    def ready(self, seq: int, stage: str = "") -> None:
        """A receiver: ready for broadcast ``seq`` (1, 2, ... in this group; ``stage`` "data": its buffers made),
        once what this thread queued on its GPU has run (it receives on a stream of its own, so no forward)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._announcements.add(f"ready/{seq}/{stage}", 1)

    def wait_ready(self, seq: int, stage: str = "", poll_s: float = 0.002) -> None:
        """Rank 0: wait in the store until every receiver is :meth:`ready` for broadcast ``seq``, before issuing
        any of its collectives: under NCCL a collective waiting for a late receiver is a kernel that every
        device-wide synchronize of the training step would wait for. Gives up as :meth:`wait` does."""
        expected = self.spec.world_size - 1
        deadline = asked = time.monotonic()
        deadline += self.spec.timeout_s
        try:
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
        """The vote: an all-reduce each rank enters once it holds the whole version; it completes on every rank
        only if every rank reached it (a rank whose part failed marked the group failed instead)."""
        t = torch.ones(1, dtype=torch.int64, device=self.device)
        self.wait(self._issue(lambda: self._pg.allreduce([t], dist.AllreduceOptions())))

    def wait(self, work: Any, check_every_s: float = 0.05) -> None:
        """Wait for a collective of this group, giving up (:class:`TransferFailed`, the group closed) as soon
        as any rank marked it failed in the store: neither a closed gloo group nor a dead peer wakes every
        rank. A rank whose collective fails marks it so, and raises the first mark (the cause, where another
        rank's failure broke this one's links)."""
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
            # completed: raises its own error, if it had one (not NCCL's watchdog timeout: its result, below)
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
        """Whether ``work`` has completed, after waiting for it a while: gloo's in its own wait, woken as it
        completes (polling it took a third off a loopback broadcast's rate); NCCL's wait only orders the current
        stream after it, or spins on the host checking nothing, so it is polled every ``nap`` seconds."""
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
        # NCCL forbids aborting a communicator while another thread (a background broadcast) enqueues onto it
        issuing = self._issuing.acquire(timeout=ISSUE_WAIT_S)
        if not issuing:
            log.warning("closing the weight group while a collective was being issued for %gs", ISSUE_WAIT_S)
        try:
            # abort (ncclCommAbort), not shutdown: a communicator's destroy waits for its kernels, and a kernel
            # waiting for a dead or departed peer never finishes
            self._pg.abort() if self.backend == "nccl" else self._pg.shutdown()
        except Exception:  # a broken group may refuse a clean shutdown; it is dropped anyway
            log.debug("weight group shutdown raised", exc_info=True)
        finally:
            # never destroyed here: ~ProcessGroupGloo joins its worker threads, which may still wait on a dead
            # peer, on whichever thread dropped the group last; the reaper thread destroys it (retired.py)
            self._pg, self._works = retire(self._pg, self.spec.epoch, self._works), []
            if issuing:
                self._issuing.release()
