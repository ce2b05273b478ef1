"""What every weight transport is: one interface, bounded retries, the errors a caller acts on.

    learner (rank 0)   transport.publish(version, specs, tensors_fn)   tensors_fn() yields (name, tensor)
                                                                       one bucket at a time
    sampler            transport.fetch(sink, version=None)             sink(name, tensor), verified, in order

A transport implements one attempt of each call (:meth:`WeightTransport.publish_once`, ``_fetch_stream``)
and says which failures are transient (:meth:`WeightTransport.is_transient`); this module adds the rest the
same way for all of them. Every call has a deadline; transient failures (unavailable, deadline, broken
stream, corrupted bytes) are retried with exponential backoff a bounded number of times, and a fetch resumes
from the first tensor its sink has not received. When retries run out the call raises
:class:`BrokerUnavailable` saying what failed; a sampler then keeps generating with the weights it has while
the lag bound allows (admission control refuses it beyond that) and reports the reason.
"""

from __future__ import annotations

import logging
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from services.weight_transport.protocol import Sink, receive_fetch
from services.weight_transport.tensors import TensorSpec
from vcpo.v1 import weights_pb2

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


class WeightTransport(ABC):
    """What the learner and the samplers use; see the module docstring."""

    retry: RetryPolicy
    chunk_bytes: int
    where: str  # for messages: the broker's addresses

    def publish(self, version: int, specs: Sequence[TensorSpec], tensors: TensorSource) -> PublishResult:
        """Publish ``version``; transient failures are retried, calling ``tensors()`` again each time."""
        return retrying(
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
            with self._fetch_stream(cursor.version, start) as sock:
                return receive_fetch(sock, cursor.deliver, start, on_manifest=cursor.pin)

        what = (
            f"fetch of {'the latest version' if version is None else f'version {version}'} from {self.where}"
        )
        return retrying(what, self.retry, once, self.is_transient)

    @abstractmethod
    def _fetch_stream(self, version: int | None, start_tensor: str) -> AbstractContextManager[socket.socket]:
        """A connection whose frames are the fetch of ``version`` from ``start_tensor`` on
        (``protocol.receive_fetch`` reads them)."""

    @abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Whether a failed call may succeed if tried again."""

    @abstractmethod
    def latest(self) -> int | None: ...

    @abstractmethod
    def versions(self) -> list[weights_pb2.VersionManifest]: ...

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


def retrying(
    what: str, policy: RetryPolicy, call: Callable[[], T], transient: Callable[[BaseException], bool]
) -> T:
    """``call()``, tried up to ``policy.attempts`` times while it fails transiently, with exponential backoff;
    :class:`BrokerUnavailable` (naming ``what``) when the attempts run out."""
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


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

    def pin(self, manifest: weights_pb2.VersionManifest) -> None:
        """The fetch's manifest: a retry must continue this version."""
        self.version = int(manifest.policy_version)
        self.names = [t.name for t in manifest.tensors]

    def deliver(self, name: str, tensor: torch.Tensor) -> None:
        self.sink(name, tensor)
        self.delivered += 1
