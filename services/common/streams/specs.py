"""What a stream is: the four hops' keys, message types and caps, the entry format and how an entry is
decoded, and the Redis client every service reaches the streams with.

Decides: a hop's key is ``vcpo:<run_id>:<name>``; ``weights`` is a log (trimmed), the others are queues
(capped) with one consumer group each; an entry is three fields (``policy_version``, ``type``,
``payload``), and one that lacks a field, names another message type, has a version that is not a
non-negative integer or a payload that does not parse is a :class:`MalformedEntryError` with a fixed
``kind`` (a metric label). Producers and consumers (producer.py, consumer.py) build on these; the package
docstring draws the data flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import redis
from google.protobuf.message import DecodeError, Message
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from services.common.config import RunConfig, StreamsConfig
from vcpo.v1 import rollout_pb2, weights_pb2

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


def agent_groups_key(rollouts: str) -> str:
    """The counter of the groups agents played (the samplers' agent API) among those written to ``rollouts``,
    raised in the same script as their XADD, for the ledger."""
    return f"{rollouts}:produced:agents"


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


def message_type_name(message_type: type[Message]) -> str:
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
    if type_name != message_type_name(spec.message_type):
        raise MalformedEntryError(
            spec.name,
            entry_id,
            "wrong_type",
            f"type {type_name!r}, expected {message_type_name(spec.message_type)!r}",
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
