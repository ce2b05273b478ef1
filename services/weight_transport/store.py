"""Versioned weight storage: a version becomes visible only complete and verified; versions move forward.

    begin(manifest) ─► VersionWriter ── write(payload) × n ── commit(checksums) ─► StoredVersion (visible)
                              └── abort() / any error: nothing of it remains
    get(version | None) ─► StoredVersion ── payload(start_tensor) ─► the tensors' bytes (from the stored copy)

Payloads are cut as ``protocol.py`` says. ``[weight_broker] storage`` picks the storage:

- :class:`MemoryStore` keeps each version as the payloads it received (read-only buffers nobody else holds) and
  serves fetches views of them, so concurrent fetchers add only their in-flight frames, never a model each.
- :class:`DiskStore` keeps ``v<version>/`` (``model.safetensors``, ``manifest.json``), renamed into place on
  commit, read back by ``pread``; it survives restarts, and vLLM or ``safetensors`` can load it as it is.

A fetch in progress keeps reading a version retention dropped under it (the buffer stays referenced; the
unlinked file stays open).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from google.protobuf import json_format

from services.weight_transport.tensors import (
    Buffer,
    Hasher,
    TensorSpec,
    safetensors_header,
    version_checksum,
)
from vcpo.v1 import weights_pb2

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


class PublishRejected(Exception):
    """A publish the store refuses; ``reason`` is one of stale, duplicate, in_progress, invalid, integrity (and,
    as the data plane answers it, store_error: the broker's storage failed)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class VersionNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class StoredVersion:
    """A committed, verified version: its manifest (with checksums) and its bytes, the payloads it arrived in
    or (``path``) its ``model.safetensors``."""

    def __init__(
        self,
        manifest: weights_pb2.VersionManifest,
        payloads: list[list[memoryview]] | None = None,
        path: Path | None = None,
    ) -> None:
        self.manifest, self.path, self._payloads = manifest, path, payloads
        if path is not None:
            self._fd = os.open(path / WEIGHTS, os.O_RDONLY)
            _, self._starts = safetensors_header(manifest)

    def payload(self, start_tensor: str = "", chunk_bytes: int = 4 << 20) -> Iterator[Buffer]:
        """The tensors' bytes from tensor ``start_tensor`` (a resumed fetch) on, in pieces of at most
        ``chunk_bytes``, none spanning two tensors (an empty tensor has none)."""
        names = [t.name for t in self.manifest.tensors]
        if start_tensor and start_tensor not in names:
            raise VersionNotFound(f"version {self.manifest.policy_version} has no tensor {start_tensor!r}")
        for index in range(names.index(start_tensor) if start_tensor else 0, len(names)):
            if self._payloads is not None:
                for data in self._payloads[index]:
                    for start in range(0, len(data), chunk_bytes):
                        yield data[start : start + chunk_bytes]  # a view, not a copy
                continue
            nbytes = self.manifest.tensors[index].nbytes
            for offset in range(0, nbytes, chunk_bytes):
                size = min(chunk_bytes, nbytes - offset)
                read = os.pread(self._fd, size, self._starts[index] + offset)
                if len(read) != size:
                    raise OSError(f"{self.path}: short read of tensor {names[index]!r}")
                yield read

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._fd)


