"""The broker with weight bytes over its TCP data plane: about twice Python gRPC's throughput.

Publish and fetch send the gRPC service's own messages, length-framed on a plain socket
(:mod:`services.weight_broker.dataplane`), so the checksums, the all-or-nothing commit and the broker's
bookkeeping are the gRPC path's. Control calls (latest, list) stay on gRPC at ``address``; the bytes go to
``data_address``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from services.weight_broker import dataplane
from services.weight_broker.protocol import publish_parts
from services.weight_broker.store import PublishRejected
from services.weight_broker.tensors import TensorSpec
from services.weight_broker.transports.base import (
    DEFAULT_RETRY,
    PublishResult,
    RetryPolicy,
    StalePublish,
    VersionExists,
)
from services.weight_broker.transports.grpc import GrpcTransport
from services.weight_broker.wire import Message


class TcpTransport(GrpcTransport):
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
        super().__init__(address, retry, chunk_bytes, run_id)
        self.data_address = data_address
        self.where = f"{address} (data plane {data_address})"

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        t0 = time.monotonic()
        messages = publish_parts(version, specs, tensors, self.chunk_bytes, self.run_id)
        status = dataplane.publish(self.data_address, messages, self.retry.timeout_s)
        if not status.get("ok"):
            reason, message = status.get("reason"), str(status.get("message"))
            if reason == "duplicate":
                raise VersionExists(message)
            if reason == "stale":
                raise StalePublish(message)
            raise PublishRejected(str(reason), message)
        return PublishResult(int(status["policy_version"]), int(status["total_bytes"]), time.monotonic() - t0)

    def _fetch_stream(self, version: int | None, start_tensor: str) -> Iterator[Message]:
        return dataplane.fetch(
            self.data_address, version, start_tensor, self.chunk_bytes, self.retry.timeout_s
        )

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, PublishRejected):
            return exc.reason in ("in_progress", "integrity")
        return isinstance(exc, OSError | TimeoutError) or super().is_transient(exc)
