"""Host shared memory for the weight group's members on one host: a file in /dev/shm mapped by each of them.

    host_identity()             which /dev/shm this process sees: members with the same one can share a segment
    SharedSegment.create(n)     the publisher's: n bytes reserved up front (no SIGBUS when /dev/shm fills up)
    SharedSegment.attach(name)  a receiver's copy-on-write mapping of the publisher's segment
    segment.tensor              the mapping as a uint8 tensor (the publisher's page-locked where CUDA is there)
    PinnedStaging               the publisher's staging buffer otherwise: private, exact-size, page-locked
    HostBuffers                 a receiver's own copies of versions: exact-size, page-locked, kept for the next

The collective transport (``collective.py``) stages a version in a segment of its own and every receiver on the
host maps it, instead of the bytes crossing loopback sockets once per receiver: one copy of the version in
memory, however many receivers hold it. Ranks that share a GPU (which NCCL refuses) always do; gloo groups on
one host when ``weight_broker.group_shared_memory`` is set. Files are named ``vcpo-group-<pid>-<n>``. The
publisher unlinks each once every receiver has voted on its version (the pages live on until the last
receiver lets go of its views), and the files of publishers that died mid-broadcast are swept when the next one
creates its first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import re
import socket
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.pids import sweep_dead

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "vcpo-group-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)$")
_count = itertools.count()
_swept: list[bool] = []  # once per process, before its first segment


def host_identity() -> str:
    """The /dev/shm this process maps files from: the kernel's boot id and the device of its tmpfs mount (a
    container with its own /dev/shm differs; containers of one pod share theirs). Unique to this process where
    there is none, so it shares with no one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat(SHM_DIR).st_dev}/{socket.gethostname()}"
    except OSError:
        return f"no-shm/{socket.gethostname()}/{os.getpid()}"


def shm_free() -> int:
    """Bytes free in /dev/shm now."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _room(nbytes: int, keep_free: int, what: str) -> None:
    """OSError (ENOSPC) unless /dev/shm holds ``nbytes`` more and then still has ``keep_free`` free."""
    if keep_free <= 0:
        return
    free = shm_free()
    if free < nbytes + keep_free:
        raise OSError(
            errno.ENOSPC,
            f"{free} bytes free in {SHM_DIR}: {what} would leave less than the {keep_free} kept free",
        )


def sweep_stale() -> int:
    """Remove the segments of publishers that are gone (they died without closing); returns how many."""
    return sweep_dead(SHM_DIR, _NAME.pattern, "weight segment(s)")


def cuda_device_here() -> int | None:
    """The CUDA device current on this thread, where CUDA is in use (None otherwise): a buffer whose owner was
    made here, and given no device, is page-locked and unlocked under it, whichever thread does so. A thread
    that never chose a device (a background or finalizing one) would otherwise make a context on cuda:0 to do
    it: hundreds of MB on a GPU that another process (a vLLM worker whose KV cache was sized to its memory)
    may be using."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def _on(device: int | None) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def page_lock(tensor: torch.Tensor, what: str, device: int | None) -> bool:
    """Page-lock host memory where CUDA is there (``cudaHostRegister``, portable: pinned for every device's
    context), on ``device`` (:func:`cuda_device_here` where the buffer's owner was made), for fast
    asynchronous copies to a GPU; False where there is no CUDA, or it failed (logged)."""
    return _lock(tensor.data_ptr(), tensor.numel(), what, device)


def _lock(address: int, nbytes: int, what: str, device: int | None) -> bool:
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    with _on(device):
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))  # Portable
    if err != 0:
        log.warning("could not page-lock %s (cudaError %d)", what, err)
    return err == 0


