"""The broker's TCP data plane: the gRPC service's publish and fetch messages over a plain socket.

Python gRPC moves at most ~1.3-1.5 GB/s of large messages here (every message crosses the C core, a
Python bytes object and the GIL), a loopback socket about twice that. Weight bytes are the one bulk flow,
so they may take this path; everything else (latest, list, status, health) stays on gRPC.

    frame:        4-byte big-endian length, then that many bytes; length 0 ends a stream
    connection:   client → request frame: JSON {"op": "publish"} or
                                          {"op": "fetch", "version": int | null, "start_tensor": str,
                                           "max_chunk_bytes": int}
      publish:    client → serialized PublishRequests (manifest, chunks, commit), end frame
                  server → one JSON status frame {"ok": true, "policy_version", "total_bytes", "seconds"}
                           or {"ok": false, "reason": "stale" | "duplicate" | ..., "message": str}
      fetch:      server → JSON status frame ({"ok": true} or {"ok": false, "reason": "not_found", ...}),
                           serialized FetchResponses (manifest, chunks), end frame

The messages are the gRPC path's, byte for byte, and go through the same code on both sides
(``apply_publish``, ``fetch_responses``, ``receive_fetch`` and the servicer's bookkeeping): the same
manifest and per-tensor checksums, the same all-or-nothing commit, the same metrics and announcements. A
connection that breaks off mid-publish leaves nothing behind; a fetch that breaks off resumes from the
first tensor the sink has not received (transports/base.py).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from services.weight_broker.protocol import BrokenStream
from services.weight_broker.store import PublishRejected, VersionNotFound
from services.weight_broker.wire import Message

if TYPE_CHECKING:
    from services.weight_broker.servicer import WeightBrokerServicer

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30  # a bigger length prefix is garbage, not a chunk
SOCKET_BUFFER_BYTES = 4 << 20


def send_frame(sock: socket.socket, *pieces: bytes | bytearray | memoryview) -> None:
    """One frame of the message made of ``pieces``, sent from where they lie (a gather write, no copy)."""
    views = [memoryview(p).cast("B") for p in pieces]
    parts = [memoryview(_HEADER.pack(sum(len(v) for v in views))), *views]
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


def recv_frame(sock: socket.socket) -> memoryview | None:
    """The next frame, or None for the end frame: a read-only view of a buffer of its own (allocated without
    zero-filling), so the memory store may keep it as an immutable message."""
    header = bytearray(_HEADER.size)
    _recv_into(sock, memoryview(header), "a frame header")
    (size,) = _HEADER.unpack(header)
    if size == 0:
        return None
    if size > MAX_FRAME_BYTES:
        raise BrokenStream(f"frame of {size} bytes announced (at most {MAX_FRAME_BYTES}): not this protocol")
    # torch's allocator: no zero-fill, and no huge-page advice (numpy advises huge pages for big arrays,
    # which made receiving several times slower here)
    view = torch.empty(size, dtype=torch.uint8).numpy().data
    _recv_into(sock, view, f"a frame of {size} bytes")
    return view.toreadonly()


def frames(sock: socket.socket) -> Iterator[memoryview]:
    """Frames up to the end frame; a connection that closes first raises BrokenStream."""
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


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        tune(sock)
        sock.settimeout(self.server.timeout_s)
        try:
            request = recv_json(sock)
            op = request.get("op")
            if op == "publish":
                self._publish(sock)
            elif op == "fetch":
                self._fetch(sock, request)
            else:
                send_json(sock, {"ok": False, "reason": "invalid", "message": f"unknown op {op!r}"})
        except (BrokenStream, OSError) as exc:
            log.warning("data-plane connection from %s broke off: %s", self.client_address, exc)

    def _publish(self, sock: socket.socket) -> None:
        try:
            reply = self.server.servicer.publish_messages(frames(sock))
        except PublishRejected as exc:
            # refused, perhaps at the manifest: answer at once, then read and drop what the client still had
            # in flight until it sees the answer and closes (closing with unread data would reset the
            # connection and could lose the answer)
            send_json(sock, {"ok": False, "reason": exc.reason, "message": str(exc)})
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 20):
                pass
            return
        send_json(
            sock,
            {
                "ok": True,
                "policy_version": reply.policy_version,
                "total_bytes": reply.total_bytes,
                "seconds": reply.seconds,
            },
        )

    def _fetch(self, sock: socket.socket, request: dict[str, Any]) -> None:
        version = request.get("version")
        try:
            messages = self.server.servicer.fetch_messages(
                None if version is None else int(version),
                str(request.get("start_tensor", "")),
                int(request.get("max_chunk_bytes") or 0),
            )
        except VersionNotFound as exc:
            send_json(sock, {"ok": False, "reason": "not_found", "message": str(exc)})
            return
        send_json(sock, {"ok": True})
        for message in messages:
            send_frame(sock, message)
        send_end(sock)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], servicer: WeightBrokerServicer, timeout_s: float) -> None:
        self.servicer, self.timeout_s = servicer, timeout_s
        super().__init__(address, _Handler)


class DataPlaneServer:
    """Serves the data plane for ``servicer`` on ``host:port`` (0: a free port) in a background thread."""

    def __init__(
        self, servicer: WeightBrokerServicer, port: int = 0, host: str = "0.0.0.0", timeout_s: float = 300
    ):
        self._server = _Server((host, port), servicer, timeout_s)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="broker-data-plane", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ------------------------------------------------------------------------------------------- client side


def connect(address: str, timeout_s: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    tune(sock)
    return sock


def publish(
    address: str, messages: Iterable[tuple[bytes | memoryview, ...]], timeout_s: float
) -> dict[str, Any]:
    """Send one publish's messages (each as its parts, see ``publish_parts``); the server's JSON status
    (``ok`` False says why it was refused)."""
    deadline = time.monotonic() + timeout_s
    with connect(address, timeout_s) as sock:
        send_json(sock, {"op": "publish"})
        try:
            for message in messages:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"publish to {address} took longer than {timeout_s:.0f}s")
                if select.select([sock], [], [], 0)[0]:
                    break  # the broker answered before the end: a refusal; stop sending
                send_frame(sock, *message)
            else:
                send_end(sock)
        except (BrokenPipeError, ConnectionResetError) as exc:
            try:
                return recv_json(sock)  # the refusal that closed the connection
            except (BrokenStream, OSError):
                raise exc from None
        return recv_json(sock)


def fetch(
    address: str, version: int | None, start_tensor: str, max_chunk_bytes: int, timeout_s: float
) -> Iterator[Message]:
    """The serialized FetchResponses of one fetch; raises VersionNotFound or BrokenStream."""
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
        yield from frames(sock)
