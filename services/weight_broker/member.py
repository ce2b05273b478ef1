"""The broker's seat in the weight group: the fallback for samplers that join late or restart.

The learner broadcasts each version once, into every sampler engine and into the broker alike
(services/weight_broker/collective.py). The broker takes its copy as one more receiver, stores it as if it had
been published (per-tensor and version checksums, retention, memory or disk storage) and announces it on the
run's ``weights`` stream, so a sampler that missed the broadcast fetches the version over the broker path.
The learner pays nothing for the fallback: it sends no second copy.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import torch

from services.weight_broker.receiver import CollectiveReceiver
from services.weight_broker.seats import MemberSeat
from services.weight_broker.servicer import WeightBrokerServicer, is_store_error
from services.weight_broker.store import PublishRejected, StoredVersion
from services.weight_broker.tensors import TensorSpec, checksum, manifest_of, tensor_bytes, version_checksum
from services.weight_broker.weight_group import TransferFailed, WeightGroup
from services.weight_broker.wire import Chunk

log = logging.getLogger(__name__)


class BrokerMember:
    """Receives every version broadcast into ``group`` and commits it into the servicer's store."""

    def __init__(self, servicer: WeightBrokerServicer, group: WeightGroup) -> None:
        self.servicer, self.group = servicer, group
        self.received: list[int] = []
        self.failures: list[str] = []  # why versions were not stored, in order

    def step(self, timeout_s: float) -> int | None:
        """Take the next announced version, if one is announced within ``timeout_s``: receive it and store it.
        Returns its number (None when none came). Raises :class:`TransferFailed` when the broadcast failed (the
        group is then closed) and :class:`PublishRejected` when the store refuses the version (stale)."""
        version = self.group.next_announcement(timeout_s)
        if version is None:
            return None
        t0 = time.monotonic()
        got, tensors, _ = CollectiveReceiver(self.group).receive()
        if got != version:
            raise TransferFailed(f"the weight group delivered version {got}, its announcement said {version}")
        self.servicer.commit(lambda: self._write(version, tensors), t0)  # counted and announced as a publish
        self.received.append(version)
        return version

    def _write(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> StoredVersion:
        """A received version through the writer a publish uses, each tensor one chunk (checksums computed
        here). Not through encoded publish messages: those would copy the version once more."""
        manifest = manifest_of([TensorSpec.of(n, t) for n, t in tensors], version, self.servicer.run_id)
        writer = self.servicer.store.begin(manifest)
        try:
            digests = []
            for name, tensor in tensors:
                data = tensor_bytes(tensor)  # a view of the received bucket: the store keeps it, no copy
                digest = checksum(data)
                writer.write(Chunk(version, name, 0, data, True, digest))
                digests.append((name, digest))
            return writer.commit(version_checksum(digests))
        except BaseException:  # a full disk mid-write: nothing of it stays, and the store takes the next
            writer.abort()
            raise

    def run(
        self, stop: threading.Event, poll_s: float = 1.0, superseded: Callable[[], bool] = lambda: False
    ) -> None:
        """Take versions until ``stop`` is set, the group breaks (a failed broadcast: the control plane forms
        a new group) or ``superseded()`` (a newer epoch formed). A version the store refuses, or cannot take,
        is counted and skipped (until this thread ended at a full disk, and with it the broker's catch-up)."""
        while not stop.is_set() and not superseded():
            try:
                self.step(poll_s)
            except PublishRejected as exc:  # counted and logged by the servicer
                self.failures.append(str(exc))
            except TransferFailed as exc:
                self.failures.append(str(exc))
                log.warning("the weight group failed; the broker leaves it: %s", exc)
                return
            except Exception as exc:  # received, but not stored (a full disk): counted, the next may be
                self.failures.append(f"{type(exc).__name__}: {exc}")
                if not is_store_error(exc):  # (those the servicer's commit counted)
                    self.servicer.metrics.rejected.labels("store_error").inc()
                log.error("a broadcast version was not stored: %s", self.failures[-1])
                if self.group.closed:
                    return


def serve_seat(
    servicer: WeightBrokerServicer, seat: MemberSeat, stop: threading.Event, poll_s: float = 0.5
) -> None:
    """The broker's member thread: join each epoch the control plane forms with the broker in it, take its
    versions until it breaks or a newer one forms, and so on until ``stop``."""
    seat.start()
    try:
        while not stop.is_set():
            formed = seat.take()
            if formed is None:
                stop.wait(0.1)
                continue
            try:
                group = WeightGroup(formed.spec, formed.rank_offset)
            except Exception as exc:  # a TransferFailed, or a bad spec: the next epoch is tried all the same
                log.warning("could not join weight group epoch %d: %s", formed.spec.epoch, exc)
                continue
            log.info("joined weight group epoch %d as rank %d", formed.spec.epoch, formed.rank_offset)
            superseded = functools.partial(seat.superseded, formed.spec.epoch)
            BrokerMember(servicer, group).run(stop, poll_s, superseded=superseded)
            group.close()
    finally:
        seat.stop()
