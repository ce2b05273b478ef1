"""What travels over the weight group (``weight_group.py``): :class:`CollectivePublisher` on rank 0 sends,
``receiver.py``'s ``CollectiveReceiver`` receives. Design: docs/design/weight-transport.md, "A version on the wire".

    announce  rank 0 sets ``announce/<n>`` = version in the group's store; receivers poll for it (no collective
              is pending while the group is idle, so no timeout runs), then enter the broadcast
    header    int64 [3] (version, header bytes, buckets), then the header: JSON of the tensors' names, dtypes
              and shapes (Hugging Face naming) and the bucket size, from which both sides derive the layout
    buckets   uint8 pieces of at most the bucket size (``buckets.py``) out of rank 0's staged copy; receivers'
              tensors are views of their bucket buffers, on their own device
    vote      an all-reduce every rank enters once it has it all: completed, it commits the version on every
              rank; a failed collective anywhere discards it on every rank, and the group must be re-formed

No checksums, as in vLLM's and torch's own weight broadcasts: under NCCL hashing a bucket would copy it to the host.
The packing is not vLLM's ``packed_tensor`` producer and consumer: they run on CUDA streams only (no gloo, so no
CPU run or CI), broadcast through vLLM's PyNccl group, which has no timeout, and would make the learner import vLLM.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from services.weight_transport.broadcast_thread import cleared, leave_behind, start
from services.weight_transport.buckets import (
    DEFAULT_BUCKET_BYTES,
    TransferStats,
    aligned,
    bucket_layout,
    flat_bytes,
    pieces,
)
from services.weight_transport.tensors import TensorSpec, check_exhausted, next_checked
from services.weight_transport.weight_group import TransferFailed, WeightGroup

log = logging.getLogger(__name__)
# CUDA: one background-broadcast stream per device for the process's life. torch's caching allocator reuses a
# freed block only on its last stream: a stream per publisher would leave each old epoch's bucket buffers
# reserved and unusable (until a failed allocation makes the allocator synchronize and free its cache)
_STREAMS: dict[torch.device, Any] = {}
IN_FLIGHT = 4  # pieces queued at a time from a staged version on the group's device


# above this many MiB torch's pinned allocator makes allocations of the exact size and does not cache them
PINNED_EXACT_MB = 64


@functools.cache
def _pinned_allocator() -> bool:
    """Whether host buffers are page-locked here (CUDA is there); configures torch's pinned allocator once."""
    if not torch.cuda.is_available():
        return False
    settings = f"pinned_max_round_threshold_mb:{PINNED_EXACT_MB},pinned_max_cached_size_mb:{PINNED_EXACT_MB}"
    try:
        torch._C._accelerator_setAllocatorSettings(settings)
    except Exception as exc:  # a torch without these options: its buffers are rounded up and cached
        log.warning("torch's pinned allocator took no %s (%s): staging buffers are rounded up", settings, exc)
    return True


class PinnedStaging:
    """The publisher's host staging buffer, page-locked where CUDA is there, kept for the next version (replaced
    only by a bigger one). torch's pinned allocator is set to make large buffers at their exact size and free
    them when dropped: by default it rounds up to a power of two and caches, so a 65 GB version would pin
    128 GB of the learner's host for the run's life."""

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() < nbytes:
            self._tensor = None  # freed once no view of it is left
            self._tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=_pinned_allocator())
        return self._tensor[:nbytes]

    def release(self) -> None:
        self._tensor = None


class BroadcastOverdue(TransferFailed):
    """The background broadcast in flight had not ended when its caller could wait no longer."""


