"""Service starts, recorded in Redis, from which the launcher counts restarts.

    vcpo:<run_id>:starts   hash   "<service>/<replica>" -> times that replica's process started
                                  "<service>/<replica>:stopped" -> times it stopped on request

Processes that Ray or Serve restart on their own (a sampler replica, the weight broker, a reward replica) say
so here when they start, since the launcher does not see their restarts happen. A sampler replica and the
broker keep their replica name across restarts, so each start after the first is a restart. Serve gives a
replacement reward replica a new name, and also starts and stops replicas when it scales, so for the reward
service a restart is a replica that started, never stopped on request and no longer runs. The launcher clears
the hash when it starts a run (a resumed run counts its own restarts) and counts the learner's and Redis's
restarts itself, since it makes them.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis

log = logging.getLogger(__name__)


def starts_key(run_id: str) -> str:
    return f"vcpo:{run_id}:starts"


def record_start(client: redis.Redis, run_id: str, service: str, replica: str) -> int:
    """Count one start of ``service``'s ``replica``; returns its starts so far (1: the first)."""
    return int(client.hincrby(starts_key(run_id), f"{service}/{replica}", 1))


def record_start_quietly(url: str, run_id: str, service: str, replica: str) -> int:
    """:func:`record_start` for a process without a Redis client of its own; a failure is logged (a start
    that cannot be counted must not stop the service) and returns 0."""
    from services.common.streams.specs import connect

    try:
        client = connect(url)
        try:
            return record_start(client, run_id, service, replica)
        finally:
            client.close()
    except Exception as exc:
        log.warning("could not record the start of %s/%s: %s", service, replica, exc)
        return 0


def record_stop(client: redis.Redis, run_id: str, service: str, replica: str) -> None:
    """Count a stop on request (a scale-down, the run's end): the reward service's starts minus these minus
    its running replicas are the replicas that died."""
    client.hincrby(starts_key(run_id), f"{service}/{replica}:stopped", 1)


def restarts(client: redis.Redis, run_id: str, running: dict[str, int] | None = None) -> Counter[str]:
    """Restarts by service: starts after each replica's first; for services in ``running`` (replicas that are
    replaced under new names: the reward service) starts that neither stopped on request nor run now."""
    raw = client.hgetall(starts_key(run_id))
    started: Counter[str] = Counter()
    stopped: Counter[str] = Counter()
    out: Counter[str] = Counter()
    running = running or {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        service, _, replica = name.partition("/")
        if replica.endswith(":stopped"):
            stopped[service] += int(value)
        elif service in running:
            started[service] += int(value)
        else:
            out[service] += max(0, int(value) - 1)
    for service, alive in running.items():
        out[service] += max(0, started[service] - stopped[service] - alive)
    return out


def clear(client: redis.Redis, run_id: str) -> None:
    client.delete(starts_key(run_id))
