"""The collective transport's control plane: who is in the weight group, and when it is formed again. torch has
no group whose members come and go: this plane re-forms a fixed-size one (an epoch) as they do. Design:
docs/design/weight-transport.md, "In a run".

    receivers (each sampler engine)                      Redis (the run's)                learner rank 0
    MemberSeat ── heartbeat every ttl/3 ─────────► vcpo:<run>:wg:member:<id> (expires)
                                                   vcpo:<run>:wg:members (set) ◄─── live(): who is there
                                                   vcpo:<run>:wg:epoch (counter)
    MemberSeat ◄── a spec naming this member ───── vcpo:<run>:wg:spec  ◄──────────── GroupCoordinator._form
         │ arrives at the epoch's rendezvous (the store on learner rank 0) with every other member
         └─► take(): the loop that owns the engine joins (WeightGroup), then receives what rank 0 announces

(The receivers' side, ``MemberSeat`` and the ``GroupRegistry`` of those keys, is ``seats.py``.)

A change of the live members forms a new epoch once they have stayed the same for ``settle_s`` (or kept
changing for ``settle_max_s``): samplers register one by one as their engines load version 0, and forming at
each registration would hold the engines already in the group in a join each time. Until then a group whose
members only grew goes on carrying versions (new members get theirs through the broker); one that lost a
member is left at once, since its broadcasts cannot reach every rank. Epochs come from a Redis counter, so a
restarted learner never reuses an epoch's keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import redis
import torch
import torch.distributed as dist

from services.common.ports import reachable_host
from services.weight_transport.buckets import DEFAULT_BUCKET_BYTES
from services.weight_transport.collective import BroadcastOverdue, CollectivePublisher, PinnedStaging
from services.weight_transport.seats import GroupRegistry, Member
from services.weight_transport.weight_group import (
    GroupSpec,
    TransferFailed,
    WeightGroup,
    arrive,
    give_up,
    open_store,
)

log = logging.getLogger(__name__)

EXCLUDE_MAX_S = 600.0  # the longest a member that keeps breaking epochs is left out at a time


class FormFailed(RuntimeError):
    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass
class _Formed:
    group: WeightGroup
    publisher: CollectivePublisher
    members: frozenset[str]


class GroupCoordinator:
    """Learner rank 0's side: forms the weight group in the background. Call :meth:`publisher` before each
    publish (between steps): None while there is no group (publish through the broker). Call :meth:`failed`
    when a broadcast failed."""

    def __init__(
        self,
        registry: GroupRegistry,
        host: str,
        backend: str = "gloo",
        port: int = 0,
        port_range: int = 8,
        timeout_s: float = 120.0,
        form_timeout_s: float = 30.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | None = None,
        on_event: Callable[[str], None] | None = None,
        wait_budget_s: float | None = None,
        settle_s: float = 0.0,
        settle_max_s: float = 30.0,
    ) -> None:
        """``settle_s``, ``settle_max_s``: see the module docstring. ``wait_budget_s``: how long rank 0 waits for
        a broadcast in flight (before the next version, or to leave its epoch) while the other learner ranks
        wait for it inside a collective, whose timeout would end them; one still in flight then is aborted and
        counted as failed (``CollectivePublisher.abort_overdue``). None: as long as it takes."""
        # checks the settings now; each epoch's spec is this one with its port, size and number
        self._template = GroupSpec(host, port or 1, 2, backend, 0, timeout_s, form_timeout_s)
        if not 0 <= settle_s <= settle_max_s:
            raise ValueError(
                f"weight group settle time {settle_s:g}s must be >= 0 and at most its bound {settle_max_s:g}s "
                "(weight_broker.group_settle_s, weight_broker.group_settle_max_s)"
            )
        self.registry, self.backend, self.device, self.timeout_s = registry, backend, device, timeout_s
        self.port, self.port_range, self.bucket_bytes = port, port_range, bucket_bytes
        self.settle_s, self.settle_max_s, self.wait_budget_s = settle_s, settle_max_s, wait_budget_s
        self.on_event = on_event or (lambda event: None)  # formed|form_failed|broadcast_failed
        # the registered members last seen and since when; since when they have differed from the group's
        self._seen: frozenset[str] | None = None
        self._seen_at = 0.0
        self._unsettled_since: float | None = None
        self.epoch = 0  # of the formed group (0: none yet)
        self._made = 0  # the last epoch number taken (formed or not)
        self.failures = 0  # broadcasts that failed (the learner republishes a version one lost)
        self.backoff_s = 1.0
        self._formed: _Formed | None = None
        self._forming: Future[_Formed] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-group-form")
        self._excluded: dict[str, float] = {}  # member -> monotonic time it may be named again
        # member -> epochs in a row it broke (left out twice as long each time); the last formed epoch's members
        self._strikes: dict[str, int] = {}
        self._last_formed: frozenset[str] = frozenset()
        self._next_attempt = 0.0
        self._closing = False
        self._store: Any = None  # the rendezvous store (TCPStore master), once bound
        # every epoch's publisher stages in it: a model-sized page-locked buffer takes tens of seconds to make
        self._staging: PinnedStaging | None = None

    @property
    def members(self) -> frozenset[str]:
        return self._formed.members if self._formed is not None else frozenset()

    def publisher(self, ready: bool = False) -> CollectivePublisher | None:
        """``ready``: with its broadcast in flight ended (within ``wait_budget_s``); None where it failed, or was
        still going then (aborted): counted, the epoch dropped, the caller's version goes through the broker."""
        self._reap()
        formed = self._formed
        # a background broadcast failed (a vote against it, or a collective that closed the group)
        failure = formed.publisher.failure() if formed is not None else None
        if formed is not None and (failure is not None or formed.group.closed):
            self.failed(failure or TransferFailed(f"epoch {self.epoch} closed after a failed broadcast"))
            formed = None
        if self._forming is None and time.monotonic() >= self._next_attempt:
            carried = self._carried(self.registry.live())
            live = self._eligible(carried)
            change = bool(live) and (formed is None or set(live) != formed.members)
            if not change:
                self._unsettled_since = None
            if formed is not None and not live:
                self._drop("no receiver is alive")
            elif change:
                gone = formed.members - set(live) if formed is not None else set()
                if gone:  # its broadcasts cannot reach every rank: no use waiting with it
                    self._drop(f"members left: {sorted(gone)}")
                if self._settled(frozenset(carried)):
                    if self._formed is not None:
                        self._drop(f"members joined: {sorted(set(live) - self._formed.members)}")
                    self._forming = self._pool.submit(self._form, live)
        publisher = self._formed.publisher if self._formed is not None else None
        if ready and publisher is not None:
            try:
                publisher.wait(self.wait_budget_s)
            except TransferFailed as exc:
                if isinstance(exc, BroadcastOverdue):  # aborted now: the drop does not wait a second budget
                    publisher.abort_overdue(exc, self.wait_budget_s)
                self.failed(exc)
                return None
        return publisher

    def failed(self, error: BaseException) -> None:
        """A broadcast failed: the group is dropped; the next :meth:`publisher` forms a new one."""
        log.warning("weight group epoch %d failed: %s", self.epoch, error)
        self.failures += 1
        self.on_event("broadcast_failed")
        self._drop("a broadcast failed", counted=True)
        # a member that died is still registered until its heartbeat expires: form again after that, or the
        # next epoch would wait form_timeout_s for it
        self._next_attempt = max(self._next_attempt, time.monotonic() + self.registry.ttl_s)

    def wait_formed(self, timeout_s: float) -> bool:
        """Tests and benchmarks: form a group now if there is a member, and wait until it is formed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.publisher() is not None:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Wait for the last broadcast and leave the group."""
        self._closing = True
        self._drop("the learner stops")
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._staging is not None:
            self._staging.release()

    def receivers(self) -> frozenset[str]:
        """The live members the group carries versions to once they are in it (under NCCL those with a GPU)."""
        return frozenset(self._carried(self.registry.live()))

    def _carried(self, live: dict[str, Member]) -> dict[str, Member]:
        return {i: m for i, m in live.items() if self.backend != "nccl" or m.devices == "cuda"}

    def _settled(self, registered: frozenset[str]) -> bool:
        """Whether the registered members (left-out ones included: their exclusion ending is no change) have
        been ``registered`` for ``settle_s``, or have differed from the group's for ``settle_max_s``. Called
        while they differ from the group's."""
        now = time.monotonic()
        if registered != self._seen:
            self._seen, self._seen_at = registered, now
        if self._unsettled_since is None:
            self._unsettled_since = now
        if now - self._seen_at >= self.settle_s or now - self._unsettled_since >= self.settle_max_s:
            self._unsettled_since = None
            return True
        return False

    def _eligible(self, carried: dict[str, Member] | None = None) -> dict[str, Any]:
        now = time.monotonic()
        live = self._carried(self.registry.live()) if carried is None else carried
        # dead ids are not kept; one absent only for a moment (Redis restarted: its set is back at the next
        # heartbeats) keeps its record until its exclusion has run out
        for gone in [i for i, until in self._excluded.items() if i not in live and until <= now]:
            self._strikes.pop(gone, None)
            self._excluded.pop(gone, None)
        return {i: m for i, m in live.items() if self._excluded.get(i, 0.0) <= now}

    def _drop(self, why: str, counted: bool = False) -> None:
        """Leave the formed epoch; ``counted``: its failure was counted already (:meth:`failed`)."""
        formed, self._formed = self._formed, None
        if formed is None:
            return
        log.info("leaving weight group epoch %d: %s", self.epoch, why)
        # waits for a broadcast in flight: one that fails meanwhile is counted, for the learner to republish it
        if formed.publisher.close(self.wait_budget_s) is not None and not counted:
            self.failures += 1
            self.on_event("broadcast_failed")
        formed.group.close()

    def _reap(self) -> None:
        forming = self._forming
        if forming is None or not forming.done():
            return
        self._forming = None
        try:
            formed = forming.result()
        except Exception as exc:
            for member in exc.missing if isinstance(exc, FormFailed) else []:
                self._strikes[member] = strikes = self._strikes.get(member, 0) + 1
                left_out = min(3 * self.registry.ttl_s * 2 ** min(strikes - 1, 16), EXCLUDE_MAX_S)
                self._excluded[member] = time.monotonic() + left_out
            self.on_event("form_failed")
            wait_s, self.backoff_s = self.backoff_s, min(self.backoff_s * 2, 30.0)
            self._next_attempt = time.monotonic() + wait_s
            log.warning("the weight group did not form (next attempt in %.0fs): %s", wait_s, exc)
            return
        if self._closing:
            formed.publisher.close()
            formed.group.close()
            return
        self._formed, self.epoch, self.backoff_s = formed, formed.group.spec.epoch, 1.0
        self._last_formed = formed.members
        for member in formed.members:
            self._strikes.pop(member, None)
        self.on_event("formed")
        log.info(
            "weight group epoch %d formed: %d ranks (%s)",
            self.epoch,
            formed.group.spec.world_size,
            ", ".join(sorted(formed.members)),
        )

    def _form(self, live: dict[str, Member]) -> _Formed:
        ranks, world = {}, 1
        for member_id in sorted(live):
            ranks[member_id] = world
            world += live[member_id].workers
        epoch = self._made = self.registry.next_epoch(after=self._made)
        if self._store is None:
            # one store for the coordinator's life (epochs' keys have prefixes), since a closed group keeps it
            # and its port: on a free port, or the first free one of the range
            error: Exception | None = None
            for port in [0] if self.port == 0 else range(self.port, self.port + self.port_range):
                try:
                    self._store = open_store(self._template, master=True, port=port)
                    break
                except Exception as exc:  # in use (a learner before this one, another run)
                    error = exc
            else:
                raise RuntimeError(f"no free port in {self.port}..{self.port + self.port_range - 1}: {error}")
        store = self._store
        spec = replace(self._template, port=int(store.port), world_size=world, epoch=epoch)
        self.registry.write_spec(spec, ranks, self.bucket_bytes)
        prefixed = dist.PrefixStore(spec.prefix(), store)
        arrived = arrive(prefixed, "members_arrived", len(ranks) + 1, spec.form_timeout_s)
        if arrived < len(ranks) + 1:
            missing = [m for m in ranks if not prefixed.check([f"arrived/{m}"])]
            why = (
                f"epoch {epoch}: {arrived} of {len(ranks) + 1} members arrived within "
                f"{spec.form_timeout_s:.0f}s; missing: {missing}"
            )
            give_up(prefixed, why)  # a member arriving later (its loop was busy) does not wait for it
            raise FormFailed(why, missing)
        try:
            group = WeightGroup(spec, 0, self.device, store=store)
        except TransferFailed as exc:
            # every member arrived and the ranks did not connect: nothing names the rank that could not (a wrong
            # NCCL_SOCKET_IFNAME, a NetworkPolicy), so those new since the last epoch that formed are left out
            # (all, where all are new): were none, every attempt would fail alike, each holding every sampler's
            # loop in its join for up to the forming timeout
            raise FormFailed(str(exc), sorted(set(ranks) - self._last_formed)) from exc
        members = frozenset(ranks)

        def gone() -> str | None:
            """Why the epoch's members are not all alive (a heartbeat expired: the process died or hung), or
            None; rank 0 asks while a broadcast is pending. Redis out of reach gives no verdict."""
            try:
                missing = sorted(members - set(self.registry.live()))
            except Exception:
                return None
            return f"member {', '.join(missing)} stopped heartbeating (dead or hung)" if missing else None

        group.members_gone = gone
        if self._staging is None:
            self._staging = PinnedStaging()
        return _Formed(group, CollectivePublisher(group, self.bucket_bytes, staging=self._staging), members)


