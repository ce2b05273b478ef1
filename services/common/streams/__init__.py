"""The Redis Streams between the services: protobuf entries tagged with policy versions.

Data flow of one hop (``tasks``, ``rollouts``, ``scored`` are *queues*; ``weights`` is a *log*)::

    StreamProducer.put(msg, policy_version)                                              producer.py
        │  Lua, atomically: XLEN < maxlen ? XADD : refuse      (a refused producer waits and retries)
        │                   INCRBY <key>:produced               (what the ledger tells foreign entries by)
        ▼
    stream  vcpo:<run_id>:<name>   fields: policy_version, type, payload (protobuf bytes)       specs.py
        │  XREADGROUP (consumer group, one per queue)
        ▼
    StreamConsumer.read() ──► Entry(id, policy_version, message) ──► the caller's work        consumer.py
                                                                       │ once its effect is durable
    StreamConsumer.ack(ids) ◄──────────────────────────────────────────┘  XACK + XDEL in one MULTI

What blocks what: a producer blocks while its queue holds ``maxlen`` entries that are unread or read but
unacknowledged, so a slow consumer holds its producers back and Redis memory stays bounded. Entries are
deleted only when acknowledged, so the cap never trims an entry nobody processed. A consumer that dies
leaves its entries pending; another consumer takes them over with :meth:`StreamConsumer.reclaim` once they
have been idle for ``reclaim_idle_ms``; an entry delivered ``max_deliveries`` times without an ack, or one
that cannot be decoded, goes to the dead-letter stream ``<key>:dead`` and is counted, never lost silently.

The ``weights`` log is read by every sampler (plain XREAD, no group: :class:`StreamTail`) and trimmed to its
last ``weights_maxlen`` announcements; only the newest matters.

One module per side of a hop:

    specs.py      the four streams (keys, message types, caps), the entry format and its decoding, the
                  Redis client every service connects with
    producer.py   writing: the capped, idempotent XADD script and the wait on a full queue
    consumer.py   reading: consumer groups, acks, reclaiming from stopped consumers, the dead-letter
                  stream; and the plain tail of a log
    metrics.py    the counters producers and consumers share, and each stream's length read at scrape time

The lag bound's admission counter, shared by all sampler replicas, is services/common/admission.py.
"""
