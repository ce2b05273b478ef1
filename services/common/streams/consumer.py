"""Reading from a stream: a queue's consumer group (read, acknowledge, take over what stopped consumers left,
dead-letter what cannot be processed) and the plain tail of a log.

Decides: an entry is deleted only when acknowledged; one pending for ``reclaim_idle_ms`` may be taken over
by another consumer (XCLAIM re-checks the idle time, so two never both take it); one delivered
``max_deliveries`` times, one that does not decode, or one the caller rejects goes to ``<key>:dead`` with
why, and is acknowledged and counted. A tail skips (and counts) a malformed entry instead: a log has no
consumer group to park it with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Generic

import redis

from services.common.streams.metrics import StreamMetrics
from services.common.streams.specs import (
    Entry,
    M,
    MalformedEntryError,
    StreamSpec,
    decode_entry,
    message_type_name,
)

log = logging.getLogger(__name__)


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
            b"type": message_type_name(self.spec.message_type).encode(),
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