def coordinator_from_config(
    wb: Any,
    redis_url: str,
    run_id: str,
    client: redis.Redis,
    device: torch.device,
    on_event: Callable[[str], None] | None = None,
    wait_budget_s: float | None = None,
) -> GroupCoordinator:
    """Learner rank 0's coordinator from ``wb``, the ``[weight_broker]`` table (an auto backend follows
    ``device``)."""
    backend = (
        wb.group_backend if wb.group_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    )
    timeout_s = wb.group_timeout_s
    if wait_budget_s is not None and wait_budget_s < timeout_s:
        # a step of a broadcast under NCCL is a kernel on rank 0's GPU, which the training step's device-wide
        # synchronizes wait for while the other learner ranks wait for rank 0 in a collective of their own
        log.info(
            "weight_broker.group_timeout_s capped at %.0fs (learner.collective_timeout_s / 3)", wait_budget_s
        )
        timeout_s = wait_budget_s
    return GroupCoordinator(
        GroupRegistry(client, run_id, wb.group_member_ttl_s),
        wb.group_host or reachable_host(redis_url, "weight_broker.group_host"),
        backend,
        wb.group_port,
        timeout_s=timeout_s,
        form_timeout_s=wb.group_form_timeout_s,
        bucket_bytes=wb.group_bucket_mb << 20,
        device=device if backend == "nccl" else None,
        on_event=on_event,
        wait_budget_s=wait_budget_s,
        settle_s=wb.group_settle_s,
        settle_max_s=wb.group_settle_max_s,
    )
