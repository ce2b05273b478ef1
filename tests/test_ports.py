"""free_port: picks outside the kernel's ephemeral range, never a port a server holds, never one twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common import ports


@pytest.fixture
def range_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "RANGE_FILE", path)
    monkeypatch.setattr(ports, "_next", None)
    return path


def test_ports_come_from_below_the_kernels_range_for_outgoing_connections() -> None:
    span = ports.ephemeral_range()
    assert span is not None  # Linux: /proc/sys/net/ipv4/ip_local_port_range
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == 300  # never the same port twice in a process
    if span[0] - ports.LOW >= 256:
        assert all(ports.LOW <= p < span[0] for p in picked)
    for p in picked[:20]:  # and each was free: a server binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_a_server_holds_is_skipped(range_file: Path) -> None:
    # a window of 256 ports below a range that starts at 20256; hold all but one with listeners
    range_file.write_text("20256 60999\n")
    held: list[socket.socket] = []
    free = None
    try:
        for port in range(ports.LOW, 20256):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()  # someone else's: as good as held
                continue
            if free is None and port >= 20100:
                s.close()
                free = port
                continue
            s.listen()
            held.append(s)
        assert free is not None
        assert ports.free_port() == free
        s = socket.socket()
        s.bind(("127.0.0.1", free))
        s.listen()
        held.append(s)
        # now nothing in the window is free: the kernel's choice (from its real range, not the window)
        assert ports.free_port() >= 20256
    finally:
        for s in held:
            s.close()


def test_the_kernels_choice_where_its_range_leaves_no_room(range_file: Path) -> None:
    range_file.write_text("1024 65535\n")
    assert ports.ephemeral_range() == (1024, 65535)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    range_file.write_text("not numbers\n")
    assert ports.ephemeral_range() is None
    assert ports.free_port() > 0
    range_file.unlink()
    assert ports.ephemeral_range() is None


def test_above_the_range_when_that_is_where_the_room_is(range_file: Path) -> None:
    range_file.write_text("1024 60000\n")
    picked = [ports.free_port() for _ in range(50)]
    assert all(60001 <= p <= 65535 for p in picked)
    assert len(set(picked)) == 50
