"""The collective transport's shared-memory path: members on one host map each version from the /dev/shm
segment the publisher staged it in, over real gloo groups (threads of this process, or receiver processes)."""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.weight_broker import shared_memory, weight_group
from services.weight_broker.buckets import TransferStats
from services.weight_broker.collective import CollectivePublisher
from services.weight_broker.receiver import CollectiveReceiver
from services.weight_broker.shared_memory import SHM_DIR, PinnedStaging, SharedSegment, sweep_stale
from services.weight_broker.weight_group import GroupSpec, TransferFailed, WeightGroup
from tests.test_collective_weights import is_version, specs_of, start_receivers, version_tensors
from tests.test_weight_group_nccl import form

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{shared_memory.PREFIX}{os.getpid()}-*")}


def receive_in_threads(groups: list[WeightGroup], versions: int) -> tuple[dict[int, list[Any]], Any]:
    """Every receiver rank of ``groups`` receives ``versions`` versions in a thread; each result is (version,
    bit-exact, its stats) or ("failed", why)."""
    got: dict[int, list[Any]] = {g.rank: [] for g in groups[1:]}

    def receive(group: WeightGroup) -> None:
        for _ in range(versions):
            try:
                version, tensors, stats = CollectiveReceiver(group).receive()
                got[group.rank].append((version, is_version(version, tensors), stats))
            except TransferFailed as exc:
                got[group.rank].append(("failed", str(exc)))

    threads = [threading.Thread(target=receive, args=(g,), name=f"receiver-{g.rank}") for g in groups[1:]]
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()

    return got, join


@pytest.fixture
def group3() -> Iterator[list[WeightGroup]]:
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=30))
    yield groups
    for g in groups:
        g.close()


def test_receivers_map_each_version_and_keep_it_after_the_publisher_moves_on(
    group3: list[WeightGroup],
) -> None:
    """Every receiver maps the publisher's segment (one copy of the version in memory, however many hold it).
    Its name goes once every receiver has voted; the pages stay with the receivers' views, unchanged by the
    versions staged after it, and a receiver's write into its views touches only its own copy of the page."""
    assert all(g.same_host for g in group3)  # every rank set the same /dev/shm identity before arriving
    publisher = CollectivePublisher(group3[0], bucket_bytes=8192, shared_memory=True)
    assert publisher.shared
    held: dict[int, list[Any]] = {1: [], 2: []}

    def receive(group: WeightGroup) -> None:
        for _ in range(2):
            held[group.rank].append(CollectiveReceiver(group).receive())

    threads = [threading.Thread(target=receive, args=(g,)) for g in group3[1:]]
    for t in threads:
        t.start()
    sent = []
    for version in (5, 6):
        tensors = version_tensors(version)
        sent.append(publisher.send(version, specs_of(tensors), iter(tensors)))
        assert publisher._segments.reserving is not None
        publisher._segments.settle()
        spare = publisher._segments.spare
        assert spare is not None and segments() == {spare.name}  # the sent one unlinked after the vote
    for t in threads:
        t.join(timeout=60)
    assert [s.extra["shared_memory"] for s in sent] == [1.0, 1.0]
    assert [s.buckets for s in sent] == [1, 1]  # the whole version, no buckets over the sockets
    publisher.close()
    assert not segments()
    (v5, tensors5, stats5), (v6, tensors6, _) = held[1]
    assert (v5, v6) == (5, 6) and stats5.extra["shared_memory"] == 1.0
    assert is_version(5, tensors5) and is_version(6, tensors6)  # 5 intact after 6 was staged
    assert [v for v, *_ in held[2]] == [5, 6] and is_version(5, held[2][0][1])
    tensors5[0][1].zero_()  # rank 1's engine converts a weight in place: copy-on-write
    assert is_version(5, held[2][0][1]) and not is_version(5, tensors5)


