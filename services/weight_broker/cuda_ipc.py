"""CUDA IPC for a weight group whose every member is on one GPU: the version never leaves the device.

When a learner and its samplers are given fractions of one GPU, NCCL refuses them (two ranks of one
communicator on one GPU) and the group falls back to gloo, the version staged in /dev/shm for the receivers
to map (``shared_memory.py``). Their engines then load it host to device from pageable memory: 3.6–4.2 GB/s
on an H200, against 55 GB/s from page-locked memory and 2.1 TB/s device to device
(benchmarks/weight_sync_gpu.py). With ``weight_broker.group_cuda_ipc`` the publisher stages the version in a
buffer on its GPU instead and hands each receiver a CUDA IPC handle of it, as vLLM's IPC weight-transfer
engine does: the receivers' tensors are views of the publisher's memory, which their engines load device to
device.

    DeviceStaging           the publisher's buffer: a new one per version, on its GPU
    export(buffer, ranks)   one handle per receiver, in the header's JSON (torch's cross-process reference
                            counting pairs one export with one receiver's release)
    open_export(e, dev, n)  a receiver's view of the buffer (it waits on the publisher's staging copies)
    release_export(e)       a receiver that could not open its export gives its count back

Lifetime: torch keeps the publisher's buffer allocated after the publisher lets it go (after the vote) until
every receiver has let go of its views (once its engine loaded them, or at once when the version is voted
down). So the publisher's GPU holds the version being staged and, until the samplers have loaded it, the one
before: up to two versions beside the learner's model, which its memory plan counts.

Counts no receiver will give back (:class:`HeldExports`, kept for the process's life in :data:`HELD`):
    a receiver killed while it holds its views     torch cannot tell a dead consumer from a slow one; the
                                                   publisher can, on one host: it gives the count back once
                                                   the receiver's process has certainly ended and its count
                                                   is still out (read in torch's counter file)
    an export no receiver opened (a failed version)  each export belongs to whichever side claims it first
                                                   in the epoch's store: the receiver before it opens it, the
                                                   publisher after the version failed (``settle``)
Without these, each such version stayed allocated on the learner's GPU until it exited.
"""

from __future__ import annotations

import base64
import logging
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.pids import process_gone, process_seen

log = logging.getLogger(__name__)

COUNTERS_DIR = "/dev/shm"  # where torch's reference-counter files are (shm_open names)
_COUNTER_HEADER = 64  # torch's RefcountedMapAllocator keeps its own count in a mapping's first 64 bytes


class DeviceStaging:
    """The publisher's staging buffer on its GPU: a new one for each version (the previous one may still be
    read by receivers that have not loaded it; torch frees it once they let go)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC stages versions on a CUDA device, not {device}")
        self.device = device
        self.current: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the current buffer: the one staged and not yet sent, or a new one."""
        if self.current is None or self.current.numel() < nbytes:
            self.current = None
            HELD.reclaim()  # the counts of receivers that died holding earlier versions
            self.current = self._new(max(nbytes, 1))
        return self.current[:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        torch.cuda.ipc_collect()  # earlier versions every receiver has let go of
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        """Let this version's buffer go (after the vote): torch keeps it until every receiver let go too."""
        self.current = None


def export(buffer: torch.Tensor, ranks: Iterable[int]) -> dict[str, dict[str, Any]]:
    """One export of ``buffer``'s memory per receiver rank, as JSON-ready dicts keyed by the rank: the CUDA IPC
    handle of its allocation, where the buffer starts in it, the reference counter the receiver decrements
    when it lets go, and the event after the publisher's pending copies into it (on its current stream)."""
    storage = buffer.untyped_storage()
    out: dict[str, dict[str, Any]] = {}
    try:
        for rank in ranks:
            out[str(rank)] = _export_one(storage, buffer.storage_offset())
    except BaseException:  # no receiver will see these: their counts go back at once
        for entry in out.values():
            release_export(entry)
        raise
    return out


def _export_one(storage: torch.UntypedStorage, view_offset: int) -> dict[str, Any]:
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "handle": _b64(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
        "view_offset": int(view_offset),
    }


def open_export(entry: dict[str, Any], device: torch.device, nbytes: int) -> torch.Tensor:
    """A view of ``nbytes`` of the publisher's buffer on ``device`` (this process's index of the same GPU);
    raises where the driver or the sandbox refuses CUDA IPC, or the export is smaller than ``nbytes``."""
    size, start = int(entry["size_bytes"]), int(entry["view_offset"])
    if size - start < nbytes:
        raise ValueError(f"the export holds {size - start} bytes, the header {nbytes}")
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            base64.b64decode(entry["handle"]),
            size,
            int(entry["offset_bytes"]),
            base64.b64decode(entry["ref_counter_handle"]),
            int(entry["ref_counter_offset"]),
            base64.b64decode(entry["event_handle"]),
            bool(entry["event_sync_required"]),
        )
    whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return whole[start : start + nbytes]


