"""A local ``redis-server`` on a free port: for the launcher when no Redis is configured, and for tests.

Runs Debian's ``redis-server`` binary (installed by ``make setup``) as a child process whose PID we keep,
so stopping it never touches another Redis on the machine.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A redis-server child process. ``persistent=True`` keeps an append-only file in ``data_dir``."""

    def __init__(self, data_dir: str | Path | None = None, persistent: bool = False, port: int = 0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found on PATH: run `make setup` (installs Debian's redis-server)"
            )
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="vcpo-redis-")
        self.data_dir = Path(data_dir or self._tmp.name).absolute()  # type: ignore[union-attr]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if persistent else "no",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        # its own session: a Ctrl-C in the terminal reaches the launcher, which stops Redis last, not Redis
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                log = (
                    (self.data_dir / "redis.log").read_text()
                    if (self.data_dir / "redis.log").exists()
                    else ""
                )
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}{log}".strip())
            try:
                with redis.Redis(port=self.port, socket_connect_timeout=0.2) as c:
                    c.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