def test_a_background_broadcast_stages_once_into_the_segment(group3: list[WeightGroup]) -> None:
    """``send_background`` stages into the segment itself (the staging buffer is the segment, so the bytes are
    copied once on the publisher), and the next version's segment is reserved once a broadcast ends, not when
    the learner stages; a weight changed after it returned does not reach the receivers."""
    publisher = CollectivePublisher(group3[0], bucket_bytes=8192, shared_memory=True)
    got, join = receive_in_threads(group3, versions=2)
    spare = None
    for version in (11, 12):
        tensors = version_tensors(version)
        publisher.send_background(version, specs_of(tensors), iter(tensors))
        staged = publisher._segments.current
        assert staged is not None and (spare is None or staged is spare)  # the spare reserved meanwhile
        for _, t in tensors:  # the optimizer steps on
            t.zero_()
        stats = publisher.wait()
        assert isinstance(stats, TransferStats) and stats.extra["shared_memory"] == 1.0
        assert publisher._segments.reserving is not None
        publisher._segments.settle()  # reserved once the broadcast ended
        spare = publisher._segments.spare
        assert spare is not None and segments() == {spare.name}  # the sent one's name is gone
    join()
    assert {r: [(v, same) for v, same, _ in got[r]] for r in got} == {
        1: [(11, True), (12, True)],
        2: [(11, True), (12, True)],
    }
    publisher.close()
    assert not segments()


