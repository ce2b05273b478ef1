"""Counts of CUDA IPC exports no receiver will give back (services/weight_broker/cuda_ipc.py: HeldExports, the
claims, ``settle``): a receiver killed while it holds the publisher's version, and an export no receiver opened.

torch counts each export in a shared-memory file (a 64-byte header, then one int64 per export) that its
receiver decrements when it lets go. On CPU there is no CUDA IPC, so these tests keep such a file themselves
and stand in for torch's decrement; the first test checks the layout read here against the allocator torch
itself uses for those files. The receivers that die are real processes, killed. The ``gpu``-marked test in
test_weight_group_cuda_ipc.py runs it all for real: a receiver killed holding its views on one GPU.
"""

from __future__ import annotations

import base64
import logging
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as torch_mp

from services.common.pids import process_identity
from services.common.ports import free_port
from services.weight_broker import collective, cuda_ipc
from services.weight_broker.buckets import WHOLE, bucket_layout
from services.weight_broker.collective import CollectivePublisher
from services.weight_broker.cuda_ipc import HeldExports
from services.weight_broker.tensors import TensorSpec
from services.weight_broker.weight_group import GroupSpec, TransferFailed
from tests.test_weight_group_cuda_ipc import CpuStaging, StandInIPC, _send
from tests.test_weight_group_nccl import form, gpus


class Counters:
    """A counter file laid out as torch's (64 bytes, then int64 slots), and torch's decrement of a slot."""

    def __init__(self, directory: Path, slots: int = 64) -> None:
        self.handle = b"/torch_test_counters"
        self.path = directory / "torch_test_counters"
        self.path.write_bytes(bytes(64 + 8 * slots))
        self.next = 0
        self.released: list[int] = []  # the slots given back through release_counter, in order

    def new(self, value: int = 1) -> dict[str, Any]:
        """A fresh slot set to ``value``, as torch sets each export's to 1; its entry's counter fields."""
        offset, self.next = self.next, self.next + 1
        self.set(offset, value)
        return {"ref_counter_handle": base64.b64encode(self.handle).decode(), "ref_counter_offset": offset}

    def set(self, offset: int, value: int) -> None:
        with open(self.path, "r+b") as f:
            f.seek(64 + 8 * offset)
            f.write(struct.pack("=q", value))

    def get(self, offset: int) -> int:
        with open(self.path, "rb") as f:
            f.seek(64 + 8 * offset)
            return int(struct.unpack("=q", f.read(8))[0])

    def release(self, handle: bytes, offset: int) -> None:
        assert handle == self.handle
        self.set(offset, self.get(offset) - 1)
        self.released.append(offset)


@pytest.fixture
def counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Counters:
    c = Counters(tmp_path)
    monkeypatch.setattr(cuda_ipc, "COUNTERS_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_ipc, "release_counter", c.release)
    monkeypatch.setattr(cuda_ipc, "HELD", HeldExports())
    return c


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], str]:
    p = subprocess.Popen(["sleep", "600"])
    procs.append(p)
    return p, process_identity(p.pid)


def test_counters_are_read_where_torchs_allocator_keeps_them(tmp_path: Path) -> None:
    """torch's counter files are RefcountedMapAllocator mappings, as are CPU tensors shared by file name: what
    torch writes at slot k is what read_counter reads there."""
    strategy = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        t = torch.zeros(5, dtype=torch.int64).share_memory_()
        _manager, handle, _size = t.untyped_storage()._share_filename_cpu_()
        t[:] = torch.tensor([1, 0, 7, -1, 1 << 40])
        assert [cuda_ipc.read_counter(handle, k) for k in range(5)] == [1, 0, 7, -1, 1 << 40]
        assert cuda_ipc.read_counter(handle, 5) is None  # past the file's end
        assert cuda_ipc.read_counter(b"/torch_no_such_counters", 0) is None
    finally:
        torch_mp.set_sharing_strategy(strategy)