def release_export(entry: dict[str, Any]) -> None:
    """Give back the count of an export whose views no one will hold: a receiver that could not open it, or the
    publisher for a receiver that never will (a failure to do so is logged: the buffer then stays until the
    learner exits)."""
    counter = _counter(entry)
    if counter is None:
        return
    try:
        release_counter(*counter)
    except Exception:
        log.warning("could not give back a CUDA IPC export's count", exc_info=True)


def release_counter(handle: bytes, offset: int) -> None:
    """Decrement an export's count in torch's counter file, as its receiver does when it lets go."""
    torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)


def read_counter(handle: bytes, offset: int) -> int | None:
    """An export's count not yet given back (1: its receiver may hold it; 0: given back), read from torch's
    counter file in /dev/shm; None: the file is gone or unreadable."""
    try:
        with open(os.path.join(COUNTERS_DIR, handle.decode().lstrip("/")), "rb") as f:
            f.seek(_COUNTER_HEADER + 8 * offset)
            raw = f.read(8)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return int(struct.unpack("=q", raw)[0]) if len(raw) == 8 else None


def _counter(entry: dict[str, Any]) -> tuple[bytes, int] | None:
    if not entry.get("ref_counter_handle"):
        return None
    return base64.b64decode(entry["ref_counter_handle"]), int(entry["ref_counter_offset"])


@dataclass(frozen=True)
class Held:
    """An export handed to a receiver that has not given its count back, as far as this process knows."""

    version: int
    rank: int
    process: str  # the receiver's process (pids.process_identity); '' where this one cannot tell if it ended
    counter: bytes  # torch's counter file
    offset: int  # and the export's slot in it


class HeldExports:
    """The CUDA IPC exports this process handed out whose receivers have not given their counts back: kept for
    the process's life (:data:`HELD`), since a receiver that died holding its views is found after the epoch
    it was in has gone.

    ``reclaim`` gives back the count of a receiver whose process has certainly ended
    (:func:`services.common.pids.process_gone`) while its count is still out: that process can no longer give
    it back or read the buffer. Whether the count is out is read in torch's counter file; each export is
    checked to read 1 when made, and where one does not (torch laid its file out otherwise), nothing is
    reclaimed from then on, as before this ledger (a warning says so)."""

    def __init__(self) -> None:
        self.held: list[Held] = []
        self.readable = True
        self.reclaimed = 0  # counts given back for receivers that died holding them
        self._unreported = 0
        self._unseen: set[tuple[int, str]] = set()  # receivers warned of: this process cannot see them
        self._lock = threading.Lock()

    def add(self, version: int, rank: int, entry: dict[str, Any], process: str) -> None:
        """Keep an export just made for ``rank``, whose receiver runs as ``process`` (what it said)."""
        counter = _counter(entry)
        if counter is None:
            return
        count = read_counter(*counter)
        with self._lock:
            if count != 1 and self.readable:
                log.warning(
                    "a new CUDA IPC export's count reads %s in %s, not 1: receivers that die holding a version "
                    "will leave it allocated on this GPU until this process exits",
                    count,
                    counter[0].decode(errors="replace"),
                )
                self.readable = False
            if not self.readable:
                return
            # it is alive now (it waits for this version): if it is not seen running, this process cannot
            # tell when it ends (another PID namespace, or it said nothing)
            seen = process_seen(process)
            self.held.append(Held(version, rank, process if seen else "", *counter))
            warn = not seen and (rank, process) not in self._unseen
            if warn:
                self._unseen.add((rank, process))
        if warn:
            log.warning(
                "the CUDA IPC receiver of rank %d runs where this process cannot see it (%s): if it dies "
                "holding a version, that version stays allocated on this GPU until this process exits",
                rank,
                process or "it named no process",
            )

    def reclaim(self) -> list[Held]:
        """Give back the counts of receivers that died holding their exports; forget those given back."""
        with self._lock:
            kept, given = [], []
            for h in self.held:
                count = read_counter(h.counter, h.offset)
                if count is None or count <= 0:
                    continue
                if h.process and process_gone(h.process):
                    try:
                        release_counter(h.counter, h.offset)
                    except Exception:
                        log.warning("could not give back a dead receiver's CUDA IPC count", exc_info=True)
                        kept.append(h)
                        continue
                    given.append(h)
                else:
                    kept.append(h)
            self.held = kept
            self.reclaimed += len(given)
            self._unreported += len(given)
        for h in given:
            log.warning(
                "version %d: the receiver of rank %d ended holding its CUDA IPC views (process %s): gave its "
                "count back, so this GPU frees the version once the others let go",
                h.version,
                h.rank,
                h.process,
            )
        return given

    def forget(self, counter: tuple[bytes, int]) -> None:
        with self._lock:
            self.held = [h for h in self.held if (h.counter, h.offset) != counter]

    def report(self) -> int:
        """How many counts were given back since the last report (the learner counts them)."""
        with self._lock:
            n, self._unreported = self._unreported, 0
        return n


