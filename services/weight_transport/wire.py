"""Chunk messages on the wire without protobuf's copies: same bytes as protos/, fewer copies of the data.

Weight chunks are almost all payload. Building a ``WeightChunk`` with protobuf copies the payload when it is
set, again when a submessage is attached, again when serialized, and every read of ``chunk.data`` copies it
once more; parsing copies it as well. Profiling put most of the broker's time there. So the two streaming
methods (Publish requests, Fetch responses) carry chunks encoded and decoded here, by hand, in the protobuf
wire format of ``protos/vcpo/v1/weights.proto``:

    PublishRequest.chunk = field 2, FetchResponse.chunk = field 2  (length-delimited WeightChunk)
    WeightChunk: 1 policy_version (varint), 2 tensor_name, 3 offset (varint), 4 data, 5 last (varint),
                 6 checksum

Encoding is the small protobuf-made header plus the payload, joined once; decoding returns the payload as a
``memoryview`` into the received message, not a copy. Any protobuf implementation reads what we write, and we
read any valid encoding (fields in any order, unknown fields skipped), so clients in other languages and the
generated stubs interoperate unchanged. Messages other than chunks (manifest, commit) use protobuf as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from vcpo.v1 import weights_pb2

CHUNK_FIELD = 2  # `chunk` in both PublishRequest and FetchResponse
Message = bytes | memoryview  # a serialized message; a memoryview one is read-only and owned by no one else
_DATA_TAG = bytes([(4 << 3) | 2])
_OUTER_TAG = bytes([(CHUNK_FIELD << 3) | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


@dataclass
class Chunk:
    """A decoded WeightChunk; ``data`` is a view into the message it came from."""

    policy_version: int
    tensor_name: str
    offset: int
    data: memoryview
    last: bool
    checksum: str
    # the whole serialized message it was decoded from, when that is immutable: bytes, or a read-only
    # memoryview of a buffer nobody else holds (the data plane's received frames)
    message: bytes | memoryview | None = None


def encode_chunk(
    policy_version: int,
    tensor_name: str,
    offset: int,
    data: bytes | memoryview,
    last: bool,
    checksum: str = "",
) -> bytes:
    """A PublishRequest or FetchResponse (same bytes) whose ``chunk`` holds these fields; one copy of ``data``."""
    return b"".join(encode_chunk_parts(policy_version, tensor_name, offset, data, last, checksum))


def encode_chunk_parts(
    policy_version: int,
    tensor_name: str,
    offset: int,
    data: bytes | memoryview,
    last: bool,
    checksum: str = "",
) -> tuple[bytes, bytes | memoryview]:
    """The same message as ``(everything before the payload, the payload)``, for a gather write (no copy)."""
    head = weights_pb2.WeightChunk(
        policy_version=policy_version, tensor_name=tensor_name, offset=offset, last=last, checksum=checksum
    ).SerializeToString()
    inner_len = len(head) + 1 + len(_varint(len(data))) + len(data)
    return b"".join((_OUTER_TAG, _varint(inner_len), head, _DATA_TAG, _varint(len(data)))), data


def decode_chunk(message: bytes | memoryview) -> Chunk | None:
    """The chunk of a serialized PublishRequest/FetchResponse, or None if the message holds something else."""
    buf = memoryview(message)
    pos, found = 0, None
    while pos < len(buf):  # the outer message: find field 2 (a later occurrence wins, as in protobuf)
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated field")
            if number == CHUNK_FIELD:
                found = buf[pos : pos + length]
            elif number in (1, 3):
                found = None  # a manifest or commit replaces the oneof
            pos += length
        else:
            pos = _skip(buf, pos, wire)
    if found is None:
        return None
    chunk = _decode_fields(found)
    if isinstance(message, bytes) or (isinstance(message, memoryview) and message.readonly):
        chunk.message = message
    return chunk


def _skip(buf: memoryview, pos: int, wire: int) -> int:
    if wire == 0:
        return _read_varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire}")


def _decode_fields(buf: memoryview) -> Chunk:
    chunk = Chunk(0, "", 0, memoryview(b""), False, "")
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if number == 1:
                chunk.policy_version = value
            elif number == 3:
                chunk.offset = value
            elif number == 5:
                chunk.last = bool(value)
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated field")
            field = buf[pos : pos + length]
            pos += length
            if number == 2:
                chunk.tensor_name = bytes(field).decode()
            elif number == 4:
                chunk.data = field
            elif number == 6:
                chunk.checksum = bytes(field).decode()
        else:
            pos = _skip(buf, pos, wire)
    return chunk
