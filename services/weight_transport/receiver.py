"""The collective transport's receiving side: each sampler engine's worker (ranks 1..N of the weight group)
takes every version rank 0 broadcasts (``collective.py``), in the :class:`Background` so that its engine goes on
generating."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable

import torch

from services.weight_transport.buckets import Bucket, TransferStats, bucket_layout, pieces
from services.weight_transport.tensors import TensorSpec, torch_dtype
from services.weight_transport.weight_group import TransferFailed, WeightGroup, first_line

log = logging.getLogger(__name__)


class NoRoom(TransferFailed):
    """This receiver's device has no room for a version: the group's other ranks were told (the version failed
    for all), and this member should take versions through the broker instead of failing every broadcast."""


class CollectiveReceiver:
    """Ranks 1..N: receive versions as they are broadcast."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]], TransferStats]:
        """Receive the announced version into buffers on the group's device (under NCCL the worker's own GPU:
        its engine loads it device to device); returns ``(version, [(name, tensor)] in order, stats)`` once
        every member has voted to commit it. Raises :class:`TransferFailed` if any part failed on any member."""
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
            buffers = self._buffers(layout, version)
            # rank 0 issues none of the data before every receiver has made its buffers (``wait_ready``)
            group.ready(group.broadcasts, "data")
            works = [group.broadcast(buf[a:b]) for buf in buffers for a, b in pieces(buf.numel(), piece)]
            for work in works:
                group.wait(work)
        except NoRoom as exc:  # this rank's own, though a TransferFailed: marked for the others, as below
            raise NoRoom(str(group.part_failed(f"version {version}: receiving failed: {exc}"))) from exc
        except TransferFailed as exc:  # the group's: marked for every rank already
            group.close()
            raise TransferFailed(f"version {version}: receiving failed: {exc}") from exc
        except Exception as exc:  # this rank's own (a bad header, a CUDA error)
            # marked for the others before closing: the publisher and the other receivers would otherwise wait
            # in the next bucket until the group's timeout (an NCCL peer is not woken by this rank's abort)
            raise group.part_failed(f"version {version}: receiving failed: {first_line(exc)}") from exc
        try:
            group.commit()
        except Exception as exc:
            group.close()
            raise TransferFailed(f"version {version}: the commit vote failed: {exc}") from exc
        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in zip(layout, buffers, strict=True):  # views: no copy
            for i, offset in bucket.items:
                s = specs[i]
                view = buf[offset : offset + s.nbytes].view(torch_dtype(s.dtype)).reshape(s.shape)
                tensors.append((s.name, view))
        nbytes = sum(s.nbytes for s in specs)
        return version, tensors, TransferStats(version, len(specs), nbytes, n_buckets, time.monotonic() - t0)

    def _buffers(self, layout: list[Bucket], version: int) -> list[torch.Tensor]:
        """One buffer per bucket on the group's device; a GPU without room for them names what to change."""
        device = self.group.device
        try:
            return [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in layout]
        except torch.OutOfMemoryError as exc:
            total = sum(b.nbytes for b in layout)
            raise NoRoom(
                f"version {version} ({total / 2**30:.2f} GiB) does not fit on {device} beside the engine: lower "
                "sampler.gpu_memory_utilization so that a version fits in what the engine leaves free, or set "
                f'weight_broker.transport = "tcp" ({first_line(exc)})'
            ) from exc


@functools.cache
def _stream(device: torch.device) -> torch.cuda.Stream:
    """The weight group's work's CUDA stream on ``device``, one for the process's life: torch's caching
    allocator reuses a freed block only on the stream it was allocated on, so a stream per version would leave
    each version's receive buffers reserved, out of every later one's reach."""
    return torch.cuda.Stream(device)


class Background(threading.Thread):
    """One piece of the weight group's work (joining it, receiving a version) on a thread of its own, so that
    the engine's loop, which runs the worker call that started it, goes on stepping. On a GPU it runs on a
    CUDA stream of its own: its collectives wait for nothing the engine's forward queued."""

    def __init__(self, what: str, work: Callable[[], None], device: torch.device | None) -> None:
        super().__init__(name=f"vcpo-{what}", daemon=True)
        self.what, self._work, self._device = what, work, device
        self.error: str | None = None  # the work's error, as text
        self.start()

    def run(self) -> None:
        device = self._device
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
                stream = _stream(device)
                with torch.cuda.stream(stream):
                    self._work()
                stream.synchronize()  # what it received is whole before anyone reads it on another stream
            else:
                self._work()
        except BaseException as exc:
            log.warning("weight group %s failed: %s", self.what, exc)
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def running(self) -> bool:
        return self.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the work to end; False if it is still running after ``timeout_s``."""
        self.join(timeout_s)
        return not self.is_alive()

    def state(self) -> str | None:
        """None once the work ended well; "running"; or its error."""
        return "running" if self.is_alive() else self.error
