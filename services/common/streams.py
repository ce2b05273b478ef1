"""The Redis Streams between the services: protobuf entries tagged with policy versions.

Data flow of one hop (``tasks``, ``rollouts``, ``scored`` are *queues*; ``weights`` is a *log*)::

    StreamProducer.put(msg, policy_version)
        │  Lua, atomically: XLEN < maxlen ? XADD : refuse      (a refused producer waits and retries)
        │                   INCRBY <key>:produced               (what the ledger tells foreign entries by)
        ▼
    stream  vcpo:<run_id>:<name>   fields: policy_version, type, payload (protobuf bytes)
        │  XREADGROUP (consumer group, one per queue)
        ▼
    StreamConsumer.read() ──► Entry(id, policy_version, message) ──► the caller's work
                                                                       │ once its effect is durable
    StreamConsumer.ack(ids) ◄──────────────────────────────────────────┘  XACK + XDEL in one MULTI

What blocks what: a producer blocks while its queue holds ``maxlen`` entries that are unread or read but
unacknowledged, so a slow consumer holds its producers back and Redis memory stays bounded. Entries are
deleted only when acknowledged, so the cap never trims an entry nobody processed. A consumer that dies
leaves its entries pending; another consumer takes them over with :meth:`StreamConsumer.reclaim` once they
have been idle for ``reclaim_idle_ms``; an entry delivered ``max_deliveries`` times without an ack, or one
that cannot be decoded, goes to the dead-letter stream ``<key>:dead`` and is counted, never lost silently.

The ``weights`` log is read by every sampler (plain XREAD, no group) and trimmed to its last
``weights_maxlen`` announcements; only the newest matters.

:class:`AdmissionCounter` is the lag bound of ARCHITECTURE.md: one Lua check-and-increment shared by all
sampler replicas.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import redis
from google.protobuf.message import DecodeError, Message
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from services.common.config import RunConfig, StreamsConfig
from services.common.observability import Metrics
from vcpo.v1 import rollout_pb2, weights_pb2

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

# The four hops and the protobuf message each carries.
STREAM_TYPES: dict[str, type[Message]] = {
    "tasks": rollout_pb2.Task,
    "rollouts": rollout_pb2.TrajectoryGroup,
    "scored": rollout_pb2.TrajectoryGroup,
    "weights": weights_pb2.WeightAnnouncement,
}
# The consumer group that works through each queue.
STREAM_GROUPS: dict[str, str] = {"tasks": "sampler", "rollouts": "reward", "scored": "learner"}


class StreamFullError(TimeoutError):
    """A producer waited longer than its timeout for room on a full stream."""


class MalformedEntryError(ValueError):
    """A stream entry that cannot be decoded into the stream's message type; names the entry and the reason.

    ``kind`` is a fixed category (a metric label); ``reason`` is the readable detail.
    """

    def __init__(self, stream: str, entry_id: str, kind: str, reason: str) -> None:
        super().__init__(f"malformed entry {entry_id} on stream {stream!r}: {reason}")
        self.stream, self.entry_id, self.kind, self.reason = stream, entry_id, kind, reason


@dataclass(frozen=True)
class StreamSpec(Generic[M]):
    """One stream: its Redis key, message type and capacity rule."""

    name: str
    key: str
    message_type: type[M]
    maxlen: int
    mode: Literal["queue", "log"]
    group: str = ""

    @property
    def dead_letter_key(self) -> str:
        return f"{self.key}:dead"

    @property
    def produced_key(self) -> str:
        return produced_key(self.key)


def produced_key(stream: str) -> str:
    """The counter of entries this system's producers wrote to ``stream`` (raised in the same script as each
    XADD), so that the ledger tells them from entries written by anything else: the stream's entries-added
    minus this is what came from outside."""
    return f"{stream}:produced"


def connect(url: str, retries: int = 5) -> redis.Redis:
    """A Redis client that rides out short outages: each command is retried with bounded exponential backoff.

    A retried write whose first attempt did land would add an entry twice: producers give such writes a write
    id (:meth:`StreamProducer.put`), which makes the retry return the first entry instead.
    """
    client = redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        health_check_interval=30,
    )
    try:
        client.ping()
    except redis.ConnectionError as exc:
        raise ConnectionError(f"cannot reach Redis at {url}: {exc}") from exc
    return client


def stream_key(run_id: str, name: str) -> str:
    return f"vcpo:{run_id}:{name}"


def stream_specs(run: RunConfig, streams: StreamsConfig) -> dict[str, StreamSpec[Any]]:
    """The run's four streams, keyed by hop name."""
    maxlen = {
        "tasks": streams.tasks_maxlen,
        "rollouts": streams.rollouts_maxlen,
        "scored": streams.scored_maxlen,
        "weights": streams.weights_maxlen,
    }
    return {
        name: StreamSpec(
            name=name,
            key=stream_key(run.run_id, name),
            message_type=mtype,
            maxlen=maxlen[name],
            mode="log" if name == "weights" else "queue",
            group=STREAM_GROUPS.get(name, ""),
        )
        for name, mtype in STREAM_TYPES.items()
    }


