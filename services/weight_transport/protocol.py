"""The publish and fetch streams as plain functions, both halves, over the data plane's frames.

    learner:  publish_frames(specs, tensors) ─► manifest, payloads, commit ─► apply_publish(store) ─► version
    sampler:  fetch_frames(store) ─► manifest, payloads ─► receive_fetch(sink) ─► sink(name, tensor) × n

A version's frames are its manifest (a serialized ``VersionManifest``), then the tensors' bytes in manifest
order as payload frames of at most ``chunk_bytes``, none spanning two tensors (an empty tensor has none):
which tensor and offset each belongs to follows from the manifest's sizes, so a payload frame is nothing but
bytes. A publish ends with a commit frame, JSON ``{"checksums": [per tensor], "checksum": version}``: the
publisher knows the checksums only once it has streamed the bytes (a ZeRO-3 learner gathers as it sends).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from google.protobuf.message import DecodeError

from services.weight_transport.dataplane import BrokenStream, recv_frame
from services.weight_transport.store import PublishRejected, StoredVersion, VersionStore
from services.weight_transport.tensors import (
    Buffer,
    Hasher,
    TensorSpec,
    check_exhausted,
    manifest_of,
    next_checked,
    tensor_bytes,
    torch_dtype,
    version_checksum,
)
from vcpo.v1 import weights_pb2

Sink = Callable[[str, torch.Tensor], None]


class IntegrityError(ValueError):
    """Fetched bytes do not match their checksum."""


def publish_frames(
    version: int,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int = 4 << 20,
    run_id: str = "",
) -> Iterator[Buffer]:
    """The publish's frames: manifest, payloads (views of the tensors' bytes, for gather writes), commit.
    ``tensors`` is consumed lazily, in the order of ``specs`` (a ZeRO-3 learner gathers inside that iterator)."""
    yield manifest_of(specs, version, run_id).SerializeToString()
    digests: list[tuple[str, str]] = []
    source = iter(tensors)
    for i, spec in enumerate(specs):
        data, hasher = tensor_bytes(next_checked(i, specs, source)), Hasher()
        hasher.update(data)
        for offset in range(0, len(data), chunk_bytes):
            yield data[offset : offset + chunk_bytes]
        digests.append((spec.name, hasher.hexdigest()))
    check_exhausted(source)
    commit = {"checksums": [d for _, d in digests], "checksum": version_checksum(digests)}
    yield json.dumps(commit).encode()


def apply_publish(store: VersionStore, frames: Iterator[memoryview]) -> StoredVersion:
    """Run a publish's frames into ``store``; the version is visible only if the frames end with a valid
    commit. Anything else (frames that break off, raise, or end without the commit) leaves nothing behind."""
    try:
        manifest = _manifest(next(frames, None), "publish")
    except ValueError as exc:
        raise PublishRejected("invalid", str(exc)) from None
    writer = store.begin(manifest)
    try:
        while not writer.complete:
            data = next(frames, None)
            if data is None:
                break
            writer.write(data)
        raw = next(frames, None) if writer.complete else None
        if raw is None:
            raise PublishRejected(
                "invalid",
                f"the publish of version {writer.version} ended without a commit "
                f"({writer.received} of {len(manifest.tensors)} tensors received)",
            )
        checksums, checksum = _commit(raw)
        if next(frames, None) is not None:
            raise PublishRejected("invalid", f"frames after the commit of version {writer.version}")
        return writer.commit(checksums, checksum)
    finally:
        writer.abort()  # no-op after a commit


def _manifest(raw: Buffer | None, what: str) -> weights_pb2.VersionManifest:
    if raw is None:
        raise ValueError(f"a {what} must start with the version's manifest")
    try:
        return weights_pb2.VersionManifest.FromString(bytes(raw))
    except DecodeError as exc:
        raise ValueError(f"undecodable manifest: {exc}") from None


def _commit(raw: Buffer) -> tuple[list[str], str]:
    try:
        commit = json.loads(bytes(raw))
        checksums, checksum = commit["checksums"], commit["checksum"]
        if isinstance(checksums, list) and all(isinstance(c, str) for c in [*checksums, checksum]):
            return checksums, checksum
    except (ValueError, TypeError, KeyError):
        pass
    raise PublishRejected(
        "invalid", 'the frame after the last tensor is not a commit {"checksums": [...], "checksum": ...}'
    )


def fetch_frames(
    store: VersionStore,
    version: int | None = None,
    start_tensor: str = "",
    chunk_bytes: int = 4 << 20,
) -> Iterator[Buffer]:
    """The fetch's frames: the manifest, then the payloads from ``start_tensor`` on, from the stored copy."""
    stored = store.get(version)
    yield stored.manifest.SerializeToString()
    yield from stored.payload(start_tensor, chunk_bytes)


def receive_fetch(
    sock: socket.socket,
    sink: Sink,
    start_tensor: str = "",
    on_manifest: Callable[[weights_pb2.VersionManifest], None] | None = None,
) -> weights_pb2.VersionManifest:
    """Read a fetch's frames from ``sock``, each tensor's payloads straight into a buffer of its own (the one
    copy on this side, not zero-filled); verify each tensor and hand it to ``sink(name, tensor)`` in order;
    return the manifest (``on_manifest`` is told it first). Raises IntegrityError on a checksum mismatch
    (before the sink sees the tensor), BrokenStream on a stream that is malformed or ends early."""
    try:
        manifest = _manifest(recv_frame(sock), "fetch")
    except ValueError as exc:
        raise BrokenStream(str(exc)) from None
    if on_manifest is not None:
        on_manifest(manifest)
    names = [t.name for t in manifest.tensors]
    for meta in manifest.tensors[names.index(start_tensor) :] if start_tensor else manifest.tensors:
        buffer = torch.empty(meta.nbytes, dtype=torch.uint8)  # torch's allocator: see dataplane.recv_frame
        view, hasher, offset = buffer.numpy().data, Hasher(), 0
        while offset < meta.nbytes:
            data = recv_frame(sock, into=view[offset:])
            if data is None:
                raise BrokenStream(
                    f"the fetch of version {manifest.policy_version} ended inside tensor {meta.name!r}"
                )
            hasher.update(data)
            offset += len(data)
        digest = hasher.hexdigest()
        if digest != meta.checksum:
            raise IntegrityError(
                f"version {manifest.policy_version}, tensor {meta.name!r}: received bytes with checksum "
                f"{digest}, expected {meta.checksum}"
            )
        sink(meta.name, buffer.view(torch_dtype(meta.dtype)).reshape(tuple(meta.shape)))
    if recv_frame(sock) is not None:
        raise BrokenStream(f"the fetch of version {manifest.policy_version} has frames after its last tensor")
    return manifest
