"""The collective transport's receiving side: each sampler engine's worker (ranks 1..N of the weight group)
takes every version rank 0 broadcasts (``collective.py`` says how a version travels). Nothing is handed to
its engine before every rank voted to commit the version. A worker receives in the :class:`Background`, so
that its engine goes on generating meanwhile."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from services.weight_broker.buckets import Bucket, TransferStats, bucket_layout, bucket_offsets, pieces
from services.weight_broker.host_copy import HostCopy
from services.weight_broker.shared_memory import HostBuffers, receive_segment
from services.weight_broker.tensors import TensorSpec, torch_dtype
from services.weight_broker.weight_group import TransferFailed, WeightGroup, first_line

log = logging.getLogger(__name__)


class CollectiveReceiver:
    """Ranks 1..N: receive versions as they are broadcast."""

    def __init__(self, group: WeightGroup, bounce: bool | None = None) -> None:
        """``bounce`` (default: a group on a GPU) receives through two device buffers into page-locked host
        memory: a GPU worker's KV cache shares its GPU with two buckets, not with a second model."""
        if group.rank == 0:
            raise ValueError("rank 0 of the weight group is the publisher, not a receiver")
        self.group = group
        self.bounce = group.device.type != "cpu" if bounce is None else bounce
        self.device_bytes = 0  # the bounce buffers of the last version received

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]], TransferStats]:
        """Receive the version being broadcast; returns ``(version, [(name, tensor)] in order, stats)`` once
        every member has voted to commit it. Call it when the control plane announces a version: waiting longer
        than the group's timeout for the publisher fails. Raises :class:`TransferFailed`, returning nothing,
        if any part failed on any member (a failed collective also closes the group)."""
        group = self.group
        try:
            head = torch.zeros(3, dtype=torch.int64, device=group.device)
            group.ready(group.broadcasts + 1)  # rank 0 issues no collective before every receiver is
        except Exception as exc:  # a CUDA error: marked, so no rank waits for this one until the timeout
            raise group.part_failed(f"could not start receiving: {first_line(exc)}") from exc
        try:
            group.wait(group.broadcast(head))
        except Exception as exc:
            group.close()
            raise TransferFailed(f"no version arrived: {exc}") from exc
        t0 = time.monotonic()
        group.broadcasts += 1
        version, header_len, n_buckets = (int(x) for x in head.tolist())
        host_copy: HostCopy | None = None  # this host's one copy, when this receiver keeps its part in it
        try:
            raw = torch.empty(header_len, dtype=torch.uint8, device=group.device)
            group.wait(group.broadcast(raw))
            header = json.loads(bytes(raw.cpu().numpy()))
            specs = [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in header["tensors"]]
            piece = int(header["bucket_bytes"])
            layout = bucket_layout(specs, piece)
            if len(layout) != n_buckets:
                raise ValueError(
                    f"the header's layout has {len(layout)} buckets, the publisher sent {n_buckets}"
                )
            read = True  # whether this receiver holds the whole version (its vote)
            if "shared" in header:
                buffers = receive_segment(layout, header["shared"])
                read = bool(buffers)
                self._go()
            elif (host_copy := self._host_copy(layout)) is None:
                buffers = (self._bounced if self.bounce else self._direct)(layout, piece)
            elif host_copy.leader:
                buffers = self._through_buffers(layout, piece, host_copy.views)
            else:  # keeps nothing: what this host loads is the leader's copy, which it must be able to open
                buffers = self._through_buffers(layout, piece, None)
                read = host_copy.opened
        except TransferFailed as exc:  # the group's: marked for every rank already
            group.close()
            raise TransferFailed(f"version {version}: receiving failed: {exc}") from exc
        except Exception as exc:  # this rank's own (no room for a bounce buffer, a bad header)
            # marked for the others before closing: the publisher and the other receivers would otherwise wait
            # in the next bucket until the group's timeout (an NCCL peer is not woken by this rank's abort)
            raise group.part_failed(f"version {version}: receiving failed: {first_line(exc)}") from exc
        try:
            committed = group.all_ok(read)
        except Exception as exc:
            group.close()
            raise TransferFailed(f"version {version}: the commit vote failed: {exc}") from exc
        if not committed:
            if host_copy is not None:
                host_copy.failed()
            raise TransferFailed(
                f"version {version}: not committed (the publisher's source failed, or a member could not "
                "read the version)"
            )
        if host_copy is not None:
            buffers = host_copy.committed(layout) or buffers  # the others: the leader's copy, mapped
        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in zip(layout, buffers, strict=True):  # views: no copy
            for i, offset in bucket.items:
                s = specs[i]
                view = buf[offset : offset + s.nbytes].view(torch_dtype(s.dtype)).reshape(s.shape)
                tensors.append((s.name, view))
        nbytes = sum(s.nbytes for s in specs)
        extra = {
            "shared_memory": 1.0 if "shared" in header else 0.0,
            "host_copy": 0.0 if host_copy is None else 1.0 if host_copy.leader else 2.0,
        }
        stats = TransferStats(version, len(specs), nbytes, n_buckets, time.monotonic() - t0, extra)
        return version, tensors, stats

    def _go(self) -> None:
        """Ready for the version's data: under NCCL rank 0 issues none of it before every receiver is (its
        buffers made, a page-locked host copy of the whole model the first time), as no kernel on the
        learner's GPU may wait for it (``WeightGroup.wait_ready``)."""
        self.group.ready(self.group.broadcasts, "data")

    def _host_copy(self, layout: list[Bucket]) -> HostCopy | None:
        """This host's one copy of the version, when this receiver takes part in one (None: it keeps its own,
        as when the leader has no room for it)."""
        group = self.group
        if not group.host_peers:
            return None
        group.host_copy = group.host_copy or HostCopy(group)
        return group.host_copy if group.host_copy.begin(layout) else None

    def _direct(self, layout: list[Bucket], piece: int) -> list[torch.Tensor]:
        """Every bucket into its own buffer on the group's device, its pieces all queued at once (gloo runs
        them in order)."""
        group = self.group
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=group.device) for b in layout]
        self._go()
        works = [group.broadcast(buf[a:b]) for buf in buffers for a, b in pieces(buf.numel(), piece)]
        for work in works:
            group.wait(work)
        return buffers

    def _bounced(self, layout: list[Bucket], piece: int) -> list[torch.Tensor]:
        """Every bucket through the device buffers into its place in one host buffer of the version's size
        (the group's :class:`HostBuffers`: page-locked under CUDA, the spare once the engine lets go of it)."""
        offsets, total = bucket_offsets(layout)
        self.group.host_buffers = self.group.host_buffers or HostBuffers(self.group.cuda_index)
        whole = self.group.host_buffers.take(total, f"a {total}-byte host copy of a version")
        host = [whole[o : o + b.nbytes] for o, b in zip(offsets, layout, strict=True)]
        return self._through_buffers(layout, piece, host)

    def _through_buffers(
        self, layout: list[Bucket], piece: int, outs: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """Each piece into one of two device buffers (at most a bucket each, however large a weight), then
        copied to its bucket's place in ``outs`` (host memory; None: kept nowhere). Returns ``outs`` (empty
        for None).

        On CUDA each copy out runs on a stream of its own while the next piece arrives in the other buffer,
        whose broadcast waits only for that buffer's last copy out (a copy on the current stream, which the
        group's collectives wait for, would hold up the next piece)."""
        group = self.group
        ranges = [pieces(b.nbytes, piece) for b in layout]
        size = max(b - a for bucket in ranges for a, b in bucket)
        slots = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(2)]
        self.device_bytes = 2 * size
        copier = torch.cuda.Stream(group.device) if group.device.type == "cuda" else None
        copied: list[Any] = [None, None]  # each buffer's last copy out: an event on the copy stream
        n = 0
        self._go()
        try:
            for i, bucket in enumerate(ranges):
                for a, b in bucket:
                    k, n = n % 2, n + 1
                    slot = slots[k][: b - a]
                    if copied[k] is not None:
                        torch.cuda.current_stream(group.device).wait_event(copied[k])
                    group.wait(group.broadcast(slot))  # the current stream now follows the broadcast
                    if outs is not None and copier is None:
                        outs[i][a:b].copy_(slot)
                    elif outs is not None and copier is not None:
                        copier.wait_stream(torch.cuda.current_stream(group.device))
                        with torch.cuda.stream(copier):
                            outs[i][a:b].copy_(slot, non_blocking=True)
                        copied[k] = copier.record_event()
        except BaseException:
            # a failed broadcast closes the group, which unlocks the host memory the copies out write: none
            # may still be under way then. Only the copy stream is waited for: its copies follow broadcasts
            # that completed, where the device's other streams may hold a kernel of the failed one
            if copier is not None:
                copier.synchronize()
            raise
        # the copies out, each after its broadcast (not the whole device: an engine's forward runs there)
        if copier is not None:
            copier.synchronize()
        return [] if outs is None else outs


class Background:
    """One piece of the weight group's work (joining it, receiving a version) on a thread of its own, so that
    the engine's loop, which runs the worker call that started it, goes on stepping. On a GPU it runs on a
    CUDA stream of its own: its collectives wait for nothing the engine's forward queued."""

    def __init__(self, what: str, work: Callable[[], None], device: torch.device | None) -> None:
        self.what = what
        self.error: str | None = None  # the work's error, as text
        self._thread = threading.Thread(
            target=self._run, args=(work, device), name=f"vcpo-{what}", daemon=True
        )
        self._thread.start()

    def _run(self, work: Callable[[], None], device: torch.device | None) -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    work()
                stream.synchronize()  # what it received is whole before anyone reads it on another stream
            else:
                work()
        except BaseException as exc:
            log.warning("weight group %s failed: %s", self.what, exc)
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the work to end; False if it is still running after ``timeout_s``."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def state(self) -> str | None:
        """None once the work ended well; "running"; or its error."""
        return "running" if self.running else self.error