def test_a_dead_receivers_count_is_given_back_and_no_one_elses(
    counters: Counters, sleepers: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    held = cuda_ipc.HELD
    alive, alive_id = _sleeper(sleepers)
    dying, dying_id = _sleeper(sleepers)
    later, later_id = _sleeper(sleepers)
    entries = [counters.new() for _ in range(5)]
    held.add(7, 1, entries[0], alive_id)  # holds its views, alive
    held.add(7, 2, entries[1], dying_id)  # killed holding them
    held.add(7, 3, entries[2], dying_id.replace("pid:[", "pid:[9"))  # in another PID namespace
    held.add(7, 4, entries[3], "")  # said nothing about its process
    held.add(8, 1, entries[4], later_id)  # let go, then killed
    assert len(held.held) == 5
    dying.kill()
    os.waitid(
        os.P_PID, dying.pid, os.WEXITED | os.WNOWAIT
    )  # ended, not reaped: a zombie has ended all the same
    counters.set(4, 0)
    later.kill()
    later.wait()
    with caplog.at_level(logging.WARNING, logger=cuda_ipc.__name__):
        given = held.reclaim()
    assert [(h.version, h.rank) for h in given] == [(7, 2)]
    assert counters.released == [1] and counters.get(1) == 0  # the one count no one else can give back
    assert [(h.version, h.rank) for h in held.held] == [(7, 1), (7, 3), (7, 4)]  # version 8's was given back
    assert "version 7: the receiver of rank 2 ended holding its CUDA IPC views" in caplog.text
    assert (held.reclaimed, held.report(), held.report()) == (1, 1, 0)
    assert held.reclaim() == []  # nothing more: the rest may still be read
    alive.kill()
    alive.wait()
    assert [(h.version, h.rank) for h in held.reclaim()] == [(7, 1)]
    counters.set(2, 0)
    counters.set(3, 0)
    held.reclaim()
    assert held.held == [] and counters.released == [1, 0] and held.reclaimed == 2


def test_a_receiver_this_process_cannot_see_is_never_reclaimed(
    counters: Counters, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """At the export its receiver is alive (it waits for the version): one whose process looks gone from here
    is not one this process can judge, so its count is left to it."""
    gone, gone_id = _sleeper(sleepers)
    gone.kill()
    gone.wait()
    cuda_ipc.HELD.add(3, 1, counters.new(), gone_id)
    assert [h.process for h in cuda_ipc.HELD.held] == [""]
    assert cuda_ipc.HELD.reclaim() == [] and counters.released == []


def test_a_receiver_this_process_cannot_see_is_named_once(
    counters: Counters, sleepers: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver in another PID namespace (or one that named no process) is never judged: its dead versions
    would stay allocated, so the publisher says so, once per receiver, not per version."""
    _, seen_id = _sleeper(sleepers)
    elsewhere = seen_id.replace("pid:[", "pid:[9")
    with caplog.at_level(logging.WARNING, logger=cuda_ipc.__name__):
        for version in (1, 2, 3):
            cuda_ipc.HELD.add(version, 1, counters.new(), seen_id)
            cuda_ipc.HELD.add(version, 2, counters.new(), elsewhere)
            cuda_ipc.HELD.add(version, 3, counters.new(), "")
    warnings = [r.getMessage() for r in caplog.records if "cannot see it" in r.getMessage()]
    assert warnings == [
        f"the CUDA IPC receiver of rank 2 runs where this process cannot see it ({elsewhere}): if it dies "
        "holding a version, that version stays allocated on this GPU until this process exits",
        "the CUDA IPC receiver of rank 3 runs where this process cannot see it (it named no process): if it "
        "dies holding a version, that version stays allocated on this GPU until this process exits",
    ]
    assert [h.process for h in cuda_ipc.HELD.held if h.version == 3] == [seen_id, "", ""]


def test_counts_that_do_not_read_as_torchs_turn_the_ledger_off(
    counters: Counters, sleepers: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    held = cuda_ipc.HELD
    dead, dead_id = _sleeper(sleepers)
    with caplog.at_level(logging.WARNING, logger=cuda_ipc.__name__):
        held.add(4, 1, counters.new(value=0), dead_id)
        held.add(4, 2, counters.new(), dead_id)  # after a misread, nothing is trusted
    assert "a new CUDA IPC export's count reads 0" in caplog.text and not held.readable
    dead.kill()
    dead.wait()
    assert held.held == [] and held.reclaim() == [] and counters.released == []
    held.add(5, 1, {"rank": 1}, dead_id)  # an entry without a counter (never a real export) is not kept


# ------------------------------------------------------------------ through the weight group


class CountedIPC(StandInIPC):
    """The stand-in exports, each with its own count in ``counters``."""

    def __init__(self, counters: Counters) -> None:
        super().__init__(set())
        self.counters = counters
        self.entries: list[dict[str, dict[str, Any]]] = []  # each version's, by rank

    def export(self, buffer: torch.Tensor, ranks: Any) -> dict[str, dict[str, Any]]:
        out = super().export(buffer, ranks)
        for entry in out.values():
            entry.update(self.counters.new())
        self.entries.append(out)
        return out


@pytest.fixture
def counted_ipc(counters: Counters, monkeypatch: pytest.MonkeyPatch) -> CountedIPC:
    ipc = CountedIPC(counters)
    monkeypatch.setattr(cuda_ipc, "export", ipc.export)
    monkeypatch.setattr(cuda_ipc, "open_export", ipc.open_export)
    monkeypatch.setattr(collective, "DeviceStaging", CpuStaging)
    return ipc


def _slot(entry: dict[str, Any]) -> int:
    return int(entry["ref_counter_offset"])


def test_a_receiver_killed_holding_a_version_has_its_count_given_back_at_the_next_one(
    counted_ipc: CountedIPC, counters: Counters, monkeypatch: pytest.MonkeyPatch, sleepers: list[Any]
) -> None:
    """Rank 2's process (here a process of its own, whose identity it gave) is killed holding version 5's views:
    staging version 6 gives its count back, and only its; rank 1's, given back as it let go, is forgotten."""
    gpus(monkeypatch, ["GPU-a"] * 3)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60))
    assert groups[0].get_key("process/1") == process_identity()  # what every member says about itself
    dying, dying_id = _sleeper(sleepers)
    groups[2].set_key("process/2", dying_id)
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192, cuda_ipc=True)
    _, got = _send(publisher, groups, 5)
    assert got == {1: (5, True, 1.0), 2: (5, True, 1.0)}
    five = counted_ipc.entries[0]
    assert [(h.version, h.rank) for h in cuda_ipc.HELD.held] == [(5, 1), (5, 2)]
    assert all(groups[0].get_key(f"ipc/5/{r}") is None for r in (1, 2))  # committed: the claims are gone
    counters.set(_slot(five["1"]), 0)  # rank 1's engine loaded it and let go
    dying.kill()
    dying.wait()
    _, got = _send(publisher, groups, 6)
    assert got == {1: (6, True, 1.0), 2: (6, True, 1.0)}
    assert counters.released == [_slot(five["2"])] and cuda_ipc.HELD.reclaimed == 1
    assert [(h.version, h.rank) for h in cuda_ipc.HELD.held] == [(6, 1), (6, 2)]
    publisher.close()
    for g in groups:
        g.close()


