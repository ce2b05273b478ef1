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
before: up to two versions beside the learner's model, which its memory plan counts. A receiver killed
while it still holds its views never gives its count back, and that version stays allocated in the learner's
process (torch's CUDA IPC has no way to tell a dead consumer from a slow one).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


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
            torch.cuda.ipc_collect()  # earlier versions every receiver has let go of
            self.current = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self.current[:nbytes]

    def release(self) -> None:
        """Let this version's buffer go (after the vote): torch keeps it until every receiver let go too."""
        self.current = None


def export(buffer: torch.Tensor, ranks: Iterable[int]) -> dict[str, dict[str, Any]]:
    """One export of ``buffer``'s memory per receiver rank, as JSON-ready dicts keyed by the rank: the CUDA IPC
    handle of its allocation, where the buffer starts in it, the reference counter the receiver decrements
    when it lets go, and the event after the publisher's pending copies into it (on its current stream)."""
    storage = buffer.untyped_storage()
    out: dict[str, dict[str, Any]] = {}
    for rank in ranks:
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
        out[str(rank)] = {
            "handle": _b64(handle),
            "size_bytes": int(size_bytes),
            "offset_bytes": int(offset_bytes),
            "ref_counter_handle": _b64(ref_counter_handle),
            "ref_counter_offset": int(ref_counter_offset),
            "event_handle": _b64(event_handle),
            "event_sync_required": bool(event_sync_required),
            "view_offset": int(buffer.storage_offset()),
        }
    return out


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
    """Give back the count of an export this receiver could not open, so the publisher's buffer is freed
    once the others let go (a failure to do so is logged: the buffer then stays until the learner exits)."""
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(
            base64.b64decode(entry["ref_counter_handle"]), int(entry["ref_counter_offset"])
        )
    except Exception:
        log.warning("could not give back a CUDA IPC export's count", exc_info=True)


def ipc_header(buffer: torch.Tensor, world_size: int, nbytes: int) -> dict[str, Any]:
    """The header's ``cuda_ipc``: the staged version's size and one export of it per receiver (ranks 1..)."""
    return {"nbytes": nbytes, "exports": export(buffer, range(1, world_size))}


def receive_export(group: Any, layout: list[Any], ipc: dict[str, Any]) -> list[torch.Tensor]:
    """A receiver's view of the publisher's staged version (the header's ``cuda_ipc``) on its GPU; empty if it
    cannot open it: it gives its count back, says why in the group's store (``no_cuda_ipc/<rank>``, which the
    publisher reads after the failed vote), and votes the version down."""
    [whole] = layout
    entry = ipc["exports"][str(group.rank)]
    if int(ipc["nbytes"]) != whole.nbytes:
        raise ValueError(
            f"the header's CUDA IPC export holds {ipc['nbytes']} bytes, its tensors {whole.nbytes}"
        )
    try:
        if group.gpu is None:
            raise ValueError("this member has no GPU")
        return [open_export(entry, group.gpu, whole.nbytes)]
    except Exception as exc:
        if torch.cuda.is_available():
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
