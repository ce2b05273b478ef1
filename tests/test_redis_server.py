"""The local redis-server the launcher runs when no Redis is configured: killed, it comes back on its port
from its append-only file, with every acknowledged write, and a client made by ``connect`` rides through."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from services.common.redis_server import LocalRedis
from services.common.streams.specs import connect


def test_a_killed_redis_server_restarts_from_its_append_only_file(tmp_path: Path) -> None:
    server = LocalRedis(data_dir=tmp_path / "redis", persistent=True)
    restarted: list[tuple[int, int]] = []
    server.supervise(max_restarts=2, on_restart=lambda code, n: restarted.append((code, n)))
    try:
        client = connect(server.url)
        ids = [client.xadd("vcpo:t:rollouts", {"n": i}) for i in range(200)]
        client.incrby("vcpo:t:rollouts:produced", 200)
        first = server.process.pid
        os.kill(first, signal.SIGKILL)
        # the same client, on its next command: the retry backoff covers the restart
        assert client.xlen("vcpo:t:rollouts") == 200  # every acknowledged write is back
        assert [e[0] for e in client.xrange("vcpo:t:rollouts")] == ids
        assert int(client.get("vcpo:t:rollouts:produced") or 0) == 200
        client.xadd("vcpo:t:rollouts", {"n": 200})  # and it takes writes again
        deadline = time.monotonic() + 5  # (the supervisor counts the restart once its own ping is answered)
        while not restarted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert restarted == [(-signal.SIGKILL, 1)]
        assert server.process.pid != first and server.restarts == 1
    finally:
        server.stop()
    assert server.process.poll() is not None  # stop() is not a death to restart from
    time.sleep(0.3)
    assert server.restarts == 1


def test_restarts_are_bounded_and_the_give_up_is_reported(tmp_path: Path) -> None:
    server = LocalRedis(data_dir=tmp_path / "redis", persistent=True)
    gave_up: list[int] = []
    server.supervise(max_restarts=1, on_give_up=gave_up.append)
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(server.process.pid, signal.SIGKILL)
        while not gave_up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gave_up == [-signal.SIGKILL] and server.restarts == 1
    finally:
        server.stop()


def test_a_bad_fsync_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="appendfsync must be always, everysec or no"):
        LocalRedis(data_dir=tmp_path, persistent=True, appendfsync="sometimes")
