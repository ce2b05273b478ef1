"""The client side of weight distribution: one interface, two transports, bounded retries everywhere.

    learner (rank 0)   transport.publish(version, specs, tensors_fn)   tensors_fn() yields (name, tensor)
                                                                       one bucket at a time
    sampler            transport.fetch(sink, version=None)             sink(name, tensor), verified, in order

- :class:`GrpcTransport` streams through the broker service.
- :class:`FilesystemTransport` reads and writes the broker's disk layout (``v<version>/model.safetensors``
  written under a temporary name and renamed) on a path every process sees: colocated runs and clusters
  with a shared volume. No broker process is involved; announcements go to the `weights` stream directly.

Every call has a deadline; transient failures (unavailable, deadline, broken stream, corrupted bytes) are
retried with exponential backoff a bounded number of times, and a fetch resumes from the first tensor its
sink has not received. When retries run out the call raises :class:`BrokerUnavailable` saying what failed;
a sampler then keeps generating with the weights it has while the lag bound allows (admission control
refuses it beyond that) and reports the reason.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from services.common.config import RunConfig, StreamsConfig
from services.weight_broker.config import WeightBrokerConfig, broker_host
from services.weight_broker.protocol import (
    BrokenStream,
    IntegrityError,
    Sink,
    apply_publish,
    fetch_responses,
    publish_parts,
    publish_requests,
    receive_fetch,
)
from services.weight_broker.servicer import Announcer
from services.weight_broker.store import DiskStore, PublishRejected, VersionNotFound, version_dir
from services.weight_broker.tensors import TensorSpec
from services.weight_broker.wire import Message
from vcpo.v1 import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class BrokerUnavailable(ConnectionError):
    """The broker (or shared path) could not be reached within the retry budget."""


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


@dataclass(frozen=True)
class PublishResult:
    policy_version: int
    total_bytes: int
    seconds: float


class WeightTransport(ABC):
    """What the learner and the samplers use; see the module docstring."""

    retry: RetryPolicy
    chunk_bytes: int
    where: str  # for messages: the broker address or the shared path

    def publish(self, version: int, specs: Sequence[TensorSpec], tensors: TensorSource) -> PublishResult:
        """Publish ``version``; transient failures are retried, calling ``tensors()`` again each time."""
        return _retrying(
            f"publish of version {version} to {self.where}",
            self.retry,
            lambda: self.publish_once(version, specs, tensors()),
            self.is_transient,
        )

    @abstractmethod
    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        """One attempt that consumes ``tensors`` once, lazily, in the order of ``specs``; raises on any failure
        (:meth:`is_transient` says whether another attempt may succeed). For callers that must coordinate
        retries themselves, such as ZeRO-3 ranks gathering in lockstep."""

    def fetch(
        self, sink: Sink, version: int | None = None, start_tensor: str = ""
    ) -> weights_pb2.VersionManifest:
        """Hand every tensor of ``version`` (None: the latest), verified and in order, to ``sink(name, tensor)``.

        A retry continues the same version from the first tensor the sink has not received.
        """
        cursor = _FetchCursor(sink, version, start_tensor)

        def once() -> weights_pb2.VersionManifest:
            start = cursor.next_start()
            return receive_fetch(cursor.pin(self._fetch_stream(cursor.version, start)), cursor.deliver, start)

        what = (
            f"fetch of {'the latest version' if version is None else f'version {version}'} from {self.where}"
        )
        return _retrying(what, self.retry, once, self.is_transient)

    @abstractmethod
    def _fetch_stream(self, version: int | None, start_tensor: str) -> Iterable[Message]:
        """Serialized FetchResponses of ``version`` from ``start_tensor`` on."""

    @abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Whether a failed call may succeed if tried again."""

    @abstractmethod
    def latest(self) -> int | None: ...

    @abstractmethod
    def versions(self) -> list[weights_pb2.VersionManifest]: ...

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


def _retrying(
    what: str, policy: RetryPolicy, call: Callable[[], T], transient: Callable[[BaseException], bool]
) -> T:
    delay = policy.initial_backoff_s
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not transient(exc):
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


def _raw(message: bytes) -> bytes:
    return message


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


def _grpc_transient(exc: BaseException) -> bool:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return exc.code() in _TRANSIENT_CODES
    return isinstance(exc, IntegrityError | BrokenStream)  # a corrupted or broken-off fetch stream


class _FetchCursor:
    """Where a fetch stands: the version it pinned and the tensors its sink has received, so a retry
    continues the same version from the first tensor not yet delivered."""

    def __init__(self, sink: Sink, version: int | None, start_tensor: str) -> None:
        self.sink, self.version, self.start_tensor = sink, version, start_tensor
        self.names: list[str] | None = None
        self.delivered = 0

    def next_start(self) -> str:
        if self.names is None:
            return self.start_tensor
        first = self.names.index(self.start_tensor) if self.start_tensor else 0
        return self.names[first + self.delivered]

    def pin(self, responses: Iterable[Message]) -> Iterator[Message]:
        first = True
        for raw in responses:
            if first:  # the manifest: a retry must continue this version
                manifest = weights_pb2.FetchResponse.FromString(bytes(raw)).manifest
                self.version = int(manifest.policy_version)
                self.names = [t.name for t in manifest.tensors]
                first = False
            yield raw

    def deliver(self, name: str, tensor: torch.Tensor) -> None:
        self.sink(name, tensor)
        self.delivered += 1