def test_a_failed_version_gives_back_the_exports_no_receiver_claimed(
    counted_ipc: CountedIPC,
    counters: Counters,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 2 fails just before it claims its export of version 9 (as a receiver killed there would): the vote
    fails, and the publisher gives back that export's count, which no receiver will now. Rank 1 claimed and
    opened its export: that count stays its own. A receiver reaching the export after the failure finds it
    claimed and neither opens it nor gives its count back a second time."""
    gpus(monkeypatch, ["GPU-a"] * 3)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=20))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192, cuda_ipc=True)

    def killed(key: str, who: str) -> str:
        raise RuntimeError("killed before its claim")

    with monkeypatch.context() as patch:  # rank 2 claims as it should again afterwards
        patch.setattr(groups[2], "claim", killed)
        failed, got = _send(publisher, groups, 9)
    assert isinstance(failed, TransferFailed) and all(r[0] == "failed" for r in got.values()), (failed, got)
    [nine] = counted_ipc.entries
    assert groups[0].get_key("ipc/9/1") == "receiver" and groups[0].get_key("ipc/9/2") == "publisher"
    assert counters.released == [_slot(nine["2"])] and counters.get(_slot(nine["2"])) == 0
    assert [h.rank for h in cuda_ipc.HELD.held] == [1]  # until its count reads 0 (torch's deleter, on a GPU)
    layout = bucket_layout([TensorSpec("w", "float32", (4,))], WHOLE)
    with caplog.at_level(logging.WARNING, logger=cuda_ipc.__name__):
        assert cuda_ipc.receive_export(groups[2], layout, {"nbytes": 16, "exports": nine}, 9) == []
        assert "version 9: the CUDA IPC export was claimed by the publisher" in caplog.text
        with monkeypatch.context() as patch:  # a store that does not answer: nothing opened, nor given back
            patch.setattr(groups[2], "claim", lambda key, who: None)
            assert cuda_ipc.receive_export(groups[2], layout, {"nbytes": 16, "exports": nine}, 9) == []
        assert "version 9: the group's store did not answer the CUDA IPC export's claim" in caplog.text
    assert counters.released == [_slot(nine["2"])]
    publisher.close()
    for g in groups:
        g.close()


def test_settle_after_a_commit_drops_the_claims_and_gives_nothing_back(
    counted_ipc: CountedIPC, counters: Counters, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(monkeypatch, ["GPU-a"] * 2)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=60))
    entry = counters.new()
    assert groups[1].claim("ipc/3/1", "receiver") == "receiver"
    assert groups[0].claim("ipc/3/1", "publisher") == "receiver"  # the first claim holds
    cuda_ipc.settle(groups[0], 3, {"exports": {"1": entry}}, committed=True)
    assert groups[0].get_key("ipc/3/1") is None and counters.released == []
    for g in groups:
        g.close()
