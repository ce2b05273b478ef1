"""The collective weight transport: the learner broadcasts a version into every receiving engine worker.

The weight group (``weight_group.py``) joins the publisher (rank 0, the learner's exporting rank) and every
receiver (each sampler engine's workers, ranks 1..N): NCCL on GPU, gloo on CPU, the same code. This module is
what travels over it: :class:`CollectivePublisher` sends, ``receiver.py``'s ``CollectiveReceiver`` receives.
A version travels as:

    announce  rank 0 sets ``announce/<n>`` = version in the group's store; receivers poll for it (no collective
              is pending while the group is idle, so no timeout runs), then enter the broadcast
    header    int64 [3] (version, header bytes, buckets), then the header: JSON of the tensors' names, dtypes
              and shapes in Hugging Face naming, and the bucket size; both sides derive the same bucket layout
    buckets   one uint8 broadcast per bucket: a tensor as large as a bucket straight from its own bytes, smaller
              ones packed (64-byte aligned), the next packed while the last travels; receivers' tensors are
              views of their bucket buffers, on the receiver's device (a GPU worker's GPU under NCCL: the
              engine loads the version from there, device to device)
    vote      all-reduce MIN of every rank's "I have it all": 1 commits the version on every rank, anything
              else (or a failed collective) discards it on every rank

The buckets carry no checksums, as vLLM's and torch's own weight broadcasts carry none: under NCCL (the GPU
default) hashing a bucket would copy it to the host. The broker path keeps its xxh3 checksums of the bytes it
stores and serves.

Nothing is handed to an engine before the vote, so a broadcast that fails part-way (a receiver killed, a
timeout, a source that failed) leaves every engine on its previous version. A failed collective leaves the group
unusable: its members close it and the control plane forms a new one (``GroupSpec.epoch``).
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
    WHOLE,
    Bucket,
    TransferStats,
    bucket_layout,
    check_exhausted,
    flat_bytes,
    next_checked,
    pieces,
)
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.weight_group import TransferFailed, WeightGroup

log = logging.getLogger(__name__)
# CUDA: the background broadcasts' stream of each device, one for the process's life. torch's caching allocator
# reuses a freed block only on the stream that last used it: with a stream per publisher, each new epoch's
# publisher would leave its predecessor's bucket buffers reserved and unusable (until an allocation that
# fails makes the allocator synchronize the device and free its cache)
_STREAMS: dict[torch.device, Any] = {}
IN_FLIGHT = 4  # pieces queued at a time from a staged version (_send_staged)


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
    """The publisher's host staging buffer: exactly the size asked for, page-locked where CUDA is there, kept
    for the next version (replaced by a new one if that is bigger). From torch's pinned allocator, set to make
    large buffers at their size and free them when dropped: by default it rounds each allocation up to a power
    of two and caches it, and a 65 GB version would pin 128 GB of the learner's host for the run's life."""

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
    """Rank 0: broadcasts versions. ``send`` is called once per version; every receiver calls ``receive``."""

    def __init__(
        self,
        group: WeightGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        staging: PinnedStaging | None = None,
    ) -> None:
        """``staging``: the host staging buffer to use, kept by the caller beyond this publisher (the
        coordinator's, for every epoch's publisher: one of the model's size, page-locked, is costly to make
        again for each)."""
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

    def send_background(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> float:
        """Copy the version into a staging buffer of the model's size (host memory, pinned when CUDA is
        there), then broadcast it from a background thread, so the learner's next step overlaps the broadcast.
        Returns the seconds the caller was blocked (waiting for the previous broadcast, and the copy).

        One version is in flight at a time: the previous one is waited for first, and its failure is raised
        here (:class:`TransferFailed`) before anything of this one is staged. :meth:`wait` waits for the last.
        """
        t0 = time.monotonic()
        if not specs:
            raise ValueError(f"version {version} has no tensors")
        self.wait()
        staged, whole = self._stage(specs, tensors)
        # a daemon thread of its own (broadcast_thread.py); close() joins it, unless left behind
        self._thread, self._pending = start(
            f"weight-broadcast-{version}", self._send_in_thread, version, specs, staged, whole
        )
        return time.monotonic() - t0

    def _send_in_thread(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        staged: list[tuple[str, torch.Tensor]],
        whole: torch.Tensor,
    ) -> TransferStats:
        if self.group.device.type != "cuda":
            return self.send(version, specs, iter(staged), staged=whole)
        # the current CUDA device is per thread (this one's is not set); a stream of its own, or its copies and
        # collectives would queue behind the training's kernels on the default stream, and these in turn
        device = self.group.device
        self._stream = (
            self._stream or _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        )
        with torch.cuda.device(self.group.device), torch.cuda.stream(self._stream):
            try:
                return self.send(version, specs, iter(staged), staged=whole)
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

    def _stage(
        self, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        """The version copied into the staging buffer, packed as one unbounded bucket: views into it, and its
        bytes. Tensors that are views of it already (``send`` of what ``send_background`` staged) stay where
        they are."""
        [whole] = bucket_layout(specs, WHOLE)
        staging = self._staging.take(whole.nbytes)  # the previous version's vote has ended
        staged, source = [], iter(tensors)
        for i, offset in whole.items:
            tensor = next_checked(i, specs, source)
            view = staging[offset : offset + specs[i].nbytes]
            flat = flat_bytes(tensor)
            if flat.data_ptr() != view.data_ptr() or flat.device != view.device:
                view.copy_(flat)
            staged.append((specs[i].name, view.view(tensor.dtype).reshape(tensor.shape)))
        check_exhausted(source)
        if staging.device.type == "cuda":  # exported from another thread, whose stream is not this one's
            torch.cuda.current_stream(staging.device).synchronize()
        return staged, staging[: whole.nbytes]

    def abort_overdue(self, overdue: BroadcastOverdue, timeout_s: float | None) -> None:
        """Abort the background broadcast that :meth:`wait` found ``overdue``: the group is marked failed and
        closed, and its thread gives up within a poll, waited for up to ``timeout_s`` more. It is a failed
        broadcast even where it ended meanwhile: rank 0 cannot tell that every receiver committed it (the
        abort's mark may have stopped one just before), and counted, its version is published again through
        the broker. A thread still going after that is left behind (logged): a daemon that nothing waits for
        again, whose buffers are let go once it ends, and whatever it sends goes into a closed group."""
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

    def send(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        staged: torch.Tensor | None = None,
    ) -> TransferStats:
        """Broadcast one version: ``specs`` (names, dtypes, full shapes, in order) first, then ``tensors`` in
        the same order, each valid only until the next is requested (a bucketed ZeRO-3 gather is). Returns once
        every receiver has voted to commit; raises :class:`TransferFailed` otherwise. ``staged``: the version's
        bytes as :meth:`send_background` staged them (``tensors`` are views of it, valid throughout): where
        it is on the group's device, its buckets go out straight from it (:meth:`_send_staged`)."""
        t0 = time.monotonic()
        if not specs:
            raise ValueError(f"version {version} has no tensors")
        layout = bucket_layout(specs, self.bucket_bytes)
        fields = {
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, s.dtype, list(s.shape)] for s in specs],
        }
        header = json.dumps(fields).encode()
        group, committed = self.group, False
        source_error: Exception | None = None  # the source's, reported after the vote
        try:
            group.announce(version)
            if self.await_ready:  # in the store: no kernel on this GPU waits for a late receiver
                group.wait_ready(group.broadcasts + 1)
            head = torch.tensor([version, len(header), len(layout)], dtype=torch.int64, device=group.device)
            group.wait(group.broadcast(head))
            group.broadcasts += 1
            group.wait(
                group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
            )
            if self.await_ready:  # and once they made their buffers (a whole model's)
                group.wait_ready(group.broadcasts, "data")
            if staged is not None and staged.device == group.device:
                self._send_staged(layout, specs, staged)
            else:
                source_error = self._send_buckets(layout, specs, iter(tensors))
            committed = group.all_ok(source_error is None)
        except Exception as exc:  # a collective failed (a receiver died, a timeout): the group is broken
            group.abort()
            raise TransferFailed(f"version {version}: broadcast failed: {exc}") from exc
        if source_error is not None:
            raise TransferFailed(f"version {version}: {source_error}") from source_error
        if not committed:
            raise TransferFailed(f"version {version}: a receiver voted against it")
        return TransferStats(
            version, len(specs), sum(s.nbytes for s in specs), len(layout), time.monotonic() - t0
        )

    def _in_place(self, flat: torch.Tensor) -> bool:
        """Whether a bucket's one tensor can be broadcast from its own bytes: it is on the group's device."""
        return flat.device == self.group.device

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.group.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot][:nbytes]

    def _send_staged(self, layout: list[Bucket], specs: Sequence[TensorSpec], staged: torch.Tensor) -> None:
        """Every bucket straight from the staging buffer, where each lies whole: its tensors are packed there
        as in the bucket (both 64-byte aligned from a 64-byte aligned start). No copy, and :data:`IN_FLIGHT`
        pieces queued at a time (the staged version stays valid throughout): over gloo on one host the
        broadcast then runs at the sockets' rate (packed buckets copied through a buffer one at a time left it
        idle between them)."""
        [whole] = bucket_layout(specs, WHOLE)
        start = dict(whole.items)
        in_flight: deque[Any] = deque()
        for n, bucket in enumerate(layout):
            first = start[bucket.items[0][0]]
            if any(start[i] - first != offset for i, offset in bucket.items):  # bucket_layout changed?
                raise ValueError(f"the staged version does not hold bucket {n} as one range")
            buf = staged[first : first + bucket.nbytes]
            for a, b in pieces(bucket.nbytes, self.bucket_bytes):
                if len(in_flight) >= IN_FLIGHT:
                    self.group.wait(in_flight.popleft())
                in_flight.append(self.group.broadcast(buf[a:b]))
        for work in in_flight:
            self.group.wait(work)

    def _send_buckets(
        self, layout: list[Bucket], specs: Sequence[TensorSpec], source: Any
    ) -> Exception | None:
        """Broadcast every bucket in its :func:`pieces`; returns the source's error, if any.

        A bucket of one tensor already on the group's device goes out from the tensor's own bytes (no copy),
        and the source is not advanced until it has gone (a gathered tensor is valid only until the next is
        requested). Anything else travels through one of two piece-sized buffers, the next filled while the
        last travels: packed buckets, and a weight in host memory (staged), whatever its size, so the device
        holds two buffers of at most the bucket size, never one of the largest weight. A source that fails or
        breaks the header does not break the group: the remaining pieces still go out (their contents void) so every receiver reaches the vote, where this
        rank votes the version down."""
        error: Exception | None = None
        in_flight: list[Any] = [None, None]
        sent = 0  # pieces through the buffers
        for bucket in layout:
            ranges = pieces(bucket.nbytes, self.bucket_bytes)
            whole = None  # the bucket's one tensor, as flat bytes wherever it is
            if error is None and len(bucket.items) == 1:
                try:
                    whole = flat_bytes(next_checked(bucket.items[0][0], specs, source))
                    if whole.device.type != "cpu" and self.group.device.type == "cpu":
                        # a GPU source over gloo (``send`` without staging): gloo moves host bytes, so one
                        # copy to the host, then broadcast in place
                        whole = whole.cpu()
                except Exception as exc:  # reported after the vote
                    error = exc
            if whole is not None and self._in_place(whole):
                works = [self.group.broadcast(whole[a:b]) for a, b in ranges]
                for work in works:
                    self.group.wait(work)
                continue
            for a, b in ranges:
                slot = sent % 2
                sent += 1
                if in_flight[slot] is not None:
                    self.group.wait(in_flight[slot])
                buf = self._buffer(slot, b - a)
                if whole is not None:
                    buf.copy_(whole[a:b], non_blocking=True)
                elif error is None:
                    try:
                        # straight from the source (staged host memory, pinned under CUDA), no device copy of
                        # each weight on the way; the host waits for the broadcast, queued after the copies
                        for i, offset in bucket.items:
                            flat = flat_bytes(next_checked(i, specs, source))
                            buf[offset : offset + specs[i].nbytes].copy_(flat, non_blocking=True)
                    except Exception as exc:  # reported after the vote
                        error = exc
                in_flight[slot] = self.group.broadcast(buf)
        for work in in_flight:
            if work is not None:
                self.group.wait(work)
        if error is None:
            try:
                check_exhausted(source)
            except ValueError as exc:
                error = exc
        return error
