"""Exactly-once hand-off between two queues: write the result entry and acknowledge the input, atomically.

A stage that reads an entry from one queue and writes its result to the next (the reward service: `rollouts`
→ `scored`) must neither lose an entry nor pass it on twice when it dies or is slow:

    forward(consumer, entry_id, producer, message, policy_version)
        │ one Lua script, atomically:
        │   still pending with *this* consumer?   no ─► nothing written, None  (another consumer
        │                                                reclaimed it and will write it instead)
        │   room on the output queue?             no ─► wait and retry (back-pressure, as producers do)
        ▼   XADD output; XACK + XDEL input        ─► the new entry's id

A stage killed before the script runs leaves its input pending, and another consumer reclaims and redoes it;
one killed after it has nothing left to redo. There is no window in which the output is written and the
input still pending, so the next stage sees each entry once.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import Message

from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer

M = TypeVar("M", bound=Message)
N = TypeVar("N", bound=Message)

# KEYS: input stream, output stream, the output's produced counter. ARGV: group, consumer, entry id, output cap
# (0 = none), type, policy_version, payload. Returns {0} not ours any more, {1} output full, {2, id} written
# (and counted) and acked.
_FORWARD_LUA = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return {0} end
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('XLEN', KEYS[2]) >= cap then return {1} end
local id = redis.call('XADD', KEYS[2], '*', 'policy_version', ARGV[6], 'type', ARGV[5], 'payload', ARGV[7])
redis.call('INCR', KEYS[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return {2, id}
"""


def forward(
    consumer: StreamConsumer[M], entry_id: str, producer: StreamProducer[N], message: N, policy_version: int
) -> str | None:
    """Write ``message`` to the producer's stream and acknowledge ``entry_id`` on the consumer's, atomically.

    Returns the new entry's id, or None when the input entry is no longer pending with this consumer (it
    was reclaimed by another, or already acknowledged): then nothing is written. Waits while the output
    queue is full, up to the producer's ``wait_timeout_s`` (0 = forever), then raises StreamFullError.
    """
    if not isinstance(message, producer.spec.message_type):
        raise TypeError(
            f"stream {producer.spec.name!r} carries {producer.spec.message_type.__name__}, "
            f"got {type(message).__name__}"
        )
    if policy_version < 0:
        raise ValueError(f"policy_version must be >= 0, got {policy_version}")
    script = consumer.client.register_script(_FORWARD_LUA)  # cheap: a SHA, loaded into Redis once
    cap = producer.spec.maxlen if producer.spec.mode == "queue" else 0
    args: list[str | int | bytes] = [
        consumer.group,
        consumer.consumer,
        entry_id,
        cap,
        producer.spec.message_type.DESCRIPTOR.full_name,
        policy_version,
        message.SerializeToString(),
    ]
    wait = producer.full_wait()
    while True:
        reply = script(keys=[consumer.spec.key, producer.spec.key, producer.spec.produced_key], args=args)
        status = int(reply[0])
        if status != 1:  # 1: the output queue is full
            break
        wait.full(f"entry {entry_id} of {consumer.spec.key!r} not forwarded")
    wait.done()
    if status == 0:
        return None
    if producer.metrics:
        producer.metrics.written.labels(producer.spec.name).inc()
    if consumer.metrics:
        consumer.metrics.acked.labels(consumer.spec.name).inc()
    new_id = reply[1]
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)