@dataclass(frozen=True)
class Entry(Generic[M]):
    """A decoded stream entry."""

    id: str
    policy_version: int
    message: M


def _type_name(message_type: type[Message]) -> str:
    return str(message_type.DESCRIPTOR.full_name)


def decode_entry(spec: StreamSpec[M], entry_id: str, fields: dict[bytes, bytes] | None) -> Entry[M]:
    """Decode one raw entry; raise MalformedEntryError naming what is wrong."""
    if not fields:
        raise MalformedEntryError(
            spec.name, entry_id, "empty", "entry has no fields (deleted, or not written by us)"
        )
    missing = [f for f in (b"policy_version", b"type", b"payload") if f not in fields]
    if missing:
        raise MalformedEntryError(
            spec.name, entry_id, "missing_fields", f"missing fields {[m.decode() for m in missing]}"
        )
    type_name = fields[b"type"].decode(errors="replace")
    if type_name != _type_name(spec.message_type):
        raise MalformedEntryError(
            spec.name,
            entry_id,
            "wrong_type",
            f"type {type_name!r}, expected {_type_name(spec.message_type)!r}",
        )
    raw_version = fields[b"policy_version"].decode(errors="replace")
    if not raw_version.isdigit():
        raise MalformedEntryError(
            spec.name,
            entry_id,
            "bad_version",
            f"policy_version {raw_version!r} is not a non-negative integer",
        )
    message = spec.message_type()
    try:
        message.ParseFromString(fields[b"payload"])
    except DecodeError as exc:
        raise MalformedEntryError(
            spec.name, entry_id, "bad_payload", f"payload is not a valid {type_name}: {exc}"
        ) from None
    return Entry(entry_id, int(raw_version), message)


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


# KEYS[1] stream, KEYS[2] its produced counter; ARGV: cap (0 = none), trim (0 = none), type, the seconds a
# write's id is remembered, then (policy_version, payload, write id) triples. Adds entries while the stream
# holds fewer than `cap` and counts them in KEYS[2]; returns the ids added (maybe fewer than asked). A write
# id ('' = none) makes the write idempotent: `<stream>:written:<id>` holds the entry id it got, and a second
# write with the same id (a client retrying a call whose reply a Redis restart cut off) returns that entry id
# and adds nothing. Marker and entry are written by one script, so they reach the append-only file together.
_PUT_LUA = """
local key, cap, trim, typ, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local room = -1
if cap > 0 then room = cap - redis.call('XLEN', key) end
local ids, added = {}, 0
for i = 5, #ARGV, 3 do
  local marker, id = nil, nil
  if ARGV[i + 2] ~= '' then
    marker = key .. ':written:' .. ARGV[i + 2]
    id = redis.call('GET', marker)
  end
  if not id then
    if cap > 0 and room <= 0 then break end
    if trim > 0 then
      id = redis.call('XADD', key, 'MAXLEN', '~', trim, '*',
                      'policy_version', ARGV[i], 'type', typ, 'payload', ARGV[i + 1])
    else
      id = redis.call('XADD', key, '*', 'policy_version', ARGV[i], 'type', typ, 'payload', ARGV[i + 1])
    end
    if marker then redis.call('SET', marker, id, 'EX', ttl) end
    room = room - 1
    added = added + 1
  end
  ids[#ids + 1] = id
end
if added > 0 then redis.call('INCRBY', KEYS[2], added) end
return ids
"""