class VersionWriter:
    """An in-progress publish: takes the tensors' bytes in order, verifies every tensor, commits atomically."""

    def __init__(self, store: VersionStore, manifest: weights_pb2.VersionManifest) -> None:
        self.store, self.manifest = store, manifest
        self.received = 0  # tensors complete; the next payload belongs to tensor `received`
        self._offset = 0
        self._hasher = Hasher()
        self._digests: list[str] = []
        self._done = False
        self._payloads: list[list[memoryview]] = [[] for _ in manifest.tensors]
        self._file: BinaryIO | None = None
        if store.root is not None:
            self._final = version_dir(store.root, self.version)
            self._tmp = store.root / f".{self._final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._tmp.mkdir(parents=True)
            self._file = open(self._tmp / WEIGHTS, "wb")  # noqa: SIM115 (closed on commit or abort)
            self._file.write(safetensors_header(manifest)[0])
        self._skip_empty()

    @property
    def version(self) -> int:
        return int(self.manifest.policy_version)

    @property
    def complete(self) -> bool:
        return self.received == len(self.manifest.tensors)

    def write(self, data: memoryview) -> None:
        """The next payload of tensor ``received``. Raises PublishRejected (and aborts) on one that is empty or
        runs past its tensor's end."""
        try:
            if self.complete:
                raise PublishRejected("invalid", f"bytes after the last tensor of version {self.version}")
            meta = self.manifest.tensors[self.received]
            end = self._offset + len(data)
            if not data or end > meta.nbytes:
                raise PublishRejected(
                    "invalid",
                    f"tensor {meta.name!r}: a payload of {len(data)} bytes at byte {self._offset} of "
                    f"{meta.nbytes} (a payload is never empty and never spans two tensors)",
                )
        except PublishRejected:
            self.abort()
            raise
        if self._file is not None:
            self._file.write(data)
        else:
            self._payloads[self.received].append(data)
        self._hasher.update(data)
        self._offset = end
        if end == meta.nbytes:
            self._digests.append(self._hasher.hexdigest())
            self.received, self._offset, self._hasher = self.received + 1, 0, Hasher()
            self._skip_empty()

    def _skip_empty(self) -> None:
        """Tensors of no bytes have no payload: complete as soon as they are next."""
        while not self.complete and self.manifest.tensors[self.received].nbytes == 0:
            self._digests.append(Hasher().hexdigest())
            self.received += 1

    def commit(self, checksums: list[str], expected_checksum: str) -> StoredVersion:
        """Make the version visible, if every tensor arrived and matches ``checksums`` (the publisher's, in
        manifest order) and ``expected_checksum``."""
        try:
            if not self.complete:
                missing = len(self.manifest.tensors) - self.received
                raise PublishRejected(
                    "invalid", f"commit with {missing} tensor(s) of version {self.version} missing"
                )
            if len(checksums) != len(self._digests):
                raise PublishRejected(
                    "invalid",
                    f"the commit has {len(checksums)} tensor checksums for {len(self._digests)} tensors",
                )
            final = weights_pb2.VersionManifest()
            final.CopyFrom(self.manifest)
            for meta, digest, claimed in zip(final.tensors, self._digests, checksums, strict=True):
                if claimed != digest:
                    raise PublishRejected(
                        "integrity",
                        f"tensor {meta.name!r}: checksum {claimed!r} != received bytes' {digest!r}",
                    )
                meta.checksum = digest
            final.checksum = version_checksum(list(final.tensors))
            if expected_checksum != final.checksum:
                raise PublishRejected(
                    "integrity", f"version checksum {expected_checksum!r} != computed {final.checksum!r}"
                )
            stored = self._finish(final)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.store._committed(stored)
        return stored

    def abort(self) -> None:
        """Drop everything written; idempotent. The store takes the next publish even if the discard fails (a
        full disk, on the file's buffered bytes): else every later publish is refused until a restart."""
        if not self._done:
            self._done = True
            try:
                self._discard()
            finally:
                self.store._aborted(self.version)

    def _finish(self, manifest: weights_pb2.VersionManifest) -> StoredVersion:
        if self._file is None:
            return StoredVersion(manifest, self._payloads)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        (self._tmp / MANIFEST).write_text(json_format.MessageToJson(manifest))
        os.replace(self._tmp, self._final)  # atomic: the version appears whole or not at all
        return StoredVersion(manifest, path=self._final)

    def _discard(self) -> None:
        self._payloads = []
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk: its buffered bytes cannot be written either
                self._file.close()
            shutil.rmtree(self._tmp, ignore_errors=True)


