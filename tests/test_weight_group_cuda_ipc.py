"""The weight group's CUDA IPC plane (services/weight_broker/cuda_ipc.py): every member on one GPU, the version
staged there and opened by each receiver through an IPC handle.

On CPU there is no CUDA IPC: these tests stand in for the export and its opening (a registry of this process's
buffers, never a transport) to check what the publisher and receivers do around them: one export per
receiver in the header, the vote, a receiver that cannot open its export, and the fall-back to /dev/shm. The
``gpu``-marked tests run it for real: a publisher and two receiver processes on one GPU, versions exact, and
the publisher's buffers freed once the receivers let go, or once one killed holding its views has ended.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.weight_broker import collective, cuda_ipc
from services.weight_broker.collective import CollectivePublisher
from services.weight_broker.receiver import CollectiveReceiver
from services.weight_broker.weight_group import GroupSpec, TransferFailed, WeightGroup
from tests.test_collective_weights import is_version, specs_of, version_tensors
from tests.test_weight_group_nccl import form, gpus


class StandInIPC:
    """Exports as entries of a registry of this process's buffers; ``refuse``: ranks whose opening fails as a
    driver refusing CUDA IPC would."""

    def __init__(self, refuse: set[int]) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.exported: list[list[str]] = []  # the ranks of each version's exports
        self.refuse = refuse

    def export(self, buffer: torch.Tensor, ranks: Any) -> dict[str, dict[str, Any]]:
        self.buffers[buffer.data_ptr()] = buffer
        out = {str(r): {"buffer": buffer.data_ptr(), "rank": r} for r in ranks}
        self.exported.append(sorted(out))
        return out

    def open_export(self, entry: dict[str, Any], device: torch.device, nbytes: int) -> torch.Tensor:
        if entry["rank"] in self.refuse:
            raise RuntimeError("CUDA error: invalid resource handle")
        return self.buffers[entry["buffer"]][:nbytes]


class CpuStaging(cuda_ipc.DeviceStaging):
    """DeviceStaging's policy (a new buffer per version, let go after the vote) in host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.current = device, None
        self.taken = 0

    def _new(self, nbytes: int) -> torch.Tensor:
        self.taken += 1
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def stand_in_ipc(monkeypatch: pytest.MonkeyPatch) -> StandInIPC:
    ipc = StandInIPC(set())
    monkeypatch.setattr(cuda_ipc, "export", ipc.export)
    monkeypatch.setattr(cuda_ipc, "open_export", ipc.open_export)
    monkeypatch.setattr(collective, "DeviceStaging", CpuStaging)
    return ipc


def _receive_all(groups: list[WeightGroup], got: dict[int, Any]) -> list[threading.Thread]:
    def receive(rank: int) -> None:
        try:
            version, tensors, stats = CollectiveReceiver(groups[rank]).receive()
            got[rank] = (version, is_version(version, tensors), stats.extra["cuda_ipc"])
        except TransferFailed as exc:
            got[rank] = ("failed", str(exc))

    threads = [threading.Thread(target=receive, args=(r,)) for r in range(1, len(groups))]
    for t in threads:
        t.start()
    return threads


def _send(publisher: CollectivePublisher, groups: list[WeightGroup], version: int) -> tuple[Any, dict]:
    got: dict[int, Any] = {}
    threads = _receive_all(groups, got)
    tensors = version_tensors(version)
    try:
        result: Any = publisher.send(version, specs_of(tensors), iter(tensors))
    except TransferFailed as exc:
        result = exc
    for t in threads:
        t.join(timeout=60)
    return result, got


def test_members_on_one_gpu_take_a_version_through_one_export_each(
    stand_in_ipc: StandInIPC, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(monkeypatch, ["GPU-a"] * 3)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60))
    assert all(g.one_gpu and g.shares_gpu for g in groups)
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192, cuda_ipc=True)
    for version in (5, 6):
        stats, got = _send(publisher, groups, version)
        assert got == {1: (version, True, 1.0), 2: (version, True, 1.0)}
        assert (stats.extra["cuda_ipc"], stats.extra["shared_memory"]) == (1.0, 0.0)
        assert publisher._on_gpu.current is None  # let go after the vote; the receivers' views keep it
    assert stand_in_ipc.exported == [["1", "2"]] * 2  # one export per receiver: each gives its own count back
    assert publisher._on_gpu.taken == 2  # a new buffer per version: the last one may still be read
    # without the setting, the same group goes through /dev/shm
    plain = CollectivePublisher(groups[0], bucket_bytes=8192)
    stats, got = _send(plain, groups, 7)
    assert got == {1: (7, True, 0.0), 2: (7, True, 0.0)} and stats.extra["shared_memory"] == 1.0
    for p in (publisher, plain):
        p.close()  # its /dev/shm segments too
    for g in groups:
        g.close()


