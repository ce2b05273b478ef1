"""Where the weight group meets (``weight_group.py`` re-exports all of it): the epoch's spec, its TCP store
(rank 0 hosts it), the count of ranks arriving at it, rank 0's announcements in it; and the one error every
failure of the group is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


class TransferFailed(RuntimeError):
    """A version did not reach every member of the group; no member applied it. The group must be re-formed."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the weight group meets: the control plane hands the same spec to every member.

    ``world_size`` counts the publisher and every receiving worker. ``epoch`` names this forming of the group:
    a re-formed group (a member joined, restarted or failed) gets a new one, so no key of an old rendezvous
    is read by a new one.
    """

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

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "world_size": self.world_size,
            "backend": self.backend,
            "epoch": self.epoch,
            "timeout_s": self.timeout_s,
            "form_timeout_s": self.form_timeout_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSpec:
        return cls(
            str(d["host"]),
            int(d["port"]),
            int(d["world_size"]),
            str(d.get("backend", "gloo")),
            int(d.get("epoch", 0)),
            float(d.get("timeout_s", 120.0)),
            float(d.get("form_timeout_s", 30.0)),
        )

    def prefix(self) -> str:
        """The key prefix of this epoch's rendezvous and announcements in the group's store."""
        return f"vcpo-weights/{self.epoch}"


def open_store(spec: GroupSpec, master: bool = False, port: int | None = None) -> Any:
    """A TCP store client of ``spec``'s rendezvous (or, ``master``, the store itself, listening on ``port``:
    0 binds a free one, read back from ``.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        spec.host,
        spec.port if port is None else port,
        spec.world_size,
        is_master=master,
        timeout=timedelta(seconds=spec.form_timeout_s),
        wait_for_workers=False,
    )


FAILED = "failed"  # an epoch's key: why a rank gave it up (while forming, or a broadcast that failed)


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
        logging.getLogger(__name__).debug("could not mark the epoch failed", exc_info=True)


class AnnouncementWatch:
    """A receiver's view of rank 0's announcements (``announce/<n>`` = version, in order) in one epoch's
    store: the weight group's own, or a client of the store held by a process that is not a rank itself (a
    sampler's driver, whose engine workers are the ranks)."""

    def __init__(self, store: Any, closed: Any = None) -> None:
        self._store = store
        self._on_failure = closed  # called once the store is gone (e.g. to close the group)
        self.seq = 0  # announcements taken

    @classmethod
    def of(cls, spec: GroupSpec) -> AnnouncementWatch:
        import torch.distributed as dist

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
