"""The broker's client: weight bytes over its TCP data plane, control calls (latest, list) over gRPC.

Publish and fetch send a version's manifest, its tensors' bytes and (publishing) a commit with the checksums
as length-prefixed frames on a plain socket (:mod:`services.weight_transport.dataplane`,
:mod:`services.weight_transport.protocol`): Python gRPC moves large messages at about half a loopback
socket's rate, so the one bulk flow skips it. The checksums, the all-or-nothing commit and the broker's
bookkeeping are the broker's (``dataplane_server.py``, the servicer's ``commit`` and ``fetch``). The broker's refusals come back as
the interface's errors: a duplicate as :class:`VersionExists`, a stale version as :class:`StalePublish`, an
unknown version as ``VersionNotFound``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager

import grpc
import torch

from services.weight_transport import dataplane
from services.weight_transport.dataplane import BrokenStream
from services.weight_transport.protocol import IntegrityError, publish_frames
from services.weight_transport.store import PublishRejected
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transports.base import (
    DEFAULT_RETRY,
    PublishResult,
    RetryPolicy,
    StalePublish,
    VersionExists,
    WeightTransport,
    retrying,
)
from vcpo.v1 import weights_pb2, weights_pb2_grpc

_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code() in _TRANSIENT_CODES
    if isinstance(exc, PublishRejected):  # another publish in progress, corrupted bytes, the broker's disk
        return exc.reason in ("in_progress", "integrity", "store_error")
    # a corrupted or broken-off fetch stream, a connection refused, reset or timed out
    return isinstance(exc, IntegrityError | BrokenStream | OSError | TimeoutError)


class TcpTransport(WeightTransport):
    """The broker with weight bytes over its TCP data plane at ``data_address``, control calls over gRPC at
    ``address`` (see the module docstring)."""

    def __init__(
        self,
        address: str,
        data_address: str,
        retry: RetryPolicy = DEFAULT_RETRY,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
    ) -> None:
        self.address, self.data_address = address, data_address
        self.where = f"{address} (data plane {data_address})"
        self.retry, self.chunk_bytes, self.run_id = retry, chunk_bytes, run_id
        self._channel = grpc.insecure_channel(address)
        self._stub = weights_pb2_grpc.WeightBrokerStub(self._channel)

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
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

    def _fetch_stream(self, version: int | None, start_tensor: str) -> AbstractContextManager[socket.socket]:
        return dataplane.fetch(
            self.data_address, version, start_tensor, self.chunk_bytes, self.retry.timeout_s
        )

    def is_transient(self, exc: BaseException) -> bool:
        return _transient(exc)

    def latest(self) -> int | None:
        def once() -> int | None:
            reply = self._stub.GetLatest(
                weights_pb2.GetLatestRequest(), timeout=min(self.retry.timeout_s, 10)
            )
            return int(reply.policy_version) if reply.available else None

        return retrying(f"latest version from {self.address}", self.retry, once, _transient)

    def versions(self) -> list[weights_pb2.VersionManifest]:
        def once() -> list[weights_pb2.VersionManifest]:
            reply = self._stub.ListVersions(
                weights_pb2.ListVersionsRequest(), timeout=min(self.retry.timeout_s, 10)
            )
            return list(reply.versions)

        return retrying(f"version list from {self.address}", self.retry, once, _transient)

    def close(self) -> None:
        self._channel.close()
