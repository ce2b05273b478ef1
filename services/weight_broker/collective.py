"""The collective weight transport: the learner broadcasts a version into every receiving engine worker.

One process group joins the publisher (rank 0, the learner's exporting rank) and every receiver (each sampler
engine's workers, ranks 1..N): NCCL on GPU, gloo on CPU, the same code. A version travels as:

    announce  rank 0 sets ``announce/<n>`` = version in the group's store; receivers poll for it (no collective
              is pending while the group is idle, so no timeout runs), then enter the broadcast
    header    int64 [3] (version, header bytes, buckets), then the header: JSON of the tensors' names, dtypes
              and shapes in Hugging Face naming, and the bucket size; both sides derive the same bucket layout
    buckets   one uint8 broadcast per bucket: a tensor as large as a bucket straight from its own bytes, smaller
              ones packed (64-byte aligned), the next packed while the last travels; receivers' tensors are
              views of their bucket buffers (on a GPU worker: of host copies, see ``bounce``)
    digests   int64 [buckets]: each bucket's xxh3-64 when the publisher holds its buckets on the CPU (zeros
              when they are on a GPU: hashing there would copy every bucket to the host)
    vote      all-reduce MIN of every rank's "I have it all, digests match": 1 commits the version on every
              rank, anything else (or a failed collective) discards it on every rank

Nothing is handed to an engine before the vote, so a broadcast that fails part-way (a receiver killed, a
timeout, a bad digest) leaves every engine on its previous version. A failed collective leaves the group
unusable: its members close it and the control plane forms a new one (:class:`GroupSpec` ``epoch``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import xxhash

from services.weight_broker.tensors import TensorSpec, dtype_name, torch_dtype

log = logging.getLogger(__name__)

_RETIRED: list[Any] = []  # closed process groups, kept from their destructors (see WeightGroup.close)
ALIGN = 64  # bytes: every tensor starts at a multiple of this in its bucket (any dtype's view is aligned)
DEFAULT_BUCKET_BYTES = 256 << 20


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


def arrive(store: Any, key: str, expected: int, timeout_s: float, poll_s: float = 0.02) -> int:
    """Count this process in at ``key`` of ``store`` and wait until ``expected`` have arrived; returns how many
    had arrived (fewer than ``expected`` after ``timeout_s``)."""
    arrived = int(store.add(key, 1))
    deadline = time.monotonic() + timeout_s
    while arrived < expected and time.monotonic() < deadline:
        time.sleep(poll_s)
        arrived = int(store.add(key, 0))
    return arrived


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


class WeightGroup:
    """This process's membership of the weight group: a process group outside torch.distributed's default
    one (which ZeRO-3 or vLLM's tensor parallelism may own), formed over its own TCP store."""

    def __init__(
        self, spec: GroupSpec, rank: int, device: torch.device | None = None, store: Any = None
    ) -> None:
        """Join as ``rank``: rank 0 hosts the store (or passes ``store``, a master it opened already, to learn a
        free port before announcing the spec). Every rank first waits, up to ``form_timeout_s``, until all
        ``world_size`` have arrived (:class:`TransferFailed` otherwise), so a member that never comes costs the
        others that long, not the collective timeout."""
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside the weight group of {spec.world_size}")
        import torch.distributed as dist

        self.spec, self.rank = spec, rank
        # where this member's buffers live: NCCL moves CUDA tensors only; gloo moves CPU tensors, and CUDA ones
        # through the host (the GPU test of the receiver's bounce path uses that)
        if spec.backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = device or torch.device("cpu")
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            self._store = store if store is not None else open_store(spec, master=rank == 0)
            prefixed = dist.PrefixStore(spec.prefix(), self._store)
            arrived = arrive(prefixed, "ranks_arrived", spec.world_size, spec.form_timeout_s)
        except Exception as exc:
            raise TransferFailed(
                f"weight group epoch {spec.epoch} at {spec.host}:{spec.port}: {exc}"
            ) from exc
        if arrived < spec.world_size:
            raise TransferFailed(
                f"weight group epoch {spec.epoch}: {arrived} of {spec.world_size} ranks arrived "
                f"within {spec.form_timeout_s:.0f}s"
            )
        self.watch = AnnouncementWatch(prefixed, self.close)  # receivers: what rank 0 announces
        self._announcements = prefixed  # rank 0 sets announce/<n>
        self._seq = 0  # announcements made (rank 0)
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            # connecting (every rank's address through the store) is bounded by the forming timeout, as the
            # arrival is: a member that arrived and then died would otherwise hold every other rank here for
            # the whole collective timeout (a chaos run saw a sampler's join wait 120 s for a killed broker)
            try:
                self._pg = dist.ProcessGroupGloo(
                    prefixed,
                    rank,
                    spec.world_size,
                    timedelta(seconds=min(spec.form_timeout_s, spec.timeout_s)),
                )
            except Exception as exc:
                raise TransferFailed(
                    f"weight group epoch {spec.epoch}: the ranks did not connect within "
                    f"{spec.form_timeout_s:.0f}s: {exc}"
                ) from exc
            self._pg.set_timeout(timeout)
        self._closed = False

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (in place on the others); returns the work to wait on."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._pg.broadcast([tensor], opts)

    def announce(self, version: int) -> None:
        """Rank 0, before each broadcast: tell every member a version is coming (:meth:`next_announcement`).
        Members wait for this, not inside a collective, so an idle group never reaches its timeout."""
        self._seq += 1
        self._announcements.set(f"announce/{self._seq}", str(version))

    def next_announcement(self, timeout_s: float, poll_s: float = 0.02) -> int | None:
        """A receiver: the version of the next broadcast, once rank 0 announces it (then call ``receive``);
        None after ``timeout_s`` without one. Raises :class:`TransferFailed` (closing the group) if the
        store is gone with its host, the publisher."""
        return self.watch.next(timeout_s, poll_s)

    def all_ok(self, ok: bool) -> bool:
        """True on every rank if every rank passed True."""
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.wait(self._pg.allreduce([t], opts))
        return bool(t.item() == 1)

    def wait(self, work: Any, check_every_s: float = 0.05) -> None:
        """Wait for a collective of this group, giving up (:class:`TransferFailed`, the group closed) as soon
        as another rank has declared it failed in the store: rank 0 after a failed broadcast, or a receiver
        whose own part failed (a peer died). Without it a rank waiting for bytes that will never come waits
        out the whole timeout, since neither a closed gloo group nor a dead peer wakes every rank: a chaos run
        saw rank 0 wait 120 s in a commit vote whose failure the broker had seen at once. A rank whose
        collective fails marks it so, before raising the collective's own error."""
        nap, last = 5e-5, time.monotonic()
        while not work.is_completed():
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
            if time.monotonic() - last < check_every_s:
                continue
            last = time.monotonic()
            try:
                failed = self._announcements.check(["failed"])
                why = self._announcements.get("failed").decode(errors="replace") if failed else ""
                why = why if why and why != "1" else "rank 0 declared the broadcast failed"
            except Exception as exc:
                failed, why = True, f"the weight group's store is unreachable: {exc}"
            if failed:
                self.close()
                raise TransferFailed(why)
        try:
            work.wait()  # raises the collective's own error, if it had one
        except Exception as exc:
            self._mark_failed(f"rank {self.rank}'s part failed: {str(exc).splitlines()[0][:300]}")
            raise

    def _mark_failed(self, why: str) -> None:
        """Tell every rank still waiting in this group's collective to give up (the first mark stays)."""
        try:
            self._announcements.compare_set("failed", "", why)
        except Exception:
            log.debug("could not mark the collective failed", exc_info=True)

    def abort(self) -> None:
        """Rank 0, after a failed broadcast: tell every receiver still waiting in it to give up, then close."""
        self._mark_failed("rank 0 declared the broadcast failed")
        self.close()

    @property
    def closed(self) -> bool:
        """Closed after a failed collective (or by ``close``): the control plane must form a new group."""
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._pg.shutdown()
        except Exception:  # a broken group may refuse a clean shutdown; it is dropped anyway
            log.debug("weight group shutdown raised", exc_info=True)
        # Never let a closed group be destroyed: ~ProcessGroupGloo joins its worker threads, which may still
        # wait on a peer that died, and the garbage collector runs that destructor on whichever thread
        # allocates next. A chaos run saw the broker's receiving thread stuck 75 s in it (the learner's next
        # broadcast waited as long). A closed group keeps a few idle threads and sockets until the process
        # exits; there is one per failed or re-formed epoch.
        _RETIRED.append(self._pg)


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    items: tuple[tuple[int, int], ...]  # (index into the version's tensors, byte offset in the bucket)


def bucket_layout(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """The buckets of a version, in order: tensors packed at 64-byte offsets while they fit ``bucket_bytes``;
    a tensor larger than that travels alone. Publisher and receivers derive it from the same header."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    items: list[tuple[int, int]] = []
    size = 0
    for i, spec in enumerate(specs):
        offset = -(-size // ALIGN) * ALIGN
        if items and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(size, tuple(items)))
            items, offset = [], 0
        items.append((i, offset))
        size = offset + spec.nbytes
    if items:
        buckets.append(Bucket(size, tuple(items)))
    return buckets


def _digest(buffer: torch.Tensor) -> int:
    """xxh3-64 of a CPU byte buffer as a signed int64 (0 for a device buffer: not hashed, see the header)."""
    if buffer.device.type != "cpu" or buffer.numel() == 0:
        return 0
    value = xxhash.xxh3_64_intdigest(memoryview(buffer.numpy()))
    return value - (1 << 64) if value >= 1 << 63 else value


def _next_checked(
    i: int, specs: Sequence[TensorSpec], source: Iterator[tuple[str, torch.Tensor]]
) -> torch.Tensor:
    """The source's next tensor, which must be the header's tensor ``i`` (name, dtype, shape)."""
    spec = specs[i]
    item = next(source, None)
    if item is None:
        raise ValueError(f"the source ended at tensor {i} ({spec.name!r}) of {len(specs)}")
    name, tensor = item
    got = TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))
    if got != spec:
        raise ValueError(f"tensor {i} is {got}, the version's header said {spec}")
    return tensor


def _check_exhausted(source: Iterator[tuple[str, torch.Tensor]]) -> None:
    leftover = next(source, None)
    if leftover is not None:
        raise ValueError(f"the source yielded more tensors than the header named, e.g. {leftover[0]!r}")


@dataclass
class TransferStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class CollectivePublisher:
    """Rank 0: broadcasts versions. ``send`` is called once per version; every receiver calls ``receive``."""

    def __init__(self, group: WeightGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if group.rank != 0:
            raise ValueError(
                f"the publisher is rank 0 of the weight group, this process is rank {group.rank}"
            )
        self.group, self.bucket_bytes = group, bucket_bytes
        self._buffers: list[torch.Tensor] = []
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._pending: Future[TransferStats] | None = None
        self._thread: ThreadPoolExecutor | None = None

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
        staged = self._stage(specs, tensors)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-broadcast")
        self._pending = self._thread.submit(self._send_in_thread, version, specs, staged)
        return time.monotonic() - t0

    def _send_in_thread(
        self, version: int, specs: Sequence[TensorSpec], staged: list[tuple[str, torch.Tensor]]
    ) -> TransferStats:
        if (
            self.group.device.type == "cuda"
        ):  # the current CUDA device is per thread: this thread's is not set
            with torch.cuda.device(self.group.device):
                return self.send(version, specs, iter(staged))
        return self.send(version, specs, iter(staged))

    def wait(self) -> TransferStats | None:
        """The stats of the background broadcast in flight, once it has ended (None if there is none); raises
        :class:`TransferFailed` if it failed."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _stage(
        self, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """The version copied into the staging buffer, packed as one unbounded bucket; views into it."""
        [whole] = bucket_layout(specs, 1 << 62)
        if self._staging.numel() < whole.nbytes:
            self._staging = torch.empty(whole.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        staged, source = [], iter(tensors)
        for i, offset in whole.items:
            tensor = _next_checked(i, specs, source)
            view = self._staging[offset : offset + specs[i].nbytes]
            view.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            staged.append((specs[i].name, view.view(tensor.dtype).reshape(tensor.shape)))
        _check_exhausted(source)
        return staged

    def close(self) -> None:
        """Wait for a background broadcast (its failure is logged, not raised) and stop its thread."""
        try:
            self.wait()
        except TransferFailed as exc:
            log.warning("the last background broadcast failed: %s", exc)
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None

    def send(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> TransferStats:
        """Broadcast one version: ``specs`` (names, dtypes, full shapes, in order) first, then ``tensors`` in
        the same order, each valid only until the next is requested (a bucketed ZeRO-3 gather is). Returns once
        every receiver has voted to commit; raises :class:`TransferFailed` otherwise."""
        t0 = time.monotonic()
        if not specs:
            raise ValueError(f"version {version} has no tensors")
        layout = bucket_layout(specs, self.bucket_bytes)
        header = json.dumps(
            {
                "bucket_bytes": self.bucket_bytes,
                "digests": self.group.device.type == "cpu",
                "tensors": [[s.name, s.dtype, list(s.shape)] for s in specs],
            }
        ).encode()
        group = self.group
        try:
            group.announce(version)
            head = torch.tensor([version, len(header), len(layout)], dtype=torch.int64, device=group.device)
            group.wait(group.broadcast(head))
            group.wait(
                group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
            )
            digests, source_error = self._send_buckets(layout, specs, iter(tensors))
            group.wait(group.broadcast(torch.tensor(digests, dtype=torch.int64, device=group.device)))
            committed = group.all_ok(source_error is None)
        except Exception as exc:  # a collective failed (a receiver died, a timeout): the group is broken
            group.abort()
            raise TransferFailed(f"version {version}: broadcast failed: {exc}") from exc
        if source_error is not None:
            raise TransferFailed(f"version {version}: {source_error}") from source_error
        if not committed:
            raise TransferFailed(
                f"version {version}: a receiver voted against it (its bucket digests differed)"
            )
        return TransferStats(
            version, len(specs), sum(s.nbytes for s in specs), len(layout), time.monotonic() - t0
        )

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.group.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot][:nbytes]

    def _send_buckets(
        self, layout: list[Bucket], specs: Sequence[TensorSpec], source: Any
    ) -> tuple[list[int], Exception | None]:
        """Broadcast every bucket; returns their digests and the source's error, if any.

        A bucket of one tensor goes out from the tensor's own bytes (no copy), and the source is not advanced
        until it has gone (a gathered tensor is valid only until the next is requested). Packed buckets are
        copied into one of two staging buffers, the next packed while the last travels. Digests are taken
        while a bucket is in flight. A source that fails or breaks the header does not break the group: the
        remaining buckets still go out (their contents void) so every receiver reaches the vote, where this
        rank votes the version down."""
        digests: list[int] = []
        error: Exception | None = None
        in_flight: list[Any] = [None, None]
        for b, bucket in enumerate(layout):
            direct = None
            if error is None and len(bucket.items) == 1:
                try:
                    direct = self._take(bucket.items[0][0], specs, source)
                except Exception as exc:  # reported after the vote
                    error = exc
            if direct is not None:
                work = self.group.broadcast(direct)
                digests.append(_digest(direct))
                self.group.wait(work)
                continue
            slot = b % 2
            if in_flight[slot] is not None:
                self.group.wait(in_flight[slot])
            buf = self._buffer(slot, bucket.nbytes)
            if error is None:
                try:
                    for i, offset in bucket.items:
                        buf[offset : offset + specs[i].nbytes].copy_(self._take(i, specs, source))
                except Exception as exc:  # reported after the vote
                    error = exc
            in_flight[slot] = self.group.broadcast(buf)
            digests.append(_digest(buf))
        for work in in_flight:
            if work is not None:
                self.group.wait(work)
        if error is None:
            try:
                _check_exhausted(source)
            except ValueError as exc:
                error = exc
        return digests, error

    def _take(self, i: int, specs: Sequence[TensorSpec], source: Any) -> torch.Tensor:
        """The source's next tensor, checked against the header, as flat bytes on the group's device."""
        tensor = _next_checked(i, specs, source)
        return tensor.detach().to(self.group.device).contiguous().reshape(-1).view(torch.uint8)


class CollectiveReceiver:
    """Ranks 1..N: receive versions as they are broadcast."""

    def __init__(self, group: WeightGroup, bounce: bool | None = None) -> None:
        """``bounce`` (default: when the group's device is not the CPU) receives each bucket into one of two
        device buffers and copies it out to host memory (pinned), so a GPU worker stages a whole version in
        host memory, not in the GPU memory its KV cache holds: GPU memory used is two buckets."""
        if group.rank == 0:
            raise ValueError("rank 0 of the weight group is the publisher, not a receiver")
        self.group = group
        self.bounce = group.device.type != "cpu" if bounce is None else bounce

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]], TransferStats]:
        """Receive the version being broadcast; returns ``(version, [(name, tensor)] in order, stats)`` once
        every member has voted to commit it. Call it when the control plane announces a version: waiting longer
        than the group's timeout for the publisher fails. Raises :class:`TransferFailed`, returning nothing,
        if any part failed on any member (a failed collective also closes the group)."""
        group = self.group
        head = torch.zeros(3, dtype=torch.int64, device=group.device)
        try:
            group.wait(group.broadcast(head))
        except Exception as exc:
            group.close()
            raise TransferFailed(f"no version arrived: {exc}") from exc
        t0 = time.monotonic()
        version, header_len, n_buckets = (int(x) for x in head.tolist())
        try:
            raw = torch.empty(header_len, dtype=torch.uint8, device=group.device)
            group.wait(group.broadcast(raw))
            header = json.loads(bytes(raw.cpu().numpy()))
            specs = [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in header["tensors"]]
            layout = bucket_layout(specs, int(header["bucket_bytes"]))
            if len(layout) != n_buckets:
                raise ValueError(
                    f"the header's layout has {len(layout)} buckets, the publisher sent {n_buckets}"
                )
            hashed = bool(header.get("digests", True))  # the publisher hashes the buckets it holds on the CPU
            buffers, mine = self._bounced(layout, hashed) if self.bounce else self._direct(layout, hashed)
            theirs = torch.zeros(n_buckets, dtype=torch.int64, device=group.device)
            group.wait(group.broadcast(theirs))
        except Exception as exc:
            group.close()
            raise TransferFailed(f"version {version}: receiving failed: {exc}") from exc
        good = theirs.cpu().tolist() == mine
        if not good:
            log.error("version %d: bucket digests differ from the publisher's: voting against it", version)
        try:
            committed = group.all_ok(good)
        except Exception as exc:
            group.close()
            raise TransferFailed(f"version {version}: the commit vote failed: {exc}") from exc
        if not committed:
            raise TransferFailed(
                f"version {version}: not committed (the publisher's source failed, or a "
                "member's bucket digests differed)"
            )
        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in zip(layout, buffers, strict=True):  # views: no copy
            for i, offset in bucket.items:
                s = specs[i]
                view = buf[offset : offset + s.nbytes].view(torch_dtype(s.dtype)).reshape(s.shape)
                tensors.append((s.name, view))
        nbytes = sum(s.nbytes for s in specs)
        return version, tensors, TransferStats(version, len(specs), nbytes, n_buckets, time.monotonic() - t0)

    def _direct(self, layout: list[Bucket], hashed: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Every bucket into its own buffer on the group's device, all queued at once (gloo runs them in
        order), each hashed while the next arrives."""
        group = self.group
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=group.device) for b in layout]
        works = [group.broadcast(buf) for buf in buffers]
        mine: list[int] = []
        for work, buf in zip(works, buffers, strict=True):
            group.wait(work)
            mine.append(_digest(buf.cpu()) if hashed else 0)
        return buffers, mine

    def _bounced(self, layout: list[Bucket], hashed: bool) -> tuple[list[torch.Tensor], list[int]]:
        """Each bucket into one of two device buffers, then copied to host memory. On CUDA the copy is queued
        on the current stream, which the next broadcast into the same buffer waits for."""
        group = self.group
        cuda = group.device.type == "cuda"
        biggest = max(b.nbytes for b in layout)
        slots = [
            torch.empty(biggest, dtype=torch.uint8, device=group.device) for _ in range(min(2, len(layout)))
        ]
        host = [torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=cuda) for b in layout]
        for b, (bucket, out) in enumerate(zip(layout, host, strict=True)):
            slot = slots[b % 2][: bucket.nbytes]
            group.wait(group.broadcast(slot))
            out.copy_(slot, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(group.device)
        return host, [_digest(out) if hashed else 0 for out in host]  # the bytes this member keeps