def _unlock(address: int, what: str, device: int | None) -> None:
    with _on(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        log.warning("could not unlock %s (cudaError %d)", what, err)


_held = [0]  # bytes of this process's host buffers (HostBuffers): held by views, or kept as a spare
_held_lock = threading.Lock()


def held_host_bytes() -> int:
    """Bytes of :class:`HostBuffers` memory mapped in this process: held by views, or kept as a spare."""
    return _held[0]


class HostBuffers:
    """A receiver's own host copies of the versions it receives (a GPU worker keeps each in one until its
    engine has loaded it): each a private mapping of exactly the version's size, page-locked where CUDA is
    there, and the version's until the last view of it goes, on whichever thread lets it go. It is then kept as
    the spare for the next version of its size, one at most, so a receiver does not map, fault in and
    page-lock a whole version's memory on the broadcast's path for every version (every member of the group
    would wait for it). Anything else is unlocked, then unmapped; ``release`` (the group closed) frees the
    spare, and what views still hold once they go.

    Not torch's pinned allocator, which would round each bucket up to a power of two (a 1.1 GB embedding pins
    2 GB) and keep every freed block pinned for reuse."""

    def __init__(self, device: int | None = None, keep_spare: bool = True) -> None:
        """``keep_spare`` False: free every mapping once its views go (an owner that keeps its own buffer)."""
        self._spare: _HostMapping | None = None
        self._lock = threading.Lock()
        self._closed = not keep_spare  # closed: nothing more is kept as the spare
        self.device = cuda_device_here() if device is None else device  # page-locked on it

    def take(self, nbytes: int, what: str) -> torch.Tensor:
        """``nbytes`` of host memory (a uint8 tensor): the spare where it has that size, or a new mapping."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.nbytes != nbytes:
            spare.free()
            spare = None
        mapping = spare or _HostMapping(nbytes, what, self.device)
        return torch.from_numpy(np.asarray(_Holder(mapping, self)))

    def returned(self, mapping: _HostMapping) -> None:
        """A mapping's last view went: keep it as the spare, or free it."""
        with self._lock:
            if not self._closed and self._spare is None:
                self._spare = mapping
                return
        mapping.free()

    def release(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.free()


class _HostMapping:
    """One anonymous mapping, page-locked where CUDA is there; ``free`` (or, at the latest, its deallocation)
    unlocks its pages before it unmaps them (the mmap object's own deallocation would unmap first, leaving a
    registration on addresses a later mapping may reuse)."""

    def __init__(self, nbytes: int, what: str, device: int | None) -> None:
        self.nbytes, self.what, self.device = nbytes, what, device
        self._mmap: mmap.mmap | None = mmap.mmap(
            -1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))  # the export ends with it
        self.locked = _lock(self.address, nbytes, what, device)
        with _held_lock:
            _held[0] += nbytes

    def free(self) -> None:
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        if self.locked:
            _unlock(self.address, self.what, self.device)
        mapping.close()
        with _held_lock:
            _held[0] -= self.nbytes

    def __del__(self) -> None:  # a spare whose HostBuffers was dropped without release
        with contextlib.suppress(Exception):  # at exit CUDA may be gone; the process's memory goes anyway
            self.free()


class _Holder:
    """A mapping shown to numpy by address: the array, and every tensor view of it, keep this object alive;
    once the last goes, its finalizer hands the mapping back to its :class:`HostBuffers`."""

    def __init__(self, mapping: _HostMapping, owner: HostBuffers) -> None:
        data = (mapping.address, False)
        self.__array_interface__ = {"version": 3, "shape": (mapping.nbytes,), "typestr": "|u1", "data": data}
        # not at exit: the process's memory goes with it, and CUDA may be torn down by then
        weakref.finalize(self, owner.returned, mapping).atexit = False


class PinnedStaging:
    """The publisher's staging buffer when its members do not share /dev/shm: private host memory of exactly
    the size asked for, page-locked where CUDA is there (a :class:`HostBuffers` mapping), kept for the next
    version (replaced by a new one if that is bigger). Not torch's pinned allocator, which rounds each
    allocation up to a power of two and caches it: a 65 GB version would pin 128 GB of the learner's host."""

    def __init__(self, device: int | None = None) -> None:
        self._buffers = HostBuffers(device, keep_spare=False)
        self._tensor: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._tensor is None or self._tensor.numel() < nbytes:
            self._tensor = None  # freed once no view of it is left
            self._tensor = self._buffers.take(nbytes, "the weight staging buffer")
        return self._tensor[:nbytes]

    @property
    def pinned(self) -> bool:
        return self._tensor is not None and self._tensor.is_pinned()

    def release(self) -> None:
        """Let the buffer go: unlocked and unmapped once no view of it is left."""
        self._tensor = None


class SharedSegment:
    """One mapped file of /dev/shm (see the module docstring)."""

    def __init__(
        self, name: str, nbytes: int, mapping: mmap.mmap, owner: bool, device: int | None = None
    ) -> None:
        self.name, self.nbytes, self.owner, self.device = name, nbytes, owner, device
        # the tensor, and every view of it, keeps the mapping alive (unmapped once the last goes)
        self.tensor: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        # page-locked like a pinned staging buffer: fast GPU copies
        self._registered = owner and page_lock(self.tensor, f"weight segment {name}", device)

    @classmethod
    def create(cls, nbytes: int, device: int | None = None) -> SharedSegment:
        """A new segment of ``nbytes``, its space reserved now: OSError (ENOSPC) if /dev/shm cannot hold it.
        Page-locked on ``device`` (:func:`cuda_device_here` where its stager was made)."""
        if not _swept:
            _swept.append(True)
            sweep_stale()
        name = f"{PREFIX}{os.getpid()}-{next(_count)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # tmpfs: a full /dev/shm fails here, not as SIGBUS on a write
            # its page tables filled now, in one pass (a spare is reserved in the background): the learner's
            # staging copy would otherwise take a fault per page while it waits
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, nbytes, flags=flags)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(name, nbytes, mapping, owner=True, device=device)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> SharedSegment:
        """The publisher's segment ``name`` (it must hold at least ``nbytes``), mapped copy-on-write: reads
        share the publisher's pages, a write (an engine's loader may convert a tensor in place) copies the page
        it touches. The mapping, and the pages, outlive the name: the publisher unlinks it after the vote."""
        fd = cls.open_file(name, nbytes)
        try:
            return cls.attach_fd(fd, nbytes, name)
        finally:
            os.close(fd)

    @staticmethod
    def open_file(name: str, nbytes: int) -> int:
        """The segment ``name``'s file, opened to map later (:meth:`attach_fd`), even once it is unlinked."""
        if not _NAME.match(name):
            raise ValueError(f"{name!r} is not a weight segment's name")
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
        size = os.fstat(fd).st_size
        if size < nbytes:
            os.close(fd)
            raise ValueError(f"weight segment {name} holds {size} bytes, the header said {nbytes}")
        return fd

    @classmethod
    def attach_fd(cls, fd: int, nbytes: int, name: str = "") -> SharedSegment:
        """An opened segment file mapped copy-on-write (see :meth:`attach`); the caller closes ``fd``."""
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(name, nbytes, mapping, owner=False)

    def close(self) -> None:
        """Unlock and, the stager's, unlink; the pages are unmapped once the last view of them goes. Views may
        outlive this: a host copy's leader stages the version its engine loads later, and a group closed
        meanwhile (a re-formed epoch) releases its segments. The mapping is never closed here: torch's
        ``frombuffer`` keeps the mmap object alive but holds no export of its buffer, so closing it would
        unmap the pages under live views (a segfault, or another mapping's bytes, in the engine's load)."""
        if self.tensor is not None and self._registered:
            _unlock(self.tensor.data_ptr(), f"weight segment {self.name}", self.device)
        self.tensor, self._registered = None, False
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)


