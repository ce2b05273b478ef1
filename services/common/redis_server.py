"""A local ``redis-server`` on a free port: for the launcher when no Redis is configured, and for tests.

Runs Debian's ``redis-server`` binary (installed by ``make setup``) as a child process whose PID we keep,
so stopping it never touches another Redis on the machine.

Durability (``persistent=True``): every write goes to the append-only file in ``data_dir`` before Redis
replies (``appendfsync everysec``: the file is fsynced once a second). A killed redis-server loses no
acknowledged write, since the file's pages are in the kernel; a crash of the machine itself can lose the
last second. :meth:`LocalRedis.supervise` restarts a redis-server that died, on the same port, from that
file; clients made by ``services.common.streams.specs.connect`` retry through the restart (about 3 s of
backoff).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from services.common.ports import free_port

log = logging.getLogger(__name__)


class LocalRedis:
    """A redis-server child process. ``persistent=True`` keeps an append-only file in ``data_dir``."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        persistent: bool = False,
        port: int = 0,
        appendfsync: str = "everysec",
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found on PATH: run `make setup` (installs Debian's redis-server)"
            )
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="vcpo-redis-")
        self.data_dir = Path(data_dir or self._tmp.name).absolute()  # type: ignore[union-attr]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.persistent = persistent
        # one flag and its value per line: the pairs are the table's meaning, so the formatter keeps out
        self._args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if persistent else "no",
            "--appendfsync", appendfsync,
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        self.restarts = 0  # done by supervise(), each one up and answering
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        try:
            self._spawn()
        except BaseException:
            if self._tmp is not None:
                self._tmp.cleanup()
            raise

    def _spawn(self) -> None:
        # its own session: a Ctrl-C in the terminal reaches the launcher, which stops Redis last, not Redis
        self.process = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self._wait_ready()

    def supervise(
        self,
        max_restarts: int = 10,
        on_restart: Callable[[int, int], None] | None = None,
        on_give_up: Callable[[int], None] | None = None,
        poll_s: float = 0.1,
    ) -> None:
        """Restart redis-server whenever it exits without :meth:`stop`: on the same port, from its append-only
        file (a non-persistent one comes back empty), up to ``max_restarts`` times, waiting 0, 0.2, 0.4 ... 2 s
        before each. ``on_restart(exit_code, restart_number)`` follows each restart; ``on_give_up(exit_code)``
        is called once the restarts are spent (or a restart itself failed ``max_restarts`` times)."""
        if self._supervisor is not None:
            raise RuntimeError("this redis-server is supervised already")

        def watch() -> None:
            attempts = 0
            while not self._stopping.wait(poll_s):
                code = self.process.poll()
                if code is None:
                    continue
                if attempts >= max_restarts:
                    log.error("redis-server exited with %s and its %d restarts are spent", code, max_restarts)
                    if on_give_up is not None:
                        on_give_up(code)
                    return
                if self._stopping.wait(min(2.0, 0.1 * (2**attempts) if attempts else 0.0)):
                    return
                attempts += 1
                try:
                    self._spawn()
                except Exception:
                    log.exception(
                        "restarting redis-server on port %d failed (attempt %d of %d)",
                        self.port,
                        attempts,
                        max_restarts,
                    )
                    continue
                self.restarts += 1
                log.warning(
                    "redis-server exited with %s; restarted on port %d from %s (restart %d of %d)",
                    code,
                    self.port,
                    "its append-only file" if self.persistent else "nothing",
                    self.restarts,
                    max_restarts,
                )
                if on_restart is not None:
                    on_restart(code, self.restarts)

        self._supervisor = threading.Thread(target=watch, name="redis-supervisor", daemon=True)
        self._supervisor.start()

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
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=15)
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
