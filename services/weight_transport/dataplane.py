"""The broker's TCP data plane: publish and fetch over a plain socket of length-prefixed frames.

The framing both ends speak and the client's two calls; what the frames hold is ``protocol.py``, the broker's
server ``dataplane_server.py``.

Not gRPC: Python gRPC moves at most ~1.3-1.5 GB/s of large messages here (every message crosses the C core, a
Python bytes object and the GIL), a loopback socket about twice that. Weight bytes are the one bulk flow, so
they take this path; everything else (latest, list, status, health) stays on gRPC.

    frame:        4-byte big-endian length, then that many bytes; length 0 ends a stream
    connection:   client → request frame: JSON {"op": "publish"} or
                                          {"op": "fetch", "version": int | null, "start_tensor": str,
                                           "max_chunk_bytes": int}
      publish:    client → manifest (a serialized VersionManifest), payload frames, commit (JSON), end frame
                  server → one JSON status frame {"ok": true, "policy_version", "total_bytes", "seconds"}
                           or {"ok": false, "reason": "stale" | "duplicate" | ..., "message": str}
      fetch:      server → JSON status frame ({"ok": true} or {"ok": false, "reason": "not_found", ...}),
                           manifest, payload frames (from ``start_tensor`` on), end frame
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from services.weight_transport.store import VersionNotFound
from services.weight_transport.tensors import Buffer

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a bigger length prefix is garbage, not a frame of ours
SOCKET_BUFFER_BYTES = 4 << 20


class BrokenStream(ValueError):
    """A stream that ended early or is malformed (worth retrying, unlike a bad request)."""


def send_frame(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """One frame of ``data``, sent with its length prefix from where it lies (a gather write, no copy)."""
    view = memoryview(data).cast("B")
    parts = [memoryview(_HEADER.pack(len(view))), view]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def send_end(sock: socket.socket) -> None:
    sock.sendall(_HEADER.pack(0))


def _recv_into(sock: socket.socket, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)  # usually the whole rest in one call
        if n == 0:
            raise BrokenStream(f"the connection closed inside {what} ({got} of {len(view)} bytes)")
        got += n


def recv_frame(sock: socket.socket, into: memoryview | None = None) -> memoryview | None:
    """The next frame, or None for the end frame. Received into the front of ``into`` when given (a frame
    longer than ``into`` is not this protocol's); else into a buffer of its own (allocated without
    zero-filling), returned read-only, so the memory store may keep it as it is."""
    header = bytearray(_HEADER.size)
    _recv_into(sock, memoryview(header), "a frame header")
    (size,) = _HEADER.unpack(header)
    if size == 0:
        return None
    if size > (MAX_FRAME_BYTES if into is None else len(into)):
        room = f"at most {MAX_FRAME_BYTES}" if into is None else f"{len(into)} bytes left of the tensor"
        raise BrokenStream(f"frame of {size} bytes announced ({room}): not this protocol")
    if into is not None:
        _recv_into(sock, into[:size], f"a frame of {size} bytes")
        return into[:size]
    # torch's allocator: no zero-fill, and no huge-page advice (numpy advises huge pages for big arrays,
    # which made receiving several times slower here)
    view = torch.empty(size, dtype=torch.uint8).numpy().data
    _recv_into(sock, view, f"a frame of {size} bytes")
    return view.toreadonly()


def frames(sock: socket.socket) -> Iterator[memoryview]:
    while (frame := recv_frame(sock)) is not None:
        yield frame


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    send_frame(sock, json.dumps(obj).encode())


def recv_json(sock: socket.socket) -> dict[str, Any]:
    frame = recv_frame(sock)
    if frame is None:
        raise BrokenStream("expected a status frame, got the end of the stream")
    try:
        obj = json.loads(bytes(frame))
    except ValueError:
        raise BrokenStream("the status frame is not JSON: not this protocol") from None
    if not isinstance(obj, dict):
        raise BrokenStream("the status frame is not a JSON object")
    return obj


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


# ------------------------------------------------------------------------------------------- client calls


def connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    tune(sock)
    return sock


def publish(address: str, frames: Iterable[Buffer], timeout_s: float) -> dict[str, Any]:
    """Send one publish's frames; the server's JSON status (``ok`` False says why it was refused)."""
    deadline = time.monotonic() + timeout_s
    with connect(address, timeout_s) as sock:
        send_json(sock, {"op": "publish"})
        try:
            for frame in frames:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"publish to {address} took longer than {timeout_s:.0f}s")
                if select.select([sock], [], [], 0)[0]:
                    break  # the broker answered before the end: a refusal; stop sending
                send_frame(sock, frame)
            else:
                send_end(sock)
        except (BrokenPipeError, ConnectionResetError) as exc:
            try:
                return recv_json(sock)  # the refusal that closed the connection
            except (BrokenStream, OSError):
                raise exc from None
        return recv_json(sock)


@contextmanager
def fetch(
    address: str, version: int | None, start_tensor: str, max_chunk_bytes: int, timeout_s: float
) -> Iterator[socket.socket]:
    """A fetch's connection, at its manifest frame (``protocol.receive_fetch`` reads the rest); raises
    VersionNotFound or BrokenStream."""
    with connect(address, timeout_s) as sock:
        send_json(
            sock,
            {
                "op": "fetch",
                "version": version,
                "start_tensor": start_tensor,
                "max_chunk_bytes": max_chunk_bytes,
            },
        )
        status = recv_json(sock)
        if not status.get("ok"):
            if status.get("reason") == "not_found":
                raise VersionNotFound(str(status.get("message")))
            raise BrokenStream(f"fetch refused: {status}")
        yield sock
