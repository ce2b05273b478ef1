"""Weights on a shared path, no broker process: colocated runs and clusters with a shared volume.

The transport reads and writes the broker's disk layout itself (a :class:`DiskStore`: ``v<version>/`` with
``model.safetensors`` written under a temporary name and renamed), running both halves of the publish and
fetch protocols in the client, so the checksums and the all-or-nothing commit are the broker's. A publisher
announces each version on the run's ``weights`` stream directly, as the broker would; vLLM can load a version
directory as it is (:meth:`FilesystemTransport.path_of`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from services.weight_broker.announce import Announcer
from services.weight_broker.protocol import IntegrityError, apply_publish, fetch_responses, publish_requests
from services.weight_broker.store import DiskStore, PublishRejected, version_dir
from services.weight_broker.tensors import TensorSpec
from services.weight_broker.transports.base import (
    DEFAULT_RETRY,
    PublishResult,
    RetryPolicy,
    StalePublish,
    VersionExists,
    WeightTransport,
)
from services.weight_broker.wire import Message
from vcpo.v1 import weights_pb2


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
        retry: RetryPolicy = DEFAULT_RETRY,
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