# KEYS[1] stream; ARGV: group, consumer, ids. Resets the idle time of the ids still pending with `consumer`.
_TOUCH_LUA = """
local touched = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    touched[#touched + 1] = ARGV[i]
  end
end
return touched
"""


class StreamProducer(Generic[M]):
    """Writes protobuf messages to one stream, waiting while a queue is at its cap (back-pressure)."""

    def __init__(
        self,
        client: redis.Redis,
        spec: StreamSpec[M],
        metrics: StreamMetrics | None = None,
        wait_timeout_s: float = 0.0,
        max_batch: int = 256,
        remember_writes_s: int = 86400,
    ) -> None:
        self.client, self.spec, self.metrics = client, spec, metrics
        self.remember_writes_s = remember_writes_s  # how long a write id keeps a retried write from repeating
        self.wait_timeout_s = wait_timeout_s
        self.max_batch = max_batch
        self._put = client.register_script(_PUT_LUA)
        self._type = _type_name(spec.message_type)
        self._cap = spec.maxlen if spec.mode == "queue" else 0
        self._trim = spec.maxlen if spec.mode == "log" else 0
        self.waiting = False  # true while blocked on a full stream (services report it)
        if metrics:
            metrics.watch(client, spec)
            for counter in (metrics.written, metrics.wait):  # exported at 0 until the first write or wait
                counter.labels(spec.name)

    def put(self, message: M, policy_version: int, write_id: str = "") -> str:
        """Append one message; blocks while the queue is full. Returns the entry id. With a ``write_id``
        (a group id, say) the write is idempotent: writing the same id again returns the first entry's id and
        adds nothing, so a retry across a Redis restart cannot duplicate it."""
        return self.put_many([(message, policy_version)], [write_id])[0]

    def put_many(self, items: Sequence[tuple[M, int]], write_ids: Sequence[str] | None = None) -> list[str]:
        """Append messages in order (batched through one script call); blocks while the queue is full.
        ``write_ids``: one per item ('' for none), as in :meth:`put`."""
        if write_ids is not None and len(write_ids) != len(items):
            raise ValueError(f"{len(write_ids)} write ids for {len(items)} items")
        args: list[bytes | int | str] = []
        for n, (message, version) in enumerate(items):
            if not isinstance(message, self.spec.message_type):
                raise TypeError(
                    f"stream {self.spec.name!r} carries {self._type}, got {type(message).__name__}"
                )
            if version < 0:
                raise ValueError(f"policy_version must be >= 0, got {version}")
            args += [version, message.SerializeToString(), write_ids[n] if write_ids is not None else ""]
        ids: list[str] = []
        pending = args
        wait = self.full_wait()
        while pending:
            batch = pending[: 3 * self.max_batch]
            added = self._put(
                keys=[self.spec.key, self.spec.produced_key],
                args=[self._cap, self._trim, self._type, self.remember_writes_s, *batch],
            )
            ids += [i.decode() if isinstance(i, bytes) else str(i) for i in added]
            pending = pending[3 * len(added) :]
            if not pending:
                break
            if len(added) == 0:  # full: wait for consumers to acknowledge
                wait.full(f"{len(ids)} of {len(items)} entries written")
            else:
                wait.progress()
        wait.done()
        if self.metrics:
            self.metrics.written.labels(self.spec.name).inc(len(ids))
        return ids

    def full_wait(self) -> FullWait:
        """The waiting of one write on this (full) queue: backoff, ``waiting`` flag, wait metric, timeout."""
        return FullWait(self)

    def _stop_waiting(self, since: float) -> None:
        self.waiting = False
        self._count_wait(time.monotonic() - since)

    def _count_wait(self, seconds: float) -> None:
        if self.metrics:
            self.metrics.wait.labels(self.spec.name).inc(seconds)