def test_members_on_two_gpus_never_use_cuda_ipc(
    stand_in_ipc: StandInIPC, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(monkeypatch, ["GPU-a", "GPU-a", "GPU-b"])  # ranks 0 and 1 share a GPU: gloo, but not one GPU
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60))
    assert [g.one_gpu for g in groups] == [False] * 3 and groups[0].shares_gpu
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192, cuda_ipc=True)
    stats, got = _send(publisher, groups, 8)
    assert got == {1: (8, True, 0.0), 2: (8, True, 0.0)} and stats.extra["shared_memory"] == 1.0
    assert stand_in_ipc.exported == []
    publisher.close()
    for g in groups:
        g.close()


def test_a_receiver_that_cannot_open_its_export_votes_it_down_and_the_next_versions_use_dev_shm(
    stand_in_ipc: StandInIPC, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As where a driver or a sandbox refuses CUDA IPC: the version is applied nowhere and the publisher says
    which receiver could not open it and why; the group stays, and the next version arrives through /dev/shm."""
    stand_in_ipc.refuse = {2}
    gpus(monkeypatch, ["GPU-a"] * 3)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192, cuda_ipc=True)
    failed, got = _send(publisher, groups, 9)
    assert isinstance(failed, TransferFailed)
    assert (
        "could not open the CUDA IPC export: rank 2: RuntimeError: CUDA error: invalid resource handle"
        in str(failed)
    )
    assert all(r[0] == "failed" and "not committed" in r[1] for r in got.values()), got
    assert publisher._on_gpu is None and not any(g.closed for g in groups)
    stats, got = _send(publisher, groups, 10)
    assert got == {1: (10, True, 0.0), 2: (10, True, 0.0)}
    assert (stats.extra["cuda_ipc"], stats.extra["shared_memory"]) == (0.0, 1.0)
    publisher.close()
    for g in groups:
        g.close()


def test_device_staging_is_for_cuda_devices_only() -> None:
    with pytest.raises(ValueError, match="CUDA IPC stages versions on a CUDA device, not cpu"):
        cuda_ipc.DeviceStaging(torch.device("cpu"))


# ------------------------------------------------------------------ on a GPU


def _gpu_receiver(spec: GroupSpec, rank: int, out: Any) -> None:  # a process on cuda:0
    torch.cuda.set_device(0)
    group = WeightGroup(spec, rank)
    receiver = CollectiveReceiver(group)
    for _ in range(2):
        version, tensors, stats = receiver.receive()
        on_gpu = all(t.device.type == "cuda" for _, t in tensors)
        out.put(
            (rank, version, on_gpu and is_version(version, [(n, t.cpu()) for n, t in tensors]), stats.extra)
        )
        del tensors  # the engine has loaded it: its count goes back to the publisher
    torch.cuda.synchronize()
    group.close()
    out.put((rank, "released"))
    out.close()
    out.join_thread()
    os._exit(0)


def _gpu_publisher(spec: GroupSpec, out: Any, go: Any) -> None:  # a process on cuda:0
    torch.cuda.set_device(0)
    group = WeightGroup(spec, 0)
    versions = {v: [(n, t.cuda()) for n, t in version_tensors(v)] for v in (21, 22)}
    base = torch.cuda.memory_allocated()
    publisher = CollectivePublisher(group, bucket_bytes=8192, cuda_ipc=True)
    try:
        first = publisher.send(21, specs_of(versions[21]), iter(versions[21]))
        publisher.send_background(22, specs_of(versions[22]), iter(versions[22]))  # staged in this thread
        second = publisher.wait()
        out.put(("sent", group.backend, first.extra, second.extra if second else None, first.bytes))
    except TransferFailed as exc:
        out.put(("failed", group.backend, str(exc), None, 0))
    go.wait(120)  # every receiver let go of its views
    torch.cuda.ipc_collect()
    out.put(("held", torch.cuda.memory_allocated() - base))
    publisher.close()
    group.close()
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.gpu
def test_cuda_ipc_on_one_gpu_delivers_versions_exactly_and_frees_them_once_let_go() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60)
    ctx = mp.get_context("spawn")
    out, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_gpu_receiver, args=(spec, r, out), daemon=True) for r in (1, 2)]
    procs.append(ctx.Process(target=_gpu_publisher, args=(spec, results, go), daemon=True))
    for p in procs:
        p.start()
    status, backend, first, second, nbytes = results.get(timeout=180)
    assert (status, backend) == ("sent", "gloo"), first
    assert first["cuda_ipc"] == second["cuda_ipc"] == 1.0 and first["shared_memory"] == 0.0
    got = [out.get(timeout=60) for _ in range(6)]
    delivered = sorted(g[:3] for g in got if g[1] != "released")
    assert delivered == [(1, 21, True), (1, 22, True), (2, 21, True), (2, 22, True)], got
    assert all(g[3]["cuda_ipc"] == 1.0 for g in got if g[1] != "released")
    assert sorted(g[0] for g in got if g[1] == "released") == [1, 2]
    go.set()
    kind, held = results.get(timeout=60)
    assert kind == "held" and held < nbytes, f"the publisher still holds {held} bytes of its staged versions"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode


def _gpu_holding_receiver(spec: GroupSpec, rank: int, out: Any) -> None:  # a process on cuda:0
    torch.cuda.set_device(0)
    group = WeightGroup(spec, rank)
    version, tensors, _ = CollectiveReceiver(group).receive()
    out.put((rank, version, is_version(version, [(n, t.cpu()) for n, t in tensors])))
    if rank == 2:  # holds its views until it is killed
        while True:
            time.sleep(1)
    del tensors
    torch.cuda.synchronize()
    out.put((rank, "released"))
    out.close()
    out.join_thread()
    group.close()
    os._exit(0)


def _gpu_reclaiming_publisher(spec: GroupSpec, out: Any, go: Any) -> None:  # a process on cuda:0
    torch.cuda.set_device(0)
    group = WeightGroup(spec, 0)
    tensors = [(n, t.cuda()) for n, t in version_tensors(31)]
    base = torch.cuda.memory_allocated()
    publisher = CollectivePublisher(group, bucket_bytes=8192, cuda_ipc=True)
    stats = publisher.send(31, specs_of(tensors), iter(tensors))
    held = [(h.version, h.rank, bool(h.process)) for h in cuda_ipc.HELD.held]
    out.put(("sent", stats.extra["cuda_ipc"], stats.bytes, held, cuda_ipc.HELD.readable))
    go.wait(120)  # rank 1 let go; rank 2 was killed holding its views
    torch.cuda.ipc_collect()
    before = torch.cuda.memory_allocated() - base
    given = [(h.version, h.rank) for h in cuda_ipc.HELD.reclaim()]
    torch.cuda.ipc_collect()
    out.put(("reclaimed", before, torch.cuda.memory_allocated() - base, given, cuda_ipc.HELD.held))
    publisher.close()
    group.close()
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.gpu
def test_cuda_ipc_gives_back_what_a_receiver_killed_holding_its_views_held() -> None:
    """Without the ledger, the version a killed receiver held stayed allocated in the publisher's process until
    it exited (torch's counts cannot tell a dead consumer from a slow one); it is freed once the receiver's
    process has ended. Also checks, on torch's real counter files, the layout HeldExports reads."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60)
    ctx = mp.get_context("spawn")
    out, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    receivers = {
        r: ctx.Process(target=_gpu_holding_receiver, args=(spec, r, out), daemon=True) for r in (1, 2)
    }
    publisher = ctx.Process(target=_gpu_reclaiming_publisher, args=(spec, results, go), daemon=True)
    for p in (*receivers.values(), publisher):
        p.start()
    status, ipc, nbytes, held, readable = results.get(timeout=180)
    assert (status, ipc, readable) == ("sent", 1.0, True)
    assert held == [(31, 1, True), (31, 2, True)]  # each receiver's count, and its process, seen from here
    got = sorted((out.get(timeout=60) for _ in range(3)), key=str)
    assert got == [(1, "released"), (1, 31, True), (2, 31, True)], got
    receivers[2].kill()
    receivers[2].join(30)
    go.set()
    status, before, after, given, left = results.get(timeout=60)
    assert status == "reclaimed" and given == [(31, 2)] and left == []
    assert before >= nbytes, f"the killed receiver's version should still be allocated, {before} bytes are"
    assert after < nbytes, (
        f"the publisher still holds {after} bytes after giving the dead receiver's count back"
    )
    for p in (receivers[1], publisher):
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