class GrpcTransport(WeightTransport):
    def __init__(
        self,
        address: str,
        retry: RetryPolicy = RetryPolicy(),
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

        return _retrying(f"latest version from {self.address}", self.retry, once, _grpc_transient)

    def versions(self) -> list[weights_pb2.VersionManifest]:
        def once() -> list[weights_pb2.VersionManifest]:
            reply = self._stub.ListVersions(
                weights_pb2.ListVersionsRequest(), timeout=min(self.retry.timeout_s, 10)
            )
            return list(reply.versions)

        return _retrying(f"version list from {self.address}", self.retry, once, _grpc_transient)

    def close(self) -> None:
        self._channel.close()


class TcpTransport(GrpcTransport):
    """The broker with weight bytes over its TCP data plane (``dataplane.py``): the gRPC service's publish
    and fetch messages, length-framed on a plain socket, about twice Python gRPC's throughput. Control
    calls (latest, list) stay on gRPC at ``address``; bytes go to ``data_address``."""

    def __init__(
        self,
        address: str,
        data_address: str,
        retry: RetryPolicy = RetryPolicy(),
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
    ) -> None:
        super().__init__(address, retry, chunk_bytes, run_id)
        self.data_address = data_address
        self.where = f"{address} (data plane {data_address})"

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        from services.weight_broker import dataplane

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
        from services.weight_broker import dataplane

        return dataplane.fetch(
            self.data_address, version, start_tensor, self.chunk_bytes, self.retry.timeout_s
        )

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, PublishRejected):
            return exc.reason in ("in_progress", "integrity")
        return isinstance(exc, OSError | TimeoutError) or _grpc_transient(exc)


class FilesystemTransport(WeightTransport):
    """Versions as safetensors directories on a shared path (the broker's disk layout), no broker process."""

    def __init__(
        self,
        root: str | Path,
        retain: int = 3,
        publisher: bool = False,
        announcer: Announcer | None = None,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.root, self.where = Path(root), str(root)
        self.announcer, self.chunk_bytes, self.run_id, self.retry = announcer, chunk_bytes, run_id, retry
        self.store = DiskStore(self.root, retain, owner=publisher)

    def publish_once(
        self, version: int, specs: Sequence[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishResult:
        t0 = time.monotonic()
        try:
            stored = apply_publish(
                self.store, publish_requests(version, specs, tensors, self.chunk_bytes, self.run_id)
            )
        except PublishRejected as exc:
            if exc.reason == "duplicate":
                raise VersionExists(str(exc)) from None
            if exc.reason == "stale":
                raise StalePublish(str(exc)) from None
            raise
        if self.announcer is not None:
            self.announcer.announce(stored.manifest, str(version_dir(self.root, version)))
        return PublishResult(version, int(stored.manifest.total_bytes), time.monotonic() - t0)

    def _fetch_stream(self, version: int | None, start_tensor: str) -> Iterable[Message]:
        return fetch_responses(self.store, version, start_tensor, self.chunk_bytes)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, IntegrityError | OSError)

    def latest(self) -> int | None:
        return self.store.latest()

    def versions(self) -> list[weights_pb2.VersionManifest]:
        return self.store.manifests()

    def path_of(self, version: int) -> Path:
        """The version's directory: what vLLM's ``reload_weights(weights_path=...)`` reads."""
        return version_dir(self.root, version)


def transport_from_config(
    wb: WeightBrokerConfig, run: RunConfig, streams: StreamsConfig, publisher: bool = False
) -> WeightTransport:
    """The run's broker-path transport from its ``[weight_broker]`` section (with ``collective``, the path for
    what the weight group does not carry: ``tcp``): ``tcp`` or ``grpc`` through the broker at
    ``advertise_host`` (127.0.0.1 when empty), or ``filesystem`` on the shared path (a publisher announces
    each version on the run's ``weights`` stream itself, as the broker would)."""
    retry = RetryPolicy(timeout_s=wb.rpc_timeout_s)
    if wb.transport == "filesystem":
        root = wb.storage_dir or str(run.run_dir / "weights")
        announcer = None
        if publisher and run.redis_url:
            from services.common.streams.producer import StreamProducer
            from services.common.streams.specs import connect, stream_specs

            spec = stream_specs(run, streams)["weights"]
            announcer = Announcer(StreamProducer(connect(run.redis_url), spec), "filesystem", root)
        return FilesystemTransport(
            root, wb.retain_versions, publisher, announcer, wb.chunk_bytes, run.run_id, retry
        )
    host = broker_host(wb)
    address = f"{host}:{wb.grpc_port}"
    if wb.transport in ("tcp", "collective"):  # collective: the broker's path is the TCP data plane
        return TcpTransport(address, f"{host}:{wb.data_port}", retry, wb.chunk_bytes, run.run_id)
    return GrpcTransport(address, retry, wb.chunk_bytes, run.run_id)
