"""The broker's side of the TCP data plane: a threaded socket server handing each connection's publish or
fetch to the servicer; the frames and the protocol are :mod:`services.weight_transport.dataplane`'s."""

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
from services.weight_transport.store import PublishRejected, VersionNotFound

log = logging.getLogger(__name__)


class _Handler(socketserver.BaseRequestHandler):
    server: DataPlaneServer

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
        t0 = time.monotonic()
        try:
            stored = self.server.servicer.publish(frames(sock))
        except (PublishRejected, OSError) as exc:
            if isinstance(exc, OSError) and not is_store_error(exc):
                raise  # the connection's own failure: nobody to answer
            # answer at once (perhaps at the manifest), then drain what the client still sends until it closes:
            # closing with unread data would reset the connection and could lose the answer
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
                "seconds": time.monotonic() - t0,
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


class DataPlaneServer(socketserver.ThreadingTCPServer):
    """Serves the data plane for ``servicer`` on ``host:port`` (0: a free port) in a background thread."""

    daemon_threads = allow_reuse_address = True

    def __init__(
        self, servicer: WeightBrokerServicer, port: int = 0, host: str = "0.0.0.0", timeout_s: float = 300
    ):
        self.servicer, self.timeout_s = servicer, timeout_s
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot serve the data plane on {host}:{port} (weight_broker.data_port): {exc.strerror}",
            ) from exc
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, name="broker-data-plane", daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