HELD = HeldExports()


def ipc_header(buffer: torch.Tensor, group: Any, version: int, nbytes: int) -> dict[str, Any]:
    """The header's ``cuda_ipc``: the staged version's size and one export of it per receiver (ranks 1..),
    each kept in :data:`HELD` with the process its receiver said it runs as."""
    exports = export(buffer, range(1, group.spec.world_size))
    for rank, entry in exports.items():
        HELD.add(version, int(rank), entry, group.get_key(f"process/{rank}") or "")
    return {"nbytes": nbytes, "exports": exports}


def _claim_key(version: int, rank: int) -> str:
    return f"ipc/{version}/{rank}"


def settle(group: Any, version: int, ipc: dict[str, Any], committed: bool) -> None:
    """After the vote on a version sent over CUDA IPC. Committed: every receiver opened its export (its claim
    keys go). Otherwise the publisher claims the exports no receiver claimed, and gives their counts back: no
    receiver opens them now (one that claimed gives its own back as it lets go, or, dead, is reclaimed)."""
    for rank, entry in ipc["exports"].items():
        key = _claim_key(version, int(rank))
        if committed:
            group.drop_key(key)
        elif group.claim(key, "publisher") == "publisher" and (counter := _counter(entry)):
            release_export(entry)
            HELD.forget(counter)


def receive_export(group: Any, layout: list[Any], ipc: dict[str, Any], version: int) -> list[torch.Tensor]:
    """A receiver's view of the publisher's staged version (the header's ``cuda_ipc``) on its GPU, once it has
    claimed its export (``ipc/<version>/<rank>``, before the publisher can after a failure). Empty if it cannot
    open it: it gives its count back, says why in the group's store (``no_cuda_ipc/<rank>``, which the
    publisher reads after the failed vote), and votes the version down; empty too if the publisher claimed it
    first (the version failed: it gave the count back)."""
    [whole] = layout
    entry = ipc["exports"][str(group.rank)]
    if int(ipc["nbytes"]) != whole.nbytes:
        raise ValueError(
            f"the header's CUDA IPC export holds {ipc['nbytes']} bytes, its tensors {whole.nbytes}"
        )
    if (owner := group.claim(_claim_key(version, group.rank), "receiver")) != "receiver":
        if owner is None:  # the publisher claims it after the failed vote, and gives its count back
            log.warning("version %d: the group's store did not answer the CUDA IPC export's claim", version)
        else:
            log.warning(
                "version %d: the CUDA IPC export was claimed by the %s (the version failed)", version, owner
            )
        return []
    try:
        if group.gpu is None:
            raise ValueError("this member has no GPU")
        return [open_export(entry, group.gpu, whole.nbytes)]
    except Exception as exc:
        release_export(entry)
        why = f"rank {group.rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log.error("cannot open the publisher's CUDA IPC export (%s): voting against the version", why)
        group.set_key(f"no_cuda_ipc/{group.rank}", why)
        return []


def ipc_refused(group: Any) -> str | None:
    """Why receivers could not open a CUDA IPC export, as they said in the group's store (None: none said)."""
    said = [group.get_key(f"no_cuda_ipc/{r}") for r in range(1, group.spec.world_size)]
    return "; ".join(why for why in said if why) or None


def _b64(value: bytes | None) -> str:
    return base64.b64encode(value or b"").decode()