class CollectivePublisher:
    """Rank 0: broadcasts versions, one ``send`` or ``send_background`` each; every receiver calls ``receive``."""

    def __init__(
        self,
        group: WeightGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        staging: PinnedStaging | None = None,
    ) -> None:
        """``staging``: the coordinator's, kept across epochs (a page-locked buffer of a model's size is costly)."""
        if group.rank != 0:
            raise ValueError(
                f"the publisher is rank 0 of the weight group, this process is rank {group.rank}"
            )
        self.group, self.bucket_bytes = group, bucket_bytes
        # under NCCL, every receiver ready (WeightGroup.wait_ready) before the first collective of a version;
        # gloo's collectives wait in its threads, and fail at once where a receiver died (it waits no longer)
        self.await_ready = group.backend == "nccl"
        self._buffers: list[torch.Tensor] = []
        self._owns_staging = staging is None
        self._staging = staging if staging is not None else PinnedStaging()
        self._stream: Any = None  # CUDA: the background broadcast's own stream
        self._pending: Future[TransferStats] | None = None
        self._thread: threading.Thread | None = None  # the last background broadcast's
        self._behind: Future[TransferStats] | None = None  # one that did not give up after an abort

    def send(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> TransferStats:
        """Broadcast one version: ``tensors`` in the order of ``specs``, each valid only until the next is
        requested (a bucketed ZeRO-3 gather). Returns once every receiver voted to commit it; raises
        :class:`TransferFailed` where the broadcast failed."""
        return self._broadcast(version, specs, self._stage(version, specs, tensors))

    def send_background(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> float:
        """:meth:`send` with the broadcast on a background thread (the learner's next step overlaps it); its
        failure is raised by the next call here, to :meth:`send` or :meth:`wait`. Returns the seconds blocked."""
        t0 = time.monotonic()
        buckets = self._stage(version, specs, tensors)
        # a daemon, not an executor's thread: see broadcast_thread.py
        self._thread, self._pending = start(
            f"weight-broadcast-{version}", self._send_in_thread, version, specs, buckets
        )
        return time.monotonic() - t0

    def _stage(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """The version packed into the staging buffer, one 64-byte aligned view per bucket. The previous
        broadcast, which reads that buffer, is waited for first (its failure raised here, before anything of
        this one is read); a source that fails or does not match ``specs`` raises with nothing announced."""
        if not specs:
            raise ValueError(f"version {version} has no tensors")
        self.wait()
        layout = bucket_layout(specs, self.bucket_bytes)
        starts = [0]
        for bucket in layout[:-1]:
            starts.append(aligned(starts[-1] + bucket.nbytes))
        staging = self._staging.take(starts[-1] + layout[-1].nbytes)
        buckets, source = [], iter(tensors)
        for bucket, first in zip(layout, starts, strict=True):
            buf = staging[first : first + bucket.nbytes]
            for i, offset in bucket.items:
                buf[offset : offset + specs[i].nbytes].copy_(flat_bytes(next_checked(i, specs, source)))
            buckets.append(buf)
        check_exhausted(source)
        return buckets

    def _send_in_thread(
        self, version: int, specs: Sequence[TensorSpec], buckets: list[torch.Tensor]
    ) -> TransferStats:
        if self.group.device.type != "cuda":
            return self._broadcast(version, specs, buckets)
        # the current CUDA device is per thread (this one's is not set); a stream of its own, or its copies and
        # collectives would queue behind the training's kernels on the default stream, and these in turn
        device = self.group.device
        self._stream = (
            self._stream or _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        )
        with torch.cuda.device(self.group.device), torch.cuda.stream(self._stream):
            try:
                return self._broadcast(version, specs, buckets)
            finally:  # a failed send may leave copies out of the staging buffer queued: it is reused, or unmapped
                self._stream.synchronize()

    def failure(self) -> BaseException | None:
        """The background broadcast's failure once it has ended in one (then no longer raised by :meth:`wait`),
        else None; never waits."""
        pending = self._pending
        error = pending.exception() if pending is not None and pending.done() else None
        if error is None:
            return None
        self._pending = None
        return cleared(error)

    def wait(self, timeout_s: float | None = None) -> TransferStats | None:
        """The stats of the background broadcast in flight, once it has ended (None if there is none); raises
        :class:`TransferFailed` if it failed, :class:`BroadcastOverdue` if it has not ended within
        ``timeout_s`` (it is still in flight: abort the group, or wait again)."""
        pending = self._pending
        if pending is None:
            return None
        try:
            error = pending.exception(timeout=timeout_s)
        except FutureTimeout:
            raise BroadcastOverdue(
                f"the background broadcast had not ended after {timeout_s:g}s (a receiver stuck in it?)"
            ) from None
        self._pending = None
        if error is not None:
            error = cleared(error)
            if isinstance(error, TransferFailed):
                raise error
            # the background broadcast's own (a segment it could not reserve after its vote): a failed
            # broadcast all the same, not a failure of the version being staged
            raise TransferFailed(str(error) or type(error).__name__) from error
        return pending.result()

    def abort_overdue(self, overdue: BroadcastOverdue, timeout_s: float | None) -> None:
        """Abort the background broadcast :meth:`wait` found ``overdue``: the group is marked failed and
        closed, and its thread, which gives up within a poll, waited for up to ``timeout_s`` more. It counts
        as failed even where it ended meanwhile (rank 0 cannot tell that every receiver committed it), so its
        version goes again through the broker. A thread still going then is left behind (logged)."""
        log.warning("%s: aborting the weight group", overdue)
        pending = self._pending
        self.group.abort()
        try:
            self.wait(timeout_s)
        except BroadcastOverdue:
            log.error(
                "the background broadcast had not given up %gs after its group was aborted: left behind",
                timeout_s or 0.0,
            )
            self._pending, self._behind = None, pending
        except Exception as exc:  # its own failure now: the abort's
            log.debug("the aborted broadcast ended: %s", exc)

    def close(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait for a background broadcast and stop its thread; returns the broadcast's failure (logged, not
        raised), for the caller to count, else None. One still in flight after ``timeout_s`` is aborted
        (:meth:`abort_overdue`), and is that failure: the wait for it is at most twice ``timeout_s``."""
        failure: BaseException | None = None
        try:
            self.wait(timeout_s)
        except BroadcastOverdue as exc:
            self.abort_overdue(exc, timeout_s)
            failure = exc
        except Exception as exc:  # a TransferFailed, or anything else the thread raised
            log.warning("the last background broadcast failed: %s", exc)
            failure = exc
        behind, thread, self._thread = self._behind, self._thread, None
        if behind is None:
            if thread is not None:
                thread.join()  # its broadcast has ended: it is returning
            self._let_go()
            return failure
        # what the thread left behind may still use (the staging buffer) is let go once it ends, if it does
        self._behind = None
        if thread is not None:
            leave_behind(thread, behind, self._let_go)
        if self._stream is not None and _STREAMS.get(self.group.device) is self._stream:
            del _STREAMS[self.group.device]  # later publishers' broadcasts must not queue behind it
        return failure

    def _let_go(self) -> None:
        self._buffers.clear()
        if self._owns_staging:
            self._staging.release()

    def _broadcast(
        self, version: int, specs: Sequence[TensorSpec], buckets: list[torch.Tensor]
    ) -> TransferStats:
        """Announce, header, buckets, vote; a failed collective aborts the group: :class:`TransferFailed`."""
        t0 = time.monotonic()
        tensors = [[s.name, s.dtype, list(s.shape)] for s in specs]
        header = json.dumps({"bucket_bytes": self.bucket_bytes, "tensors": tensors}).encode()
        group = self.group
        try:
            group.announce(version)
            if self.await_ready:  # in the store: no kernel on this GPU waits for a late receiver
                group.wait_ready(group.broadcasts + 1)
            head = torch.tensor([version, len(header), len(buckets)], dtype=torch.int64, device=group.device)
            group.wait(group.broadcast(head))
            group.broadcasts += 1
            group.wait(
                group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
            )
            if self.await_ready:  # and once they made their buffers (a whole model's)
                group.wait_ready(group.broadcasts, "data")
            self._send_pieces(buckets)
            group.commit()
        except Exception as exc:  # a collective failed (a receiver died, a timeout): the group is broken
            group.abort()
            raise TransferFailed(f"version {version}: broadcast failed: {exc}") from exc
        return TransferStats(
            version, len(specs), sum(s.nbytes for s in specs), len(buckets), time.monotonic() - t0
        )

    def _send_pieces(self, buckets: list[torch.Tensor]) -> None:
        """Every bucket in its :func:`pieces`. gloo: straight from the staging, :data:`IN_FLIGHT` queued so the
        sockets never idle. NCCL: through two piece-sized device buffers, the next copied (non-blocking) while
        the last travels, so the GPU holds two pieces beside the training, never a version."""
        group = self.group
        in_place = buckets[0].device == group.device
        in_flight: deque[Any] = deque()
        sent = 0
        for bucket in buckets:
            for a, b in pieces(bucket.numel(), self.bucket_bytes):
                if len(in_flight) >= (IN_FLIGHT if in_place else 2):  # copying: the next buffer's last use
                    group.wait(in_flight.popleft())
                piece = bucket[a:b]
                if not in_place:
                    buf = self._buffer(sent % 2, b - a)
                    buf.copy_(piece, non_blocking=True)  # queued before the broadcast, on this stream
                    piece, sent = buf, sent + 1
                in_flight.append(group.broadcast(piece))
        for work in in_flight:
            group.wait(work)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.group.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot][:nbytes]
