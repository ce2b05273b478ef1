"""The broker over gRPC: publish as a client stream, fetch as a server stream, latest and list as unary calls.

The two streaming methods carry serialized messages (chunks encoded by :mod:`services.weight_broker.wire`,
the wire format of ``protos/vcpo/v1/weights.proto``), so no protobuf copy of a chunk's payload is made. The
broker's refusals come back as gRPC codes and are raised as the interface's errors: ALREADY_EXISTS as
:class:`VersionExists`, FAILED_PRECONDITION as :class:`StalePublish`, NOT_FOUND as ``VersionNotFound``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import grpc
import torch

from services.weight_broker.protocol import BrokenStream, IntegrityError, publish_requests
from services.weight_broker.store import VersionNotFound
from services.weight_broker.tensors import TensorSpec
from services.weight_broker.transports.base import (
    DEFAULT_RETRY,
    PublishResult,
    RetryPolicy,
    StalePublish,
    VersionExists,
    WeightTransport,
    retrying,
)
from services.weight_broker.wire import Message
from vcpo.v1 import weights_pb2, weights_pb2_grpc

_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


def _raw(message: bytes) -> bytes:
    return message


def _grpc_transient(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code() in _TRANSIENT_CODES
    return isinstance(exc, IntegrityError | BrokenStream)  # a corrupted or broken-off fetch stream


class GrpcTransport(WeightTransport):
    def __init__(
        self,
        address: str,
        retry: RetryPolicy = DEFAULT_RETRY,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.address = self.where = address
        self.retry, self.chunk_bytes, self.run_id = retry, chunk_bytes, run_id
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self._stub = weights_pb2_grpc.WeightBrokerStub(self._channel)
        # the streaming methods carry serialized messages (chunks encoded by `wire`, same wire format)
        self._publish = self._channel.stream_unary(
            "/vcpo.v1.WeightBroker/Publish",
            request_serializer=_raw,
            response_deserializer=weights_pb2.PublishResponse.FromString,
        )
        self._fetch = self._channel.unary_stream(
            "/vcpo.v1.WeightBroker/Fetch",
            request_serializer=weights_pb2.FetchRequest.SerializeToString,
            response_deserializer=_raw,
        )

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        t0 = time.monotonic()
        source_errors: list[BaseException] = []

        def guarded() -> Iterator[bytes]:
            # gRPC reports an exception raised while iterating requests only as "Exception iterating
            # requests!"; keep ours (a tensor that does not match the manifest, a failed gather) to re-raise
            try:
                yield from publish_requests(version, specs, tensors, self.chunk_bytes, self.run_id)
            except BaseException as exc:
                source_errors.append(exc)
                raise

        try:
            reply = self._publish(guarded(), timeout=self.retry.timeout_s)
        except grpc.RpcError as exc:
            if source_errors:
                raise source_errors[0] from None
            code = exc.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:
                raise VersionExists(exc.details()) from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StalePublish(exc.details()) from None
            raise
        return PublishResult(int(reply.policy_version), int(reply.total_bytes), time.monotonic() - t0)

    def _fetch_stream(self, version: int | None, start_tensor: str) -> Iterator[Message]:
        request = weights_pb2.FetchRequest(start_tensor=start_tensor, max_chunk_bytes=self.chunk_bytes)
        if version is not None:
            request.policy_version = version
        try:
            yield from self._fetch(request, timeout=self.retry.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise VersionNotFound(exc.details()) from None
            raise

    def is_transient(self, exc: BaseException) -> bool:
        return _grpc_transient(exc)

    def latest(self) -> int | None:
        def once() -> int | None:
            reply = self._stub.GetLatest(
                weights_pb2.GetLatestRequest(), timeout=min(self.retry.timeout_s, 10)
            )
            return int(reply.policy_version) if reply.available else None

        return retrying(f"latest version from {self.address}", self.retry, once, _grpc_transient)

    def versions(self) -> list[weights_pb2.VersionManifest]:
        def once() -> list[weights_pb2.VersionManifest]:
            reply = self._stub.ListVersions(
                weights_pb2.ListVersionsRequest(), timeout=min(self.retry.timeout_s, 10)
            )
            return list(reply.versions)

        return retrying(f"version list from {self.address}", self.retry, once, _grpc_transient)

    def close(self) -> None:
        self._channel.close()
