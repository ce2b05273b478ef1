"""The weight group's receivers in the control plane that ``group_control.py`` draws (its Redis keys too): their
registration (:class:`GroupRegistry`) and their seat in an epoch (:class:`MemberSeat`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import torch
import torch.distributed as dist

from services.weight_transport.weight_group import GroupSpec, arrive, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """A receiver: ``workers`` ranks (an engine's workers) on ``devices`` ("cuda": NCCL or gloo; "cpu": gloo)."""

    id: str
    workers: int = 1
    kind: str = "sampler"
    devices: str = "cpu"

    @classmethod
    def here(cls, name: str, workers: int, kind: str, gpu: bool | None = None) -> Member:
        """This process as a member: ``name`` plus a fresh incarnation (a restarted process is a new member),
        with a GPU if it was given one (default: if CUDA shows it one)."""
        gpu = torch.cuda.is_available() if gpu is None else gpu
        return cls(f"{name}.{uuid.uuid4().hex[:8]}", workers, kind, "cuda" if gpu else "cpu")


@dataclass(frozen=True)
class Seat:
    """An epoch of the group that names this member, every member arrived: join it as ranks
    ``rank_offset`` .. ``rank_offset + workers - 1``."""

    spec: GroupSpec
    rank_offset: int
    bucket_bytes: int

    def init_info(self) -> dict[str, Any]:
        """What a vLLM engine's ``init_weight_transfer_engine`` takes (services/sampler/weight_transfer.py)."""
        return {**dataclasses.asdict(self.spec), "rank_offset": self.rank_offset}


class GroupRegistry:
    """The Redis keys of the control plane (one run's)."""

    def __init__(self, client: redis.Redis, run_id: str, ttl_s: float = 10.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"member ttl must be > 0, got {ttl_s}")
        self.client, self.ttl_s = client, ttl_s
        self.prefix = f"vcpo:{run_id}:wg"

    def heartbeat(self, member: Member) -> None:
        pipe = self.client.pipeline(transaction=False)
        body = json.dumps({"workers": member.workers, "kind": member.kind, "devices": member.devices})
        pipe.set(f"{self.prefix}:member:{member.id}", body, px=int(self.ttl_s * 1000))
        pipe.sadd(f"{self.prefix}:members", member.id)
        pipe.execute()

    def leave(self, member_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(f"{self.prefix}:member:{member_id}")
        pipe.srem(f"{self.prefix}:members", member_id)
        pipe.execute()

    def live(self) -> dict[str, Member]:
        """Every member whose heartbeat has not expired (expired ones are removed from the set)."""
        ids = sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in self.client.smembers(f"{self.prefix}:members")
        )
        if not ids:
            return {}
        values = self.client.mget([f"{self.prefix}:member:{i}" for i in ids])
        out, gone = {}, []
        for member_id, raw in zip(ids, values, strict=True):
            if raw is None:
                gone.append(member_id)
                continue
            out[member_id] = Member(member_id, **json.loads(raw))  # heartbeat()'s fields
        if gone:
            self.client.srem(f"{self.prefix}:members", *gone)
        return out

    def next_epoch(self, after: int = 0) -> int:
        """A new epoch number, greater than ``after`` (the last one its caller made) even where the counter went
        back (Redis lost its last writes): a reused number would meet the old epoch's keys in the rendezvous
        store, and members that saw it would not join it."""
        key = f"{self.prefix}:epoch"
        epoch = int(self.client.incr(key))
        if epoch <= after:
            epoch = after + 1
            self.client.set(key, epoch)
        return epoch

    def write_spec(self, spec: GroupSpec, ranks: dict[str, int], bucket_bytes: int) -> None:
        body = {**dataclasses.asdict(spec), "ranks": ranks, "bucket_bytes": bucket_bytes}
        self.client.set(f"{self.prefix}:spec", json.dumps(body))

    def spec(self) -> tuple[GroupSpec, dict[str, int], int] | None:
        """The newest epoch's spec, the members' rank offsets and the bucket size (None before the first)."""
        raw = self.client.get(f"{self.prefix}:spec")
        if raw is None:
            return None
        d = json.loads(raw)
        ranks, bucket_bytes = d.pop("ranks"), d.pop("bucket_bytes")
        return GroupSpec(**d), {k: int(v) for k, v in ranks.items()}, int(bucket_bytes)


class MemberSeat:
    """A receiver's place in the control plane: keeps its registration alive and arrives, from a thread, at
    each epoch that names it; :meth:`take` hands the epoch, every member arrived, to the engine's loop."""

    def __init__(self, registry: GroupRegistry, member: Member, poll_s: float = 0.25) -> None:
        self.registry, self.member, self.poll_s = registry, member, poll_s
        self.newest_epoch = 0  # the newest epoch the control plane formed (a holder of an older one leaves)
        self._seen = 0
        self._ready: Seat | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.registry.heartbeat(self.member)
        # two threads: waiting at a rendezvous (up to form_timeout_s) must not let the registration expire
        kind = self.member.kind
        beat = threading.Thread(target=self._loop, args=(self._beat, self.registry.ttl_s / 3), daemon=True)
        check = threading.Thread(target=self._loop, args=(self._check, self.poll_s), daemon=True)
        beat.name, check.name = f"weight-seat-beat-{kind}", f"weight-seat-{kind}"
        self._threads = [beat, check]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        try:
            self.registry.leave(self.member.id)
        except redis.RedisError as exc:
            log.warning("could not leave the weight group's registry: %s", exc)

    def renew(self) -> None:
        """Register under a new id, as a restarted process does, and leave the old one: its load failed, so
        learner rank 0 counts it among the receivers the current version did not reach (and gives the broker
        that version); the group re-forms with it. Raises redis.RedisError if the registry is out of reach."""
        old = self.member
        name = old.id.rsplit(".", 1)[0]
        self.member = new = Member(f"{name}.{uuid.uuid4().hex[:8]}", old.workers, old.kind, old.devices)
        self.registry.heartbeat(new)
        self.registry.leave(old.id)
        log.info("registered again as %s (was %s)", new.id, old.id)

    def take(self) -> Seat | None:
        """A formed epoch to join, once (None when there is none new, or it was superseded: taken too late,
        joining it would wait out the forming timeout for ranks that left)."""
        with self._lock:
            seat, self._ready = self._ready, None
        if seat is not None and self.superseded(seat.spec.epoch):
            log.info("weight group epoch %d was superseded before this member took it", seat.spec.epoch)
            return None
        return seat

    def superseded(self, epoch: int) -> bool:
        """Whether the control plane formed an epoch after ``epoch`` (its members left that one)."""
        return self.newest_epoch > epoch

    def _loop(self, work: Callable[[], None], every_s: float) -> None:
        while not self._stop.is_set():
            try:
                work()
            except redis.RedisError as exc:
                log.warning("weight group registry unreachable: %s", exc)
            except Exception:  # never the end of this thread: the member would stop arriving for good
                log.exception("weight group seat: %s failed", getattr(work, "__name__", work))
            self._stop.wait(every_s)

    def _beat(self) -> None:
        # not under the lock take() uses: the engine's loop would wait out a Redis outage in it
        member = self.member
        self.registry.heartbeat(member)
        if self.member is not member:  # renewed meanwhile: the old id stays gone
            self.registry.leave(member.id)

    def _check(self) -> None:
        current = self.registry.spec()
        if current is None:
            return
        spec, ranks, bucket_bytes = current
        self.newest_epoch = max(self.newest_epoch, spec.epoch)
        me = self.member.id  # the id this arrives under (renew() may change the member's meanwhile)
        if spec.epoch <= self._seen or me not in ranks:
            return
        self._seen = spec.epoch
        log.info(
            "weight group epoch %d names this member: arriving at %s:%d", spec.epoch, spec.host, spec.port
        )
        t0 = time.monotonic()
        try:
            store = dist.PrefixStore(spec.prefix(), open_store(spec))
            store.set(f"arrived/{me}", "1")
            arrived = arrive(store, "members_arrived", len(ranks) + 1, spec.form_timeout_s)
        except Exception as exc:
            log.warning("weight group epoch %d: no arrival at its rendezvous: %s", spec.epoch, exc)
            return
        if arrived < len(ranks) + 1:
            why = f"{arrived} of {len(ranks) + 1} members arrived within {spec.form_timeout_s:.0f}s"
            log.warning("weight group epoch %d: %s; staying on the broker path", spec.epoch, why)
            return
        log.info(
            "weight group epoch %d: all %d members arrived (%.1fs)",
            spec.epoch,
            arrived,
            time.monotonic() - t0,
        )
        # renewed meanwhile: joined all the same (the others would wait for it), and the coordinator then forms
        # an epoch with the new id
        with self._lock:
            self._ready = Seat(spec, ranks[me], bucket_bytes)