class FullWait:
    """One write waiting for room on a full queue: exponential backoff (1 ms to 50 ms), the producer's
    ``waiting`` flag and wait-time metric, and its ``wait_timeout_s`` (then StreamFullError)."""

    def __init__(self, producer: StreamProducer[Any]) -> None:
        self.producer = producer
        self.since: float | None = None
        self.counted = 0.0  # up to when the wait is in the metric
        self.delay = 0.001

    def full(self, progress: str) -> None:
        """The queue was full: sleep before the next try; raise once the producer's timeout has passed
        (``progress`` says how far the write got, for the error)."""
        p = self.producer
        now = time.monotonic()
        if self.since is None:
            self.since, self.counted, p.waiting = now, now, True
            log.debug("stream %s full (%d entries): producer waiting", p.spec.key, p.spec.maxlen)
        else:  # counted as it goes, so a long wait shows in the metric while it lasts
            p._count_wait(now - self.counted)
            self.counted = now
        if p.wait_timeout_s and now - self.since > p.wait_timeout_s:
            self.done()
            raise StreamFullError(
                f"stream {p.spec.key!r} stayed full ({p.spec.maxlen} unacknowledged entries) for "
                f"{p.wait_timeout_s:.1f}s; {progress}"
            )
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.05)

    def progress(self) -> None:
        """Some entries went in: retry quickly again."""
        self.delay = 0.001

    def done(self) -> None:
        """Stop waiting (written, or given up): clear the flag and count the time spent waiting."""
        if self.since is not None:
            self.producer._stop_waiting(self.counted)
            self.since = None


class StreamConsumer(Generic[M]):
    """One member of a queue's consumer group: read, acknowledge, reclaim from stopped members."""

    def __init__(
        self,
        client: redis.Redis,
        spec: StreamSpec[M],
        consumer: str,
        metrics: StreamMetrics | None = None,
        reclaim_idle_ms: int = 60_000,
        max_deliveries: int = 5,
        group: str | None = None,
    ) -> None:
        if spec.mode != "queue":
            raise ValueError(f"stream {spec.name!r} is a log, not a queue: read it with StreamTail")
        self.client, self.spec, self.consumer, self.metrics = client, spec, consumer, metrics
        self.group = group or spec.group
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_deliveries = max_deliveries
        self._touch = client.register_script(_TOUCH_LUA)
        self.ensure_group()
        if metrics:
            metrics.watch(client, spec)
            for counter in (metrics.read, metrics.acked, metrics.reclaimed):
                counter.labels(spec.name)

    def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if they do not exist yet."""
        try:
            self.client.xgroup_create(self.spec.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int = 1, block_ms: int | None = None) -> list[Entry[M]]:
        """Up to ``count`` new entries; blocks up to ``block_ms`` (None: don't block) when there are none."""
        reply = self.client.xreadgroup(
            self.group, self.consumer, {self.spec.key: ">"}, count=count, block=block_ms
        )
        return self._decode(self._entries_of(reply), "read")

    def pending(self, count: int = 100, after: str = "0") -> list[Entry[M]]:
        """This consumer's own delivered-but-unacknowledged entries with ids above ``after``, oldest first
        (what a restarted consumer redoes); page through them by passing the last id seen."""
        reply = self.client.xreadgroup(self.group, self.consumer, {self.spec.key: after}, count=count)
        return self._decode(self._entries_of(reply), "read")

    def reclaim(self, count: int = 100, min_idle_ms: int | None = None) -> list[Entry[M]]:
        """Take over entries other consumers left pending for at least ``min_idle_ms``.

        Entries delivered ``max_deliveries`` times already go to the dead-letter stream instead.
        """
        idle = self.reclaim_idle_ms if min_idle_ms is None else min_idle_ms
        stale: Any = self.client.xpending_range(self.spec.key, self.group, "-", "+", count, idle=idle)
        if not stale:
            return []
        deliveries = {_s(p["message_id"]): int(p["times_delivered"]) for p in stale}
        # XCLAIM re-checks the idle time atomically, so two reclaimers never both take an entry.
        claimed: Any = self.client.xclaim(self.spec.key, self.group, self.consumer, idle, list(deliveries))
        raw: list[tuple[str, dict[bytes, bytes] | None]] = []
        for entry_id, fields in claimed:
            eid = _s(entry_id)
            if deliveries.get(eid, 0) >= self.max_deliveries:
                detail = f"delivered {deliveries[eid]} times without an ack"
                self._dead_letter(eid, fields, "max_deliveries", detail)
            else:
                raw.append((eid, fields))
        if self.metrics and raw:
            self.metrics.reclaimed.labels(self.spec.name).inc(len(raw))
        return self._decode(raw, "reclaim")

    def ack(self, ids: Sequence[str]) -> int:
        """Acknowledge entries whose effect is durable, and delete them (making room for producers)."""
        if not ids:
            return 0
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.spec.key, self.group, *ids)
        pipe.xdel(self.spec.key, *ids)
        acked, _ = pipe.execute()
        if self.metrics:
            self.metrics.acked.labels(self.spec.name).inc(acked)
        return int(acked)

    def touch(self, ids: Sequence[str]) -> list[str]:
        """Reset the idle time of entries this consumer is still working on, so nobody reclaims them.

        Only entries still pending with this consumer are touched (a plain XCLAIM would take back an entry
        another consumer has reclaimed meanwhile); returns the ids that were.
        """
        if not ids:
            return []
        touched = self._touch(keys=[self.spec.key], args=[self.group, self.consumer, *ids])
        return [_s(i) for i in touched]

    def reject(self, entry: Entry[M], kind: str, reason: str) -> None:
        """Move an entry that decoded but cannot be processed (a bad task) to the dead-letter stream, with why."""
        fields: dict[bytes, bytes] = {
            b"policy_version": str(entry.policy_version).encode(),
            b"type": _type_name(self.spec.message_type).encode(),
            b"payload": entry.message.SerializeToString(),
        }
        self._dead_letter(entry.id, fields, kind, reason)

    def backlog(self) -> int:
        """Entries in the queue: unread plus read-but-unacknowledged."""
        return int(self.client.xlen(self.spec.key))

    @staticmethod
    def _entries_of(reply: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
        if not reply:
            return []
        # RESP2: [[key, [(id, fields), ...]]]
        return [(_s(eid), fields) for _key, entries in reply for eid, fields in entries]

    def _decode(self, raw: list[tuple[str, dict[bytes, bytes] | None]], how: str) -> list[Entry[M]]:
        out: list[Entry[M]] = []
        for entry_id, fields in raw:
            try:
                out.append(decode_entry(self.spec, entry_id, fields))
            except MalformedEntryError as exc:
                log.warning("%s; moved to %s", exc, self.spec.dead_letter_key)
                if self.metrics:
                    self.metrics.malformed.labels(self.spec.name, exc.kind).inc()
                self._dead_letter(entry_id, fields, exc.kind, exc.reason)
        if self.metrics and how == "read" and raw:
            self.metrics.read.labels(self.spec.name).inc(len(raw))
        return out

    def _dead_letter(self, entry_id: str, fields: dict[bytes, bytes] | None, kind: str, reason: str) -> None:
        """Keep the entry (with why) on the dead-letter stream, then ack and delete it from the queue."""
        kept: dict[Any, Any] = dict(fields or {})
        kept.update(
            {
                b"dead_kind": kind,
                b"dead_reason": reason,
                b"dead_entry_id": entry_id,
                b"dead_consumer": self.consumer,
            }
        )
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.spec.dead_letter_key, kept, maxlen=10_000, approximate=True)
        pipe.xack(self.spec.key, self.group, entry_id)
        pipe.xdel(self.spec.key, entry_id)
        pipe.execute()
        if self.metrics:
            self.metrics.dead.labels(self.spec.name, kind).inc()


