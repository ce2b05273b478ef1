"""How the learner and the samplers move weights through the broker: its client, bounded retries, the errors.

    learner (rank 0)   transport.publish(version, specs, tensors_fn)   tensors_fn() yields (name, tensor)
                                                                       one bucket at a time
    sampler            transport.fetch(sink, version=None)             sink(name, tensor), verified, in order

The client is custom because the data plane skips gRPC for bulk bytes (``dataplane``: Python gRPC moves large
messages at about half a loopback socket's rate); control calls (latest, list) stay gRPC.

Every call has a deadline; transient failures (unavailable, deadline, broken stream, corrupted bytes, another
publish in progress) are retried with exponential backoff a bounded number of times, then raise
:class:`BrokerUnavailable`. The broker's refusals are :class:`VersionExists`, :class:`StalePublish`,
``PublishRejected`` (any other) and ``VersionNotFound``. What the weight group does not carry comes through here.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from services.common.config import RunConfig
from services.weight_transport import dataplane
from services.weight_transport.config import WeightBrokerConfig, broker_host
from services.weight_transport.dataplane import BrokenStream
from services.weight_transport.protocol import IntegrityError, Sink, publish_frames, receive_fetch
from services.weight_transport.store import PublishRejected
from services.weight_transport.tensors import TensorSpec
from vcpo.v1 import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class BrokerUnavailable(ConnectionError):
    """The broker could not be reached within the retry budget."""


class VersionExists(Exception):
    """The version was already published (a restarted learner republishing may treat this as success)."""


class StalePublish(Exception):
    """The version is older than the latest published one: versions only move forward."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    timeout_s: float = 300.0  # deadline of one call


DEFAULT_RETRY = RetryPolicy()  # frozen: one instance serves every transport that is given none


@dataclass(frozen=True)
class PublishResult:
    policy_version: int
    total_bytes: int
    seconds: float


_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


class WeightTransport:
    """The broker at ``address`` (gRPC: control calls) and ``data_address`` (its TCP data plane: weight bytes)."""

    def __init__(
        self,
        address: str,
        data_address: str,
        retry: RetryPolicy = DEFAULT_RETRY,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
    ) -> None:
        self.address, self.data_address = address, data_address
        self.where = f"{address} (data plane {data_address})"  # for messages
        self.retry, self.chunk_bytes, self.run_id = retry, chunk_bytes, run_id
        self._channel = grpc.insecure_channel(address)
        self._stub = weights_pb2_grpc.WeightBrokerStub(self._channel)

    def publish(self, version: int, specs: Sequence[TensorSpec], tensors: TensorSource) -> PublishResult:
        """Publish ``version``; transient failures are retried, calling ``tensors()`` again each time."""
        return self._retrying(
            f"publish of version {version} to {self.where}",
            lambda: self.publish_once(version, specs, tensors()),
        )

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        """One attempt that consumes ``tensors`` once, lazily, in the order of ``specs``; raises on any failure
        (:meth:`is_transient` says whether another attempt may succeed). For callers that must coordinate
        retries themselves, such as ZeRO-3 ranks gathering in lockstep."""
        t0 = time.monotonic()
        frames = publish_frames(version, specs, tensors, self.chunk_bytes, self.run_id)
        status = dataplane.publish(self.data_address, frames, self.retry.timeout_s)
        if not status.get("ok"):
            reason, message = status.get("reason"), str(status.get("message"))
            if reason == "duplicate":
                raise VersionExists(message)
            if reason == "stale":
                raise StalePublish(message)
            raise PublishRejected(str(reason), message)
        return PublishResult(int(status["policy_version"]), int(status["total_bytes"]), time.monotonic() - t0)

    def fetch(
        self, sink: Sink, version: int | None = None, start_tensor: str = ""
    ) -> weights_pb2.VersionManifest:
        """Hand every tensor of ``version`` (None: the latest), verified and in order, to ``sink(name, tensor)``.
        A retry continues the same version from the first tensor the sink has not received."""
        pinned: list[int | None] = [version]
        names: list[str] = []
        delivered: list[str] = []

        def pin(manifest: weights_pb2.VersionManifest) -> None:
            pinned[0], names[:] = int(manifest.policy_version), [t.name for t in manifest.tensors]

        def deliver(name: str, tensor: torch.Tensor) -> None:
            sink(name, tensor)
            delivered.append(name)

        def once() -> weights_pb2.VersionManifest:
            start = names[names.index(delivered[-1]) + 1] if delivered else start_tensor
            with self._fetch_stream(pinned[0], start) as sock:
                return receive_fetch(sock, deliver, start, on_manifest=pin)

        what = "the latest version" if version is None else f"version {version}"
        return self._retrying(f"fetch of {what} from {self.where}", once)

    def _fetch_stream(self, version: int | None, start_tensor: str) -> AbstractContextManager[socket.socket]:
        return dataplane.fetch(
            self.data_address, version, start_tensor, self.chunk_bytes, self.retry.timeout_s
        )

    def is_transient(self, exc: BaseException) -> bool:
        """Whether a failed call may succeed if tried again."""
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
            return exc.code() in _TRANSIENT_CODES
        if isinstance(
            exc, PublishRejected
        ):  # another publish in progress, corrupted bytes, the broker's disk
            return exc.reason in ("in_progress", "integrity", "store_error")
        # a corrupted or broken-off fetch stream, a connection refused, reset or timed out
        return isinstance(exc, IntegrityError | BrokenStream | OSError | TimeoutError)

    def latest(self) -> int | None:
        reply = self._control("latest version", self._stub.GetLatest, weights_pb2.GetLatestRequest())
        return int(reply.policy_version) if reply.available else None

    def versions(self) -> list[weights_pb2.VersionManifest]:
        reply = self._control("version list", self._stub.ListVersions, weights_pb2.ListVersionsRequest())
        return list(reply.versions)

    def _control(self, what: str, method: Callable[..., T], request: Any) -> T:
        timeout = min(self.retry.timeout_s, 10)
        return self._retrying(f"{what} from {self.address}", lambda: method(request, timeout=timeout))

    def close(self) -> None:
        self._channel.close()

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, tried up to ``retry.attempts`` times while it fails transiently, with exponential
        backoff; :class:`BrokerUnavailable` (naming ``what``) when the attempts run out."""
        policy, delay = self.retry, self.retry.initial_backoff_s
        for attempt in range(1, policy.attempts + 1):
            try:
                return call()
            except Exception as exc:
                if not self.is_transient(exc):
                    raise
                if attempt == policy.attempts:
                    raise BrokerUnavailable(
                        f"{what} failed {attempt} times; last error: {_describe(exc)}"
                    ) from exc
                log.warning(
                    "%s failed (attempt %d/%d): %s; retrying in %.1fs",
                    what,
                    attempt,
                    policy.attempts,
                    _describe(exc),
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, policy.max_backoff_s)
        raise AssertionError("unreachable")


def transport_from_config(wb: WeightBrokerConfig, run: RunConfig) -> WeightTransport:
    """The run's broker-path transport: the broker at ``advertise_host`` (127.0.0.1 when empty)."""
    host = broker_host(wb)
    retry = RetryPolicy(timeout_s=wb.rpc_timeout_s)
    return WeightTransport(
        f"{host}:{wb.grpc_port}", f"{host}:{wb.data_port}", retry, wb.chunk_bytes, run.run_id
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
