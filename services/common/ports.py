"""Free TCP ports for servers that bind a moment after the port is chosen.

Some ports must be known before their server binds them: the launcher fixes the weight broker's before its
Ray actor starts (about 2 s later), the learner's rendezvous port is handed to every rank, and a child
process is told the port of the Redis or broker it will serve. Asking the kernel for port 0 answers from its
ephemeral range, the same range it takes the local port of every outgoing connection from; on a busy node
(Redis clients, gRPC channels, metrics scrapes) one of them can take the port in that gap, and the server
then fails to bind. So :func:`free_port` picks below that range (20000 up to its start; Ray's workers use
10002-19999 by default), where only another listener can take it, and falls back to the kernel's choice
where the range leaves no room. Each process walks that window from its own random start and never hands
out the same port twice until the window wraps, so two servers of one process never get the same port.
"""

from __future__ import annotations

import errno
import random
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

LOW = 20000  # below: Ray's default worker ports (10002-19999) and well-known services
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_lock = threading.Lock()
_next: int | None = None  # the next port to try in this process (None: not started)


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for the local ports of outgoing connections, or None where it cannot be read."""
    try:
        low, high = (int(x) for x in RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return (low, high) if 0 < low <= high <= 65535 else None


def _window() -> tuple[int, int] | None:
    """The ports to pick from: [LOW, start of the ephemeral range), or above its end; None: no room."""
    span = ephemeral_range()
    if span is None:
        return None
    low, high = span
    if low - LOW >= 256:
        return LOW, low - 1
    if 65535 - high >= 256:
        return high + 1, 65535
    return None


def _bindable(host: str, port: int) -> bool:
    """True if a server could bind ``port`` now (no listener, and no connection lingering on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _os_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, outside the kernel's ephemeral range where it has room (see
    the module's docstring); the kernel's own choice otherwise, or when nothing in the window is free."""
    global _next
    window = _window()
    if window is None:
        return _os_port(host)
    low, high = window
    size = high - low + 1
    with _lock:
        if _next is None or not low <= _next <= high:
            _next = random.randint(low, high)
        for _ in range(min(size, 4096)):
            port = _next
            _next = low if _next >= high else _next + 1
            if _bindable(host, port):
                return port
    return _os_port(host)


def reachable_host(redis_url: str, setting: str) -> str:
    """This machine's address as seen from the run's Redis host: 127.0.0.1 when Redis is local, else the
    address of the interface that routes there (what other nodes of the run reach this one at), IPv4 or IPv6
    as the Redis host resolves (first what resolves first). ``setting`` names the key that overrides it."""
    host = urlparse(redis_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    advice = f"set {setting} to the address this machine is reached at"
    try:
        found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ValueError(
            f"cannot resolve the Redis host {host!r} of {redis_url} to find this machine's address ({exc}): "
            f"{advice}"
        ) from exc
    tried = []
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(address)  # UDP: no packet is sent, the route is looked up
                return str(s.getsockname()[0])
        except OSError as exc:
            tried.append(f"{address[0]}: {exc}")
    raise ValueError(f"no route from this machine to the Redis host {host!r} ({'; '.join(tried)}): {advice}")
