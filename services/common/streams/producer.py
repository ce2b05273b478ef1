"""Writing to a stream: the one Lua script that adds entries while a queue has room (trimming a log instead),
and the wait of a producer on a full queue.

Decides: a queue's cap holds unread and unacknowledged entries alike, so a producer waits (1 ms to 50 ms
backoff, its ``waiting`` flag up, the time counted) until consumers acknowledge, and raises
:class:`StreamFullError` after ``wait_timeout_s``; a write with a write id is idempotent for
``remember_writes_s``, so a retry across a Redis restart cannot add an entry twice; every entry added is
counted in ``<key>:produced`` by the same script, for the ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Generic

import redis

from services.common.streams.metrics import StreamMetrics
from services.common.streams.specs import M, StreamSpec, message_type_name

log = logging.getLogger(__name__)


class StreamFullError(TimeoutError):
    """A producer waited longer than its timeout for room on a full stream."""


# KEYS[1] stream, KEYS[2] its produced counter, any further KEYS counters of a kind of entry; ARGV: cap
# (0 = none), trim (0 = none), type, the seconds a write's id is remembered, then (policy_version, payload,
# write id) triples. Adds entries while the stream holds fewer than `cap` and counts them in KEYS[2] (and the
# further KEYS); returns the ids added (maybe fewer than asked). A write id ('' = none) makes the write
# idempotent: `<stream>:written:<id>` holds the entry id it got, and a second write with the same id (a client
# retrying a call whose reply a Redis restart cut off) returns that entry id and adds nothing. Marker and entry
# are written by one script, so they reach the append-only file together.
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
if added > 0 then
  for k = 2, #KEYS do redis.call('INCRBY', KEYS[k], added) end
end
return ids
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
        self._type = message_type_name(spec.message_type)
        self._cap = spec.maxlen if spec.mode == "queue" else 0
        self._trim = spec.maxlen if spec.mode == "log" else 0
        self.waiting = False  # true while blocked on a full stream (services report it)
        if metrics:
            metrics.watch(client, spec)
            for counter in (metrics.written, metrics.wait):  # exported at 0 until the first write or wait
                counter.labels(spec.name)

    def put(self, message: M, policy_version: int, write_id: str = "", count_in: Sequence[str] = ()) -> str:
        """Append one message; blocks while the queue is full. Returns the entry id. With a ``write_id``
        (a group id, say) the write is idempotent: writing the same id again returns the first entry's id and
        adds nothing, so a retry across a Redis restart cannot duplicate it. ``count_in``: counter keys raised
        by the same script when the entry is added (a kind of entry the ledger counts apart)."""
        return self.put_many([(message, policy_version)], [write_id], count_in)[0]

    def put_many(
        self,
        items: Sequence[tuple[M, int]],
        write_ids: Sequence[str] | None = None,
        count_in: Sequence[str] = (),
    ) -> list[str]:
        """Append messages in order (batched through one script call); blocks while the queue is full.
        ``write_ids``: one per item ('' for none), and ``count_in``, as in :meth:`put`."""
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
                keys=[self.spec.key, self.spec.produced_key, *count_in],
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
