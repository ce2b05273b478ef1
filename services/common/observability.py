"""Metrics and health for every service: ``/metrics`` for Prometheus, gRPC health checking, gRPC servers.

Each service owns one :class:`Metrics` (its own Prometheus registry, so several services can share a test
process) and serves it with :func:`serve_metrics`, which also answers ``/healthz`` for Kubernetes probes.
Metric names must start with ``vcpo_`` and carry their unit (``_seconds``, ``_bytes``, ...); counters end in
``_total``. :class:`Metrics` refuses names without the prefix and counters without ``_total``, so the
convention cannot drift service by service.

gRPC services are built with :func:`grpc_server`, which registers the standard ``grpc.health.v1.Health``
service and binds a port (0 = a free one).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from services.common.reflection import enable_reflection

log = logging.getLogger(__name__)

PREFIX = "vcpo_"
_NAME = re.compile(r"^vcpo_[a-z][a-z0-9_]*$")

C = TypeVar("C", Counter, Gauge, Histogram)


class Metrics:
    """A service's metrics: get-or-create counters, gauges and histograms on the service's own registry.

    Asking twice for the same name returns the same collector (many producers/consumers in one service
    share their counters); asking for it with another type or other labels is an error.
    """

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collectors: dict[str, tuple[type, tuple[str, ...], Any]] = {}
        self._lock = threading.Lock()

    def _get(self, kind: type[C], name: str, doc: str, labels: Sequence[str], **kwargs: Any) -> C:
        if not _NAME.match(name):
            raise ValueError(f"metric name {name!r} must match {_NAME.pattern}")
        if kind is Counter and not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        with self._lock:
            if name in self._collectors:
                have_kind, have_labels, collector = self._collectors[name]
                if have_kind is not kind or have_labels != tuple(labels):
                    raise ValueError(
                        f"metric {name!r} already exists as {have_kind.__name__}{list(have_labels)}, "
                        f"not {kind.__name__}{list(labels)}"
                    )
                return collector
            # prometheus_client appends _total itself to counters
            reg_name = name[: -len("_total")] if kind is Counter else name
            collector = kind(reg_name, doc, labelnames=tuple(labels), registry=self.registry, **kwargs)
            self._collectors[name] = (kind, tuple(labels), collector)
            return collector

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None
    ) -> Histogram:
        extra = {} if buckets is None else {"buckets": tuple(buckets)}
        return self._get(Histogram, name, doc, labels, **extra)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)


@dataclass
class MetricsServer:
    """A running ``/metrics`` + ``/healthz`` HTTP server; ``close()`` stops it."""

    host: str
    port: int
    _server: ThreadingHTTPServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    metrics: Metrics, port: int = 0, host: str = "0.0.0.0", healthy: Callable[[], bool] | None = None
) -> MetricsServer:
    """Serve ``/metrics`` (Prometheus text) and ``/healthz`` (200 when ``healthy()``, else 503) in a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, status, ctype = metrics.exposition(), 200, CONTENT_TYPE_LATEST
            elif path == "/healthz":
                ok = healthy() if healthy is not None else True
                body, status, ctype = (b"ok\n" if ok else b"unhealthy\n"), (200 if ok else 503), "text/plain"
            else:
                body, status, ctype = b"not found: try /metrics or /healthz\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: keep logs quiet
            log.debug("metrics %s: " + format, metrics.service, *args)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise OSError(
            exc.errno, f"could not serve {metrics.service}'s /metrics on {host}:{port}: {exc.strerror}"
        ) from exc
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name=f"metrics-{metrics.service}", daemon=True)
    thread.start()
    bound_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return MetricsServer(bound_host, server.server_address[1], server, thread)


class WindowRate:
    """Events (tokens, groups, ...) per second over a sliding window."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0  # events in the window: asked for often (every engine step), so kept, not summed

    def add(self, count: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, count))
        self._total += count

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return self._total / span


def write_endpoints(directory: Path, name: str, grpc_port: int, metrics_url: str, **more: Any) -> Path:
    """Say where a started replica listens: ``<directory>/<name>.endpoints.json`` with its gRPC port, metrics
    URL, PID (launchers wait for this file; the PID tells a fresh file from a dead replica's) and ``more``
    (a sampler's ``agents_url``). Written atomically, so a reader never sees half of it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.endpoints.json"
    tmp = path.with_suffix(".tmp")
    body = {"grpc_port": grpc_port, "metrics_url": metrics_url, "pid": os.getpid(), **more}
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


# gRPC messages carry whole rollout groups and weight chunks: raise the 4 MiB default.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class GrpcServer:
    """A started gRPC server with the standard health service; ``set_serving`` flips health per service."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_serving(self, service: str = "", serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(service, status)

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def grpc_server(
    add_servicers: Callable[[grpc.Server], Sequence[str]],
    port: int = 0,
    host: str = "[::]",
    max_workers: int = 16,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """Build, bind and start a gRPC server.

    ``add_servicers(server)`` registers the service's servicers and returns their full names
    (e.g. ``["vcpo.v1.RewardService"]``); each is reported SERVING by the health service once started, and
    listed by server reflection (v1 and v1alpha, :mod:`services.common.reflection`). With ``credentials``
    (:func:`services.common.tls.server_credentials`) it listens with TLS only.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=tuple(interceptors),
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # gRPC sets SO_REUSEPORT by default: a second service on the same port would silently share it
            ("grpc.so_reuseport", 0),
        ],
    )
    names = list(add_servicers(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, names)
    try:
        address = f"{host}:{port}"
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # newer grpcio raises instead of returning 0
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port} (port in use?)")
    server.start()
    result = GrpcServer(server, bound, health_servicer)
    result.set_serving("")
    for name in names:
        result.set_serving(name)
    return result


def check_health(target: str, service: str = "", timeout_s: float = 5.0) -> bool:
    """Ask a gRPC server's health service whether ``service`` ("" = the whole server) is SERVING."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def actor_logging(name: str, run_dir: Path) -> Path:
    """Logging for a service inside a Ray actor: INFO and up, prefixed with ``name``, to Ray's worker log and
    to ``<run_dir>/logs/<name>.log`` (appended across restarts), where a user of the launcher looks first."""
    path = run_dir / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(), logging.FileHandler(path)):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    return path