class StreamTail(Generic[M]):
    """Follows a log stream (``weights``) from a position, as every sampler does; no consumer group."""

    def __init__(
        self,
        client: redis.Redis,
        spec: StreamSpec[M],
        start_id: str = "0",
        metrics: StreamMetrics | None = None,
    ) -> None:
        self.client, self.spec, self.last_id, self.metrics = client, spec, start_id, metrics
        if metrics:
            metrics.watch(client, spec)

    def read(self, count: int = 100, block_ms: int | None = None) -> list[Entry[M]]:
        """Entries after the last one read; malformed ones are logged, counted and skipped."""
        reply = self.client.xread({self.spec.key: self.last_id}, count=count, block=block_ms)
        out = []
        for entry_id, fields in StreamConsumer._entries_of(reply):
            self.last_id = entry_id
            try:
                out.append(decode_entry(self.spec, entry_id, fields))
            except MalformedEntryError as exc:
                log.warning("%s; skipped", exc)
                if self.metrics:
                    self.metrics.malformed.labels(self.spec.name, exc.kind).inc()
        return out

    def latest(self) -> Entry[M] | None:
        """The newest entry, if any (e.g. the latest weight announcement)."""
        reply: Any = self.client.xrevrange(self.spec.key, count=1)
        if not reply:
            return None
        entry_id, fields = reply[0]
        return decode_entry(self.spec, _s(entry_id), fields)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
