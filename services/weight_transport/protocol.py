"""The publish and fetch protocols as plain functions, shared by the broker's servicer and the transport.

    learner:  publish_requests(specs, tensors) ─► PublishRequest stream ─► apply_publish(store) ─► version
    sampler:  fetch_responses(store) ─► FetchResponse stream ─► receive_fetch(sink) ─► sink(name, tensor) × n

The two halves run in different processes, the broker's and its client's. The bytes are checked each tensor's
checksum when its last chunk arrives, the version checksum at commit, and again per tensor on the fetching
side before the sink sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from google.protobuf.message import DecodeError

from services.weight_transport.store import PublishRejected, StoredVersion, VersionStore
from services.weight_transport.tensors import (
    Hasher,
    TensorSpec,
    dtype_name,
    manifest_of,
    tensor_bytes,
    tensor_from_bytes,
    version_checksum,
)
from services.weight_transport.wire import Message, decode_chunk, encode_chunk_parts
from vcpo.v1 import weights_pb2

Sink = Callable[[str, torch.Tensor], None]


class IntegrityError(ValueError):
    """Fetched bytes do not match their checksum."""


class BrokenStream(ValueError):
    """A fetch stream that ended early or out of order (worth retrying, unlike a bad request)."""


def publish_requests(
    version: int,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int = 4 << 20,
    run_id: str = "",
) -> Iterator[bytes]:
    """The publish stream as serialized PublishRequests (see :func:`publish_parts`)."""
    for parts in publish_parts(version, specs, tensors, chunk_bytes, run_id):
        yield parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[misc]


def publish_parts(
    version: int,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int = 4 << 20,
    run_id: str = "",
) -> Iterator[tuple[bytes | memoryview, ...]]:
    """The publish stream, each message as its parts (the chunks' payloads are views of the tensors' bytes, for
    gather writes; join them for one message): manifest, each tensor's chunks (checksum on its last), commit.

    ``tensors`` is consumed lazily, one tensor at a time, in the order of ``specs`` (a ZeRO-3 learner gathers
    each bucket inside that iterator, so the whole model never sits in one extra buffer).
    """
    yield (weights_pb2.PublishRequest(manifest=manifest_of(specs, version, run_id)).SerializeToString(),)
    digests: list[tuple[str, str]] = []
    expected = iter(specs)
    for name, tensor in tensors:
        spec = next(expected, None)
        if spec is None or spec.name != name:
            raise ValueError(
                f"tensor {name!r} arrived, expected {spec.name if spec else 'no more tensors'!r}"
            )
        if (dtype_name(tensor.dtype), tuple(tensor.shape)) != (spec.dtype, spec.shape):
            raise ValueError(
                f"tensor {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, the manifest says "
                f"{spec.dtype}{list(spec.shape)}"
            )
        data, hasher = tensor_bytes(tensor), Hasher()
        hasher.update(data)
        digest = hasher.hexdigest()
        offset = 0
        while True:
            piece = data[offset : offset + chunk_bytes]
            last = offset + len(piece) >= len(data)
            yield encode_chunk_parts(version, name, offset, piece, last, digest if last else "")
            offset += len(piece)
            if last:
                break
        digests.append((name, digest))
    missing = [s.name for s in expected]
    if missing:
        raise ValueError(f"the tensors ended before {missing[:3]}{'...' if len(missing) > 3 else ''}")
    commit = weights_pb2.PublishRequest.Commit(checksum=version_checksum(digests))
    yield (weights_pb2.PublishRequest(commit=commit).SerializeToString(),)


def _parse_request(raw: Message) -> weights_pb2.PublishRequest:
    try:
        return weights_pb2.PublishRequest.FromString(bytes(raw))  # a manifest or commit: small
    except DecodeError as exc:
        raise PublishRejected("invalid", f"undecodable publish message: {exc}") from None


def apply_publish(store: VersionStore, requests: Iterator[Message]) -> StoredVersion:
    """Run a publish stream (serialized PublishRequests) into ``store``; the version is visible only if the
    stream ends with a valid commit. Anything else (a stream that breaks off, raises, or ends without commit)
    leaves nothing behind.
    """
    raw = next(requests, None)
    first = None if raw is None else _parse_request(raw)
    if first is None or first.WhichOneof("item") != "manifest":
        raise PublishRejected("invalid", "a publish must start with the version's manifest")
    writer = store.begin(first.manifest)
    try:
        for raw in requests:
            try:
                chunk = decode_chunk(raw)
            except ValueError as exc:
                raise PublishRejected("invalid", f"undecodable chunk: {exc}") from None
            if chunk is not None:
                writer.write(chunk)
                continue
            request = _parse_request(raw)
            kind = request.WhichOneof("item")
            if kind == "commit":
                return writer.commit(request.commit.checksum)
            raise PublishRejected("invalid", f"unexpected {kind!r} in the middle of a publish")
        raise PublishRejected("invalid", f"the publish of version {writer.version} ended without a commit")
    finally:
        writer.abort()  # no-op after a commit


def fetch_responses(
    store: VersionStore,
    version: int | None = None,
    start_tensor: str = "",
    chunk_bytes: int = 4 << 20,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[Message]:
    """The fetch stream, serialized FetchResponses: the manifest, then the chunks from ``start_tensor`` on,
    read from the stored copy and encoded by :mod:`wire`.

    ``on_bytes(n)`` is told the size of each chunk as it is handed on (for metrics).
    """
    stored = store.get(version)
    yield weights_pb2.FetchResponse(manifest=stored.manifest).SerializeToString()
    for message, size in stored.encoded_chunks(start_tensor, chunk_bytes):
        yield message
        if on_bytes is not None:
            on_bytes(size)


def receive_fetch(
    responses: Iterable[Message],
    sink: Sink,
    start_tensor: str = "",
    expected_version: int | None = None,
) -> weights_pb2.VersionManifest:
    """From serialized FetchResponses, assemble and verify each tensor, hand it to ``sink(name, tensor)`` in
    order; return the manifest.

    Raises IntegrityError on a checksum mismatch (before the sink sees the tensor), BrokenStream on a stream
    that is out of order or ends early.
    """
    stream = iter(responses)
    raw = next(stream, None)
    try:
        head = None if raw is None else weights_pb2.FetchResponse.FromString(bytes(raw))
    except DecodeError as exc:
        raise BrokenStream(f"undecodable fetch message: {exc}") from None
    if head is None or head.WhichOneof("item") != "manifest":
        raise BrokenStream("a fetch must start with the version's manifest")
    manifest = head.manifest
    if expected_version is not None and manifest.policy_version != expected_version:
        raise BrokenStream(f"asked for version {expected_version}, got {manifest.policy_version}")
    names = [t.name for t in manifest.tensors]
    todo = manifest.tensors[names.index(start_tensor) :] if start_tensor else manifest.tensors
    for meta in todo:
        parts: list[memoryview] = []
        hasher, offset = Hasher(), 0
        while True:
            raw = next(stream, None)
            try:
                chunk = None if raw is None else decode_chunk(raw)
            except ValueError as exc:
                raise BrokenStream(f"undecodable chunk: {exc}") from None
            if chunk is None:
                raise BrokenStream(
                    f"the fetch of version {manifest.policy_version} ended inside tensor {meta.name!r}"
                )
            data = chunk.data
            if chunk.tensor_name != meta.name or chunk.offset != offset or offset + len(data) > meta.nbytes:
                raise BrokenStream(
                    f"out-of-order chunk {chunk.tensor_name!r}@{chunk.offset}, expected {meta.name!r}@{offset}"
                )
            parts.append(data)
            hasher.update(data)
            offset += len(data)
            if chunk.last:
                break
        digest = hasher.hexdigest()
        if offset != meta.nbytes or digest != meta.checksum:
            raise IntegrityError(
                f"version {manifest.policy_version}, tensor {meta.name!r}: received {offset} of {meta.nbytes} bytes "
                f"with checksum {digest}, expected {meta.checksum}"
            )
        buffer = bytearray().join(parts)  # the one copy of the data on this side (no zero-fill)
        sink(meta.name, tensor_from_bytes(buffer, meta.dtype, meta.shape))
    return manifest
