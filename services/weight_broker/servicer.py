"""The broker's service: publishes and fetches (for the TCP data plane, ``dataplane_server.py``), its gRPC
control calls (latest, list, status), its metrics, and announcements on the `weights` stream."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator

import grpc

from services.common.observability import Metrics
from services.common.streams.producer import StreamProducer
from services.weight_transport.protocol import apply_publish, fetch_frames
from services.weight_transport.store import PublishRejected, StoredVersion, VersionNotFound, VersionStore
from services.weight_transport.tensors import Buffer
from vcpo.v1 import common_pb2, common_pb2_grpc, weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)


class BrokerMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.latest = metrics.gauge("vcpo_broker_latest_policy_version", "Newest published policy version")
        self.published = metrics.counter("vcpo_broker_versions_published_total", "Versions committed")
        self.rejected = metrics.counter("vcpo_broker_publish_rejected_total", "Publishes refused", ["reason"])
        self.publish_seconds = metrics.histogram(
            "vcpo_broker_publish_seconds",
            "Duration of a successful publish",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
        self.received = metrics.counter(
            "vcpo_broker_received_bytes_total", "Weight bytes of committed versions"
        )
        self.sent = metrics.counter("vcpo_broker_sent_bytes_total", "Weight bytes sent to fetchers")
        self.active_fetches = metrics.gauge("vcpo_broker_active_fetches", "Fetches streaming now")
        self.fetches = metrics.counter("vcpo_broker_fetches_total", "Fetches by outcome", ["outcome"])
        self.stored = metrics.gauge("vcpo_broker_stored_bytes", "Bytes of the retained versions")
        self.announce_failures = metrics.counter(
            "vcpo_broker_announce_failures_total",
            "Announcements that could not be written to the weights stream",
        )


# a full, failing or read-only disk, a volume the broker may not write (a PVC's wrong fsGroup), no descriptors
STORE_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EIO,
        errno.EROFS,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
        errno.EMFILE,
        errno.ENFILE,
        errno.ESTALE,
    }
)


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's storage failing (a full or read-only disk), not the stream that fed it
    (a learner's connection that broke is an OSError too)."""
    return isinstance(exc, OSError) and exc.errno in STORE_ERRNOS


class Announcer:
    """Writes a WeightAnnouncement for each committed version to the run's `weights` stream (what samplers
    follow), naming the broker's address."""

    def __init__(self, producer: StreamProducer[weights_pb2.WeightAnnouncement], location: str):
        self.producer, self.location = producer, location

    def announce(self, manifest: weights_pb2.VersionManifest) -> None:
        announcement = weights_pb2.WeightAnnouncement(
            policy_version=manifest.policy_version,
            manifest=manifest,
            location=self.location,
            published_unix=time.time(),
        )
        self.producer.put(announcement, int(manifest.policy_version))


class WeightBrokerServicer(weights_pb2_grpc.WeightBrokerServicer, common_pb2_grpc.StatusServicer):
    def __init__(
        self,
        store: VersionStore,
        metrics: BrokerMetrics,
        announcer: Announcer | None = None,
        chunk_bytes: int = 4 << 20,
        run_id: str = "",
    ) -> None:
        self.store, self.metrics, self.announcer = store, metrics, announcer
        self.chunk_bytes, self.run_id = chunk_bytes, run_id
        self.started = time.monotonic()
        latest = store.latest()
        if latest is not None:
            metrics.latest.set(latest)
        metrics.stored.set(store.stored_bytes())

    def publish(self, frames: Iterator[memoryview]) -> StoredVersion:
        """Store a publish's frames, then count and announce the version; a refusal (PublishRejected) or the
        store's own failure is counted, logged and raised."""
        started = time.monotonic()
        try:
            stored = apply_publish(self.store, frames)
        except PublishRejected as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            log.warning("publish refused (%s): %s", exc.reason, exc)
            raise
        except OSError as exc:
            if is_store_error(exc):  # the writer was aborted: the store takes the next version
                self.metrics.rejected.labels("store_error").inc()
                log.error("a version was not stored: %s", exc)
            raise
        m, seconds = stored.manifest, time.monotonic() - started
        self.metrics.published.inc()
        self.metrics.received.inc(m.total_bytes)
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.latest.set(m.policy_version)
        self.metrics.stored.set(self.store.stored_bytes())
        log.info(
            "version %d published: %d tensors, %d bytes in %.2fs",
            m.policy_version,
            len(m.tensors),
            m.total_bytes,
            seconds,
        )
        if self.announcer is not None:
            try:
                self.announcer.announce(m)
            except Exception:  # the version is committed and fetchable; samplers also poll GetLatest
                self.metrics.announce_failures.inc()
                log.exception("could not announce version %d on the weights stream", m.policy_version)
        return stored

    def fetch(self, version: int | None, start_tensor: str = "", chunk_bytes: int = 0) -> Iterator[Buffer]:
        """The frames of one fetch, counted; raises VersionNotFound (counted) at once when the version is not
        retained."""
        try:
            frames = fetch_frames(self.store, version, start_tensor, chunk_bytes or self.chunk_bytes)
            head = next(frames)
        except VersionNotFound:
            self.metrics.fetches.labels("not_found").inc()
            raise
        return self._counted(head, frames)

    def _counted(self, head: Buffer, frames: Iterator[Buffer]) -> Iterator[Buffer]:
        self.metrics.active_fetches.inc()
        outcome = "cancelled"
        try:
            yield head
            for frame in frames:
                yield frame
                self.metrics.sent.inc(len(frame))
            outcome = "complete"
        finally:
            self.metrics.active_fetches.dec()
            self.metrics.fetches.labels(outcome).inc()

    def GetLatest(
        self, request: weights_pb2.GetLatestRequest, context: grpc.ServicerContext
    ) -> weights_pb2.GetLatestResponse:
        latest = self.store.latest()
        return weights_pb2.GetLatestResponse(available=latest is not None, policy_version=latest or 0)

    def ListVersions(
        self, request: weights_pb2.ListVersionsRequest, context: grpc.ServicerContext
    ) -> weights_pb2.ListVersionsResponse:
        return weights_pb2.ListVersionsResponse(versions=self.store.manifests())

    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ServiceStatus:
        latest = self.store.latest()
        return common_pb2.ServiceStatus(
            service="weight_broker",
            run_id=self.run_id,
            policy_version=latest or 0,
            state=common_pb2.ServiceStatus.READY,
            detail="no version published yet" if latest is None else f"serving up to version {latest}",
            uptime_seconds=time.monotonic() - self.started,
            figures={
                "stored_bytes": float(self.store.stored_bytes()),
                "versions": float(len(self.store.manifests())),
            },
        )


def add_to_server(servicer: WeightBrokerServicer, server: grpc.Server) -> list[str]:
    """Register vcpo.v1.WeightBroker (the control calls) and vcpo.v1.Status."""
    weights_pb2_grpc.add_WeightBrokerServicer_to_server(servicer, server)
    common_pb2_grpc.add_StatusServicer_to_server(servicer, server)
    return ["vcpo.v1.WeightBroker", "vcpo.v1.Status"]
