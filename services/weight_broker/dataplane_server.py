"""The broker's side of the TCP data plane: a threaded socket server that runs each connection's publish into
the store through the servicer's bookkeeping (``commit``) and serves each fetch from the servicer's counted
stream (``fetch``). The frames and the connection protocol are in :mod:`services.weight_transport.dataplane`
and :mod:`services.weight_transport.protocol`, shared with the TCP transport.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from typing import Any

from services.weight_broker.servicer import WeightBrokerServicer, is_store_error
from services.weight_transport.dataplane import (
    BrokenStream,
    frames,
    recv_json,
    send_end,
    send_frame,
    send_json,
    tune,
)
from services.weight_transport.protocol import apply_publish
from services.weight_transport.store import PublishRejected, VersionNotFound

log = logging.getLogger(__name__)


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
        servicer = self.server.servicer
        try:
            stored, seconds = servicer.commit(
                lambda: apply_publish(servicer.store, frames(sock)), time.monotonic()
            )
        except (PublishRejected, OSError) as exc:
            if isinstance(exc, OSError) and not is_store_error(exc):
                raise  # the connection's own failure: nobody to answer
            # refused, perhaps at the manifest, or the store's disk failed (counted): answer at once, then read
            # and drop what the client still had in flight until it sees the answer and closes (closing with
            # unread data would reset the connection and could lose the answer)
            reason = exc.reason if isinstance(exc, PublishRejected) else "store_error"
            send_json(sock, {"ok": False, "reason": reason, "message": str(exc)})
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 20):
                pass
            return
        send_json(
            sock,
            {
                "ok": True,
                "policy_version": stored.manifest.policy_version,
                "total_bytes": stored.manifest.total_bytes,
                "seconds": seconds,
            },
        )

    def _fetch(self, sock: socket.socket, request: dict[str, Any]) -> None:
        version = request.get("version")
        try:
            stream = self.server.servicer.fetch(
                None if version is None else int(version),
                str(request.get("start_tensor", "")),
                int(request.get("max_chunk_bytes") or 0),
            )
        except VersionNotFound as exc:
            send_json(sock, {"ok": False, "reason": "not_found", "message": str(exc)})
            return
        send_json(sock, {"ok": True})
        for frame in stream:
            send_frame(sock, frame)
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
        try:
            self._server = _Server((host, port), servicer, timeout_s)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve the data plane on {host}:{port} (weight_broker.data_port): {exc.strerror}",
            ) from exc
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="broker-data-plane", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
