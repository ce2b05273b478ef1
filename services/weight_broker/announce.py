"""Announcements of committed versions on the run's ``weights`` stream: what samplers follow.

Shared by the broker (its servicer announces each version it commits, with its own address) and the
filesystem transport (a learner publishing to a shared path announces each version itself, with the version's
directory), so both write the same :class:`WeightAnnouncement`.
"""

from __future__ import annotations

import time

from services.common.streams.producer import StreamProducer
from vcpo.v1 import weights_pb2


class Announcer:
    """Writes a WeightAnnouncement for each committed version to the run's `weights` stream."""

    def __init__(
        self, producer: StreamProducer[weights_pb2.WeightAnnouncement], transport: str, location: str
    ):
        self.producer, self.transport, self.location = producer, transport, location

    def announce(self, manifest: weights_pb2.VersionManifest, location: str | None = None) -> None:
        self.producer.put(
            weights_pb2.WeightAnnouncement(
                policy_version=manifest.policy_version,
                manifest=manifest,
                transport=self.transport,
                location=location or self.location,
                published_unix=time.time(),
            ),
            int(manifest.policy_version),
        )