class Staging:
    """A stager's segments (the publisher's, a host copy's leader's): the version being staged or sent
    (``current``), and the next one's (``spare``), reserved and page-locked on a thread of its own, so neither
    the learner nor a broadcast waits for it."""

    def __init__(self, device: int | None = None) -> None:
        self.current: SharedSegment | None = None
        self.spare: SharedSegment | None = None
        self.reserving: Future[None] | None = None  # the spare's reservation, in the background
        self._thread: ThreadPoolExecutor | None = None
        # the segments are page-locked on it, on whichever thread
        self.device = cuda_device_here() if device is None else device

    def take(self, nbytes: int, keep_free: int = 0) -> torch.Tensor:
        """``nbytes`` of the current segment: the one staged and not yet sent, the spare (once its reservation
        has ended), or a new one. OSError if /dev/shm cannot hold it, or would then have less than
        ``keep_free`` bytes free (a host copy's leader keeps room for the file its engine's workers read a
        broker-path version from: a host copy that took it would make every such load fail)."""
        self.settle()
        if self.current is None or self.current.nbytes < nbytes:
            self.release(spare=False)  # staged and never sent, or too small
            spare, self.spare = self.spare, None
            if spare is not None and spare.nbytes >= nbytes:
                try:
                    _room(0, keep_free, "staging in the spare segment")  # its bytes are taken already
                except OSError:
                    spare.close()
                    raise
                self.current = spare
            else:
                if spare is not None:
                    spare.close()
                _room(nbytes, keep_free, f"a segment of {nbytes} bytes")
                self.current = SharedSegment.create(nbytes, self.device)
        assert self.current.tensor is not None
        return self.current.tensor[:nbytes]

    def reserve_spare(self, nbytes: int, keep_free: int = 0) -> None:
        """Reserve the next version's segment of ``nbytes`` in the background (:meth:`take` waits for it); none
        where /dev/shm would then have less than ``keep_free`` bytes free."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-segment")
        self.reserving = self._thread.submit(self._reserve, nbytes, keep_free)

    def _reserve(self, nbytes: int, keep_free: int) -> None:
        if self.spare is None:
            with contextlib.suppress(OSError):  # the next take tries again, and says why if it cannot
                _room(nbytes, keep_free, f"a spare segment of {nbytes} bytes")
                self.spare = SharedSegment.create(nbytes, self.device)

    def settle(self) -> None:
        """Wait for the spare's reservation, if one is under way."""
        reserving, self.reserving = self.reserving, None
        if reserving is not None:
            reserving.result()

    def release(self, spare: bool = True) -> None:
        """Unlink and unmap the current segment (receivers that mapped it keep its pages until they let go
        of them) and, ``spare``, the spare, once its reservation has ended (and the reserving thread)."""
        if spare:
            try:
                self.settle()
            except Exception:
                log.warning("reserving the next weight segment failed", exc_info=True)
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None
        for segment in (self.current, self.spare if spare else None):
            if segment is not None:
                segment.close()
        self.current = None
        if spare:
            self.spare = None


def receive_segment(layout: list[Any], shared: dict[str, Any]) -> list[torch.Tensor]:
    """A receiver's view of the publisher's segment that the header names (``shared``), mapped copy-on-write:
    the version's tensors are views of the pages the publisher wrote (nothing is copied; the engine's load
    reads them), which stay this member's until its views go, whatever the publisher does next. Empty if it
    cannot be mapped: this member votes the version down (logged), and the group stays as it was."""
    [whole] = layout
    name = str(shared["name"])
    if int(shared["nbytes"]) != whole.nbytes:
        raise ValueError(f"the header's segment holds {shared['nbytes']} bytes, its tensors {whole.nbytes}")
    try:
        segment = SharedSegment.attach(name, whole.nbytes)
    except (OSError, ValueError) as exc:
        log.error("cannot map the publisher's weight segment %s: %s: voting against the version", name, exc)
        return []
    assert segment.tensor is not None
    return [segment.tensor]  # its views keep the mapping
