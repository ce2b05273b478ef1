"""The stream counters a service exports: entries written, read, acknowledged, reclaimed, dead-lettered,
malformed, and the producers' time waiting on a full queue, labelled by stream; and each stream's length and
cap, read from Redis when ``/metrics`` is scraped.

Decides: one set of counters per service registry, shared by all its producers, consumers and tails, and one
length collector per registry (a second :class:`StreamMetrics` on the same registry reuses it rather than
registering the series twice).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.observability import Metrics
from services.common.streams.specs import StreamSpec

log = logging.getLogger(__name__)


class StreamLengths(Collector):
    """``vcpo_stream_length`` and ``vcpo_stream_capacity`` of every stream a service produces to or reads,
    read from Redis when ``/metrics`` is scraped.

    Why at scrape time rather than a gauge set on each put or ack: a queue's length moves with the other
    services' writes and acks, so a gauge this service set on its own last put would stay high after it
    stopped writing while its consumer drained the queue (and the learner acks only at checkpoints). One
    pipelined ``XLEN`` per scrape is also cheaper than one per write. A scrape while Redis is unreachable
    leaves the series out (absent, not stale) and logs why.
    """

    LENGTH = "vcpo_stream_length"
    CAPACITY = "vcpo_stream_capacity"

    def __init__(self) -> None:
        self._streams: dict[str, tuple[redis.Redis, StreamSpec[Any]]] = {}
        self._lock = threading.Lock()

    def watch(self, client: redis.Redis, spec: StreamSpec[Any]) -> None:
        with self._lock:
            self._streams.setdefault(spec.name, (client, spec))

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        length = GaugeMetricFamily(
            self.LENGTH,
            "Entries in the stream now (a queue: unread or read but unacknowledged)",
            labels=["stream"],
        )
        capacity = GaugeMetricFamily(
            self.CAPACITY, "A queue's cap (producers wait at it); a log's trim length", labels=["stream"]
        )
        return length, capacity

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        length, capacity = self._families()
        with self._lock:
            watched = sorted(self._streams.values(), key=lambda cs: cs[1].name)
        by_client: dict[int, list[tuple[redis.Redis, StreamSpec[Any]]]] = {}
        for client, spec in watched:
            by_client.setdefault(id(client), []).append((client, spec))
        for streams in by_client.values():
            pipe = streams[0][0].pipeline(transaction=False)
            for _, spec in streams:
                pipe.xlen(spec.key)
            try:
                lengths = pipe.execute()
            except redis.RedisError as exc:
                log.warning("stream lengths left out of this scrape: %s", exc)
                continue
            for (_, spec), n in zip(streams, lengths, strict=True):
                length.add_metric([spec.name], float(n))
                capacity.add_metric([spec.name], float(spec.maxlen))
        yield length
        yield capacity


_LENGTHS: weakref.WeakKeyDictionary[Metrics, StreamLengths] = weakref.WeakKeyDictionary()
_LENGTHS_LOCK = threading.Lock()


class StreamMetrics:
    """The counters every producer and consumer of a service shares (labelled by stream name), and the
    length of each stream they use (:class:`StreamLengths`, one per service registry)."""

    def __init__(self, metrics: Metrics) -> None:
        with _LENGTHS_LOCK:
            if metrics not in _LENGTHS:
                _LENGTHS[metrics] = StreamLengths()
                metrics.registry.register(_LENGTHS[metrics])
            self.lengths = _LENGTHS[metrics]
        self.written = metrics.counter("vcpo_stream_entries_written_total", "Entries added", ["stream"])
        self.read = metrics.counter("vcpo_stream_entries_read_total", "Entries delivered", ["stream"])
        self.acked = metrics.counter("vcpo_stream_entries_acked_total", "Entries acknowledged", ["stream"])
        self.reclaimed = metrics.counter(
            "vcpo_stream_entries_reclaimed_total", "Entries taken over from a stopped consumer", ["stream"]
        )
        self.dead = metrics.counter(
            "vcpo_stream_dead_letter_total", "Entries moved to the dead-letter stream", ["stream", "reason"]
        )
        self.malformed = metrics.counter(
            "vcpo_stream_malformed_total", "Entries that could not be decoded", ["stream", "kind"]
        )
        self.wait = metrics.counter(
            "vcpo_stream_producer_wait_seconds_total",
            "Time producers spent waiting on a full stream",
            ["stream"],
        )

    def watch(self, client: redis.Redis, spec: StreamSpec[Any]) -> None:
        """Export the stream's length and cap from now on (producers, consumers and tails call this)."""
        self.lengths.watch(client, spec)
