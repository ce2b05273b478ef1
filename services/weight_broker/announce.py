"""Announcements of committed versions on the run's ``weights`` stream: what samplers follow.

The broker's servicer announces each version it commits, with its own address.
"""

from __future__ import annotations

import time

from services.common.streams.producer import StreamProducer
from vcpo.v1 import weights_pb2


class Announcer:
    """Writes a WeightAnnouncement for each committed version to the run's `weights` stream."""

    def __init__(self, producer: StreamProducer[weights_pb2.WeightAnnouncement], location: str):
        self.producer, self.location = producer, location

    def announce(self, manifest: weights_pb2.VersionManifest) -> None:
        self.producer.put(
            weights_pb2.WeightAnnouncement(
                policy_version=manifest.policy_version,
                manifest=manifest,
                location=self.location,
                published_unix=time.time(),
            ),
            int(manifest.policy_version),
        )
