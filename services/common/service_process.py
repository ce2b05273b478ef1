"""A service as a plain child process (``python -m <module> <args>``), for benchmarks and tools that want a
real separate process without Ray: started with the allocator settings of services/common/memory.py, logged
to a file, checked through its gRPC health service, stopped by its own PID only (never by name)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.common.memory import service_env
from services.common.observability import check_health


class ServiceProcess:
    def __init__(
        self, name: str, module: str, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.name, self.log_path = name, log_path
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=service_env() if env is None else env,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_healthy(self, target: str, service: str, timeout_s: float = 120.0) -> None:
        """Until ``target``'s gRPC health says ``service`` is SERVING; raises if the process exits first
        (RuntimeError) or time runs out (TimeoutError), naming the log file."""
        deadline = time.monotonic() + timeout_s
        while not check_health(target, service, timeout_s=1.0):
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