def test_a_receiver_that_cannot_read_the_segment_votes_it_down_and_the_group_goes_on(
    group3: list[WeightGroup], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a member with a /dev/shm of its own would: nothing is applied anywhere, the group is not broken,
    and the next version arrives."""
    real = SharedSegment.attach
    refusals = [1]

    def attach(name: str, nbytes: int) -> SharedSegment:
        if threading.current_thread().name == "receiver-1" and refusals:  # one receiver, once
            refusals.pop()
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", name)
        return real(name, nbytes)

    monkeypatch.setattr(SharedSegment, "attach", staticmethod(attach))
    publisher = CollectivePublisher(group3[0], bucket_bytes=8192, shared_memory=True)
    got, join = receive_in_threads(group3, versions=2)
    tensors = version_tensors(7)
    with caplog.at_level(logging.ERROR), pytest.raises(TransferFailed, match="could not read the shared"):
        publisher.send(7, specs_of(tensors), iter(tensors))
    assert "cannot map the publisher's weight segment" in caplog.text
    assert not group3[0].closed
    tensors = version_tensors(8)
    assert publisher.send(8, specs_of(tensors), iter(tensors)).extra["shared_memory"] == 1.0
    join()
    for rank in (1, 2):
        assert got[rank][0][0] == "failed" and "version 7: not committed" in got[rank][0][1]
        assert got[rank][1][:2] == (8, True)
    publisher.close()


def test_a_full_dev_shm_sends_buckets_instead(
    group3: list[WeightGroup], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(nbytes: int, device: int | None = None) -> SharedSegment:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SharedSegment, "create", staticmethod(full))
    publisher = CollectivePublisher(group3[0], bucket_bytes=8192, shared_memory=True)
    got, join = receive_in_threads(group3, versions=1)
    tensors = version_tensors(9)
    with caplog.at_level(logging.WARNING):
        stats = publisher.send(9, specs_of(tensors), iter(tensors))
    join()
    assert "cannot stage weights in shared memory" in caplog.text and "No space left" in caplog.text
    assert stats.extra["shared_memory"] == 0.0 and stats.buckets > 1 and not publisher.shared
    assert all(got[r][0][:2] == (9, True) for r in (1, 2))
    publisher.close()


def test_members_on_different_hosts_never_share(monkeypatch: pytest.MonkeyPatch) -> None:
    by_rank = ["boot-a/27/node-1", "boot-a/27/node-1", "boot-b/31/node-2"]
    monkeypatch.setattr(
        weight_group,
        "host_identity",
        lambda: by_rank[int(threading.current_thread().name.split("-")[1])],
    )
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=30))
    try:
        assert [g.same_host for g in groups] == [False] * 3
        publisher = CollectivePublisher(groups[0], bucket_bytes=8192, shared_memory=True)
        assert not publisher.shared
        got, join = receive_in_threads(groups, versions=1)
        tensors = version_tensors(3)
        assert publisher.send(3, specs_of(tensors), iter(tensors)).extra["shared_memory"] == 0.0
        join()
        assert all(got[r][0][:2] == (3, True) for r in (1, 2))
        publisher.close()
    finally:
        for g in groups:
            g.close()


def test_a_source_that_breaks_the_header_fails_before_anything_is_announced(
    group3: list[WeightGroup],
) -> None:
    publisher = CollectivePublisher(group3[0], bucket_bytes=8192, shared_memory=True)
    tensors = version_tensors(8)
    with pytest.raises(TransferFailed, match=r"version 8: the source ended at tensor 5 \('ids'\)"):
        publisher.send(8, specs_of(tensors), iter(tensors[:-1]))
    assert group3[1].next_announcement(0) is None  # the receivers never heard of it
    got, join = receive_in_threads(group3, versions=1)
    tensors = version_tensors(10)
    publisher.send(10, specs_of(tensors), iter(tensors))
    join()
    assert all(got[r][0][:2] == (10, True) for r in (1, 2))
    publisher.close()


def test_a_receiver_process_killed_mid_broadcast_fails_the_version_everywhere() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=60)
    procs, out = start_receivers(spec, ["ok", "die-after-header"], versions=2)
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, bucket_bytes=8192, shared_memory=True)
    assert publisher.shared
    tensors = version_tensors(7)
    with pytest.raises(TransferFailed, match="version 7"):
        publisher.send(7, specs_of(tensors), iter(tensors))
    rank, status, why = out.get(timeout=60)
    assert (rank, status) == (1, "failed") and "version 7" in why  # nothing applied
    for p in procs:
        p.join(timeout=30)
    assert procs[1].exitcode == 3
    publisher.close()
    group.close()
    assert not segments()


def test_segments_of_dead_publishers_are_swept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)
    stale = SHM_DIR / f"{shared_memory.PREFIX}{pid}-1"
    stale.write_bytes(b"x" * 10)
    mine = SharedSegment.create(64)
    try:
        assert sweep_stale() == 1 and not stale.exists()
        assert (SHM_DIR / mine.name).exists()  # a live publisher's stays
    finally:
        mine.close()
        stale.unlink(missing_ok=True)
    with pytest.raises(ValueError, match="is not a weight segment's name"):
        SharedSegment.attach("../etc/passwd", 10)
    with pytest.raises(ValueError, match="holds 64 bytes, the header said 128"):
        seg = SharedSegment.create(64)
        try:
            SharedSegment.attach(seg.name, 128)
        finally:
            seg.close()


def test_the_segment_is_reserved_up_front() -> None:
    """Its bytes are allocated when it is created (posix_fallocate), so a /dev/shm without room fails there with
    ENOSPC, never as a SIGBUS when the learner writes into the mapping."""
    seg = SharedSegment.create(8 << 20)
    try:
        assert os.stat(SHM_DIR / seg.name).st_blocks * 512 >= 8 << 20
        assert seg.tensor is not None and seg.tensor.numel() == 8 << 20
        assert torch.count_nonzero(seg.tensor) == 0
    finally:
        seg.close()


def test_staging_with_room_kept_free_leaves_dev_shm_that_room_or_stages_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host copy's leader keeps room in /dev/shm for one more version: the file its engine's workers read
    a broker-path version from goes there too, and a host copy that took that room made every such load
    fail. Neither a new segment, nor the spare, nor the spare's reservation leaves less than ``keep_free``."""
    nbytes, keep = 1 << 20, 3 << 20
    free = [nbytes + keep - 1]
    monkeypatch.setattr(shared_memory, "shm_free", lambda: free[0])
    staging = shared_memory.Staging()
    try:
        with pytest.raises(OSError, match=r"would leave less than the 3145728 kept free") as info:
            staging.take(nbytes, keep_free=keep)
        assert info.value.errno == errno.ENOSPC and staging.current is None
        assert staging.take(nbytes).numel() == nbytes  # nothing kept free: as before
        staging.release()
        free[0] = nbytes + keep
        assert staging.take(nbytes, keep_free=keep).numel() == nbytes and staging.current is not None
        held = staging.current.name
        free[0] = nbytes + keep - 1
        staging.reserve_spare(nbytes, keep_free=keep)
        staging.settle()
        assert staging.spare is None  # it would have left too little: the next take makes its own
        free[0] = nbytes + keep
        staging.reserve_spare(nbytes, keep_free=keep)
        staging.settle()
        assert staging.spare is not None
        spare = staging.spare.name
        staging.release(spare=False)
        free[0] = keep - 1  # something else took /dev/shm meanwhile: the spare goes too, freeing its bytes
        with pytest.raises(OSError, match="staging in the spare segment"):
            staging.take(nbytes, keep_free=keep)
        assert staging.spare is None and staging.current is None
        assert not (SHM_DIR / spare).exists() and not (SHM_DIR / held).exists()
    finally:
        staging.release()


def test_pinned_staging_is_exact_size_reused_and_grown() -> None:
    """The publisher's staging buffer outside /dev/shm: exactly the bytes asked for (torch's pinned allocator
    would round a 65 GB version up to 128 GB), the same memory for the next version of the same size, a new
    buffer for a bigger one, and views that outlive its release stay readable."""
    gc.collect()  # what earlier tests left in reference cycles goes now, not while this one counts
    before = shared_memory.held_host_bytes()
    staging = PinnedStaging()
    nbytes = (5 << 20) + 3
    first = staging.take(nbytes)
    assert first.numel() == nbytes and first.dtype == torch.uint8
    assert staging._tensor is not None and staging._tensor.numel() == nbytes
    first.fill_(7)
    again = staging.take(nbytes - 100)
    assert again.data_ptr() == first.data_ptr() and bool((again == 7).all())
    bigger = staging.take(nbytes + 1)
    assert bigger.numel() == nbytes + 1 and staging._tensor.numel() == nbytes + 1
    assert staging.pinned is torch.cuda.is_available()  # page-locked where CUDA is there
    view = bigger[:10]
    view.fill_(3)
    del first, again
    gc.collect()  # the smaller buffer's views are gone: it goes (not kept beside the bigger one)
    assert shared_memory.held_host_bytes() - before == nbytes + 1
    staging.release()  # a view is still held: the mapping goes when it does
    assert view.tolist() == [3] * 10 and not staging.pinned
    del bigger, view
    gc.collect()
    assert shared_memory.held_host_bytes() == before


class _Cudart:
    """A stand-in for torch's CUDA runtime bindings: what was registered, and when it was unregistered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # CUDA's names
        self.calls.append(("register", address, nbytes))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address, 0))
        return 0


def test_host_buffers_are_exact_size_page_locked_kept_as_one_spare_and_unlocked_before_unmapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver's own host copies of versions: exactly the bytes asked for, registered with CUDA as one
    range, kept (and readable) while any view lives; once the last view goes, kept as the spare for the next
    version of that size (no new mapping, no new registration), one at most; anything else unregistered once,
    before its pages are unmapped (never left registered on addresses a later mapping may reuse)."""
    gc.collect()  # earlier tests' host buffers in reference cycles go now, not through this test's stand-in
    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    before = shared_memory.held_host_bytes()
    buffers = shared_memory.HostBuffers()
    nbytes = (3 << 20) + 5
    whole = buffers.take(nbytes, "a test's host copy")
    first = whole.data_ptr()
    assert whole.numel() == nbytes and whole.dtype == torch.uint8 and whole.device.type == "cpu"
    assert cudart.calls == [("register", first, nbytes)]
    assert shared_memory.held_host_bytes() - before == nbytes
    tail = whole[nbytes - 10 :]
    tail.fill_(9)
    second = buffers.take(nbytes, "a test's host copy")  # the first is still held: a mapping of its own
    other = second.data_ptr()
    assert other != first and cudart.calls[1:] == [("register", other, nbytes)]
    assert shared_memory.held_host_bytes() - before == 2 * nbytes
    del whole
    gc.collect()
    assert tail.tolist() == [9] * 10 and len(cudart.calls) == 2  # a view still holds it
    del tail
    gc.collect()
    assert len(cudart.calls) == 2  # the spare now: still mapped and registered
    third = buffers.take(nbytes, "a test's host copy")
    assert third.data_ptr() == first and len(cudart.calls) == 2  # the spare, as it was
    del second
    gc.collect()  # the spare now
    bigger = buffers.take(nbytes + 1, "a test's host copy")  # another size: the spare goes, a new mapping
    assert cudart.calls[2:] == [("unregister", other, 0), ("register", bigger.data_ptr(), nbytes + 1)]
    assert shared_memory.held_host_bytes() - before == 2 * nbytes + 1
    del bigger
    gc.collect()  # the spare
    buffers.release()  # the group closed: the spare goes now, and the third once its views do
    assert len(cudart.calls) == 5 and cudart.calls[4][0] == "unregister"
    del third
    gc.collect()
    assert cudart.calls[5:] == [("unregister", first, 0)]
    assert shared_memory.held_host_bytes() == before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA: the same memory, not locked
    plain = shared_memory.HostBuffers()
    small = plain.take(64, "a test's host copy")
    assert shared_memory.held_host_bytes() - before == 64
    del small
    gc.collect()  # the spare, never registered
    plain.release()
    assert len(cudart.calls) == 6 and shared_memory.held_host_bytes() == before


def test_page_locking_runs_on_the_owners_device_whichever_thread_does_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver's host copy let go on another thread, and a stager's next segment reserved on its
    background thread, are unlocked and locked on the device current where their owner was made (cuda:3
    here), not on cuda:0, where a thread that never chose a device would make a CUDA context of its own."""
    gc.collect()  # earlier tests' host buffers in reference cycles go now, not through this test's stand-in
    current = threading.local()

    class _Device:  # torch.cuda.device's stand-in: the device current on this thread inside it
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            self.prev = getattr(current, "index", 0)
            current.index = self.index

        def __exit__(self, *exc: object) -> None:
            current.index = self.prev

    calls: list[tuple[str, int, str]] = []

    class _OnDevice(_Cudart):
        def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
            calls.append(("register", getattr(current, "index", 0), threading.current_thread().name))
            return 0

        def cudaHostUnregister(self, address: int) -> int:
            calls.append(("unregister", getattr(current, "index", 0), threading.current_thread().name))
            return 0

    cudart = _OnDevice()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(shared_memory, "cuda_device_here", lambda: 3)
    buffers = shared_memory.HostBuffers()
    held = [buffers.take(4096, "a test's host copy")]
    buffers.release()
    letting_go = threading.Thread(target=held.clear, name="letting-go")  # the last view goes there
    letting_go.start()
    letting_go.join()
    gc.collect()
    staging = shared_memory.Staging()
    staging.take(4096)
    staging.reserve_spare(4096)  # on its background thread
    staging.settle()
    staging.release()
    main = threading.current_thread().name
    assert calls[:2] == [("register", 3, main), ("unregister", 3, "letting-go")]
    assert [(what, device) for what, device, _ in calls[2:]] == [
        ("register", 3),
        ("register", 3),
        ("unregister", 3),
        ("unregister", 3),
    ]
    assert calls[3][2].startswith("weight-segment")  # the spare, reserved in the background
    given = shared_memory.PinnedStaging(5)  # the group's GPU, given, wins over the thread's (3)
    given.take(64)
    given.release()
    assert [(what, device) for what, device, _ in calls[6:]] == [("register", 5), ("unregister", 5)]


def test_a_member_page_locks_on_its_own_gpu_also_where_its_epoch_fell_back_to_gloo() -> None:
    index = WeightGroup.cuda_index.fget  # type: ignore[attr-defined]
    assert index(SimpleNamespace(device=torch.device("cuda", 2), gpu=torch.device("cuda", 2))) == 2
    assert (
        index(SimpleNamespace(device=torch.device("cpu"), gpu=torch.device("cuda", 1))) == 1
    )  # the fallback
    assert index(SimpleNamespace(device=torch.device("cpu"), gpu=None)) is None
    assert index(SimpleNamespace(device=torch.device("cuda"), gpu=None)) is None  # no index: the thread's