class VersionStore:
    """The retained versions and the one publish in progress; with a ``root`` (the broker's alone) a new store
    takes the committed versions it finds there and removes the partial ones a crashed broker left."""

    def __init__(self, retain: int, root: str | Path | None = None) -> None:
        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self.retain = retain
        self.root = None if root is None else Path(root)
        self._versions: dict[int, StoredVersion] = {}
        self._in_progress: int | None = None
        self._lock = threading.Lock()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob(".v*.partial-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            for path in self.root.glob("v*"):
                if path.name[1:].isdigit() and (path / MANIFEST).exists():
                    manifest = json_format.Parse((path / MANIFEST).read_text(), weights_pb2.VersionManifest())
                    self._versions[int(path.name[1:])] = StoredVersion(manifest, path=path)
            self._retire()

    def begin(self, manifest: weights_pb2.VersionManifest) -> VersionWriter:
        _validate(manifest)
        v = int(manifest.policy_version)
        with self._lock:
            latest = max(self._versions, default=None)
            if v in self._versions:
                raise PublishRejected("duplicate", f"version {v} is already published")
            if latest is not None and v < latest:
                raise PublishRejected(
                    "stale", f"version {v} is older than the latest published version {latest}"
                )
            if self._in_progress is not None:
                raise PublishRejected(
                    "in_progress", f"a publish of version {self._in_progress} is in progress"
                )
            self._in_progress = v
        try:
            return VersionWriter(self, manifest)
        except BaseException:
            self._aborted(v)
            raise

    def get(self, version: int | None = None) -> StoredVersion:
        with self._lock:
            if not self._versions:
                raise VersionNotFound("no version has been published yet")
            v = max(self._versions) if version is None else version
            if v not in self._versions:
                raise VersionNotFound(f"version {v} is not retained (retained: {sorted(self._versions)})")
            return self._versions[v]

    def latest(self) -> int | None:
        with self._lock:
            return max(self._versions, default=None)

    def manifests(self) -> list[weights_pb2.VersionManifest]:
        with self._lock:
            return [self._versions[v].manifest for v in sorted(self._versions)]

    def stored_bytes(self) -> int:
        with self._lock:
            return sum(int(s.manifest.total_bytes) for s in self._versions.values())

    def _committed(self, stored: StoredVersion) -> None:
        with self._lock:
            self._versions[int(stored.manifest.policy_version)] = stored
            self._in_progress = None
            self._retire()

    def _aborted(self, version: int) -> None:
        with self._lock:
            if self._in_progress == version:
                self._in_progress = None

    def _retire(self) -> None:
        """Drop the versions beyond the newest ``retain``; a fetch in progress keeps reading its own."""
        for old in sorted(self._versions)[: -self.retain]:
            dropped = self._versions.pop(old)
            if dropped.path is not None:
                shutil.rmtree(dropped.path, ignore_errors=True)


def _validate(manifest: weights_pb2.VersionManifest) -> None:
    if not manifest.tensors:
        raise PublishRejected("invalid", f"version {manifest.policy_version}: the manifest lists no tensors")
    names = set()
    for t in manifest.tensors:
        if not t.name or t.name in names:
            raise PublishRejected("invalid", f"tensor name {t.name!r} is empty or repeated")
        names.add(t.name)
        try:
            size = TensorSpec(t.name, t.dtype, tuple(t.shape)).nbytes
        except ValueError as exc:
            raise PublishRejected("invalid", f"tensor {t.name!r}: {exc}") from None
        if any(d < 0 for d in t.shape):
            raise PublishRejected(
                "invalid", f"tensor {t.name!r}: negative dimension in shape {list(t.shape)}"
            )
        if size != t.nbytes:
            raise PublishRejected(
                "invalid", f"tensor {t.name!r}: {t.nbytes} bytes, but {t.dtype}{list(t.shape)} is {size}"
            )
    if manifest.total_bytes != sum(t.nbytes for t in manifest.tensors):
        raise PublishRejected(
            "invalid", f"total_bytes {manifest.total_bytes} is not the sum of the tensors' sizes"
        )


MemoryStore = VersionStore  # no root: the versions live in memory


class DiskStore(VersionStore):
    def __init__(self, root: str | Path, retain: int) -> None:
        super().__init__(retain, root)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:010d}"
