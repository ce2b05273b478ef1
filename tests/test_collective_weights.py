"""The collective weight transport over real gloo process groups: a publisher and receiver processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.weight_transport.buckets import ALIGN, Bucket, bucket_layout, pieces
from services.weight_transport.collective import CollectivePublisher, PinnedStaging
from services.weight_transport.receiver import Background, CollectiveReceiver, NoRoom
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.weight_group import GroupSpec, TransferFailed, WeightGroup


def version_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and shapes, odd sizes (alignment), one tensor larger than a bucket."""
    g = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(37, 16, generator=g)),
        ("model.norm.weight", torch.randn(13, generator=g).to(torch.bfloat16)),
        ("model.layers.0.big", torch.randn(300, 11, generator=g)),  # 13.2 kB > the 8 kB buckets
        ("model.layers.0.bias", torch.randn(3, generator=g, dtype=torch.float64)),
        ("scalar", torch.tensor(float(version))),
        ("ids", torch.arange(5, dtype=torch.int64) * version),
    ]


def is_version(version: int, tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether ``tensors`` are exactly :func:`version_tensors` of ``version``: names, dtypes, shapes, bytes.
    Receivers check in their own process: a tensor put on a queue is a handle into a process that may be gone.
    A receiver's tensors may be on its GPU: compared by their bytes wherever they are."""
    expected = version_tensors(version)
    return [n for n, _ in tensors] == [n for n, _ in expected] and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b)
        for (_, a), (_, b) in zip(tensors, expected, strict=True)
    )


def specs_of(tensors: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in tensors]


def formed(group: WeightGroup, world: int) -> None:
    """Wait (30 s at most) until every rank has said its side of the group is up (``test/formed/<rank>``)."""
    from datetime import timedelta

    group._store.wait([f"test/formed/{r}" for r in range(world)], timedelta(seconds=30))


def _receiver(spec: GroupSpec, rank: int, versions: int, behaviour: str, out: Any) -> None:  # a process
    if behaviour == "arrive-and-die":  # counted in at the rendezvous, then killed before it connects
        import torch.distributed as dist

        from services.weight_transport.weight_group import arrive, open_store

        arrive(dist.PrefixStore(spec.prefix(), open_store(spec)), "ranks_arrived", spec.world_size, 30)
        os._exit(3)
    try:
        group = WeightGroup(spec, rank)
    except TransferFailed as exc:
        out.put((rank, "failed", str(exc)))
        return
    group._store.set(f"test/formed/{rank}", "1")
    if behaviour == "die-after-header":  # joins, sees a version start, and is killed mid-broadcast
        head = torch.zeros(3, dtype=torch.int64, device=group.device)  # NCCL moves CUDA tensors only
        group.ready(1)  # as a receiver says it is in its receive
        group.broadcast(head).wait()
        os._exit(3)
    if behaviour == "fail-and-linger":  # its part fails (as when its link to a dead peer breaks), it stays up
        group.ready(1)
        group.broadcast(torch.zeros(3, dtype=torch.int64, device=group.device)).wait()
        group._mark_failed("rank 1's part failed: Connection reset by peer")
        time.sleep(120)
        os._exit(0)
    if behaviour == "die-idle":  # joins, then is killed between broadcasts (as a sampler replica may be)
        # only once every rank's side of the group is up: a gloo rank whose constructor returned may still be
        # the peer of another rank's handshake, which an exit then breaks (CI saw rank 0's connect fail so)
        formed(group, spec.world_size)
        os._exit(3)
    if behaviour == "no-room-and-linger":  # its own part fails (no room on its device for the version)
        CollectiveReceiver._buffers = no_room(CollectiveReceiver._buffers)  # type: ignore[method-assign]
    receiver = CollectiveReceiver(group)
    if behaviour == "late":  # in the receive only 2 s after the publisher started its broadcast
        time.sleep(2.0)
    for _ in range(versions):
        try:
            version, tensors, _ = receiver.receive()
        except TransferFailed as exc:
            out.put(
                (
                    rank,
                    "failed",
                    f"{type(exc).__name__}: {exc}" if behaviour.startswith("no-room") else str(exc),
                )
            )
            if behaviour.endswith("linger"):  # up, its sockets open, as an NCCL rank stays after its abort
                time.sleep(120)
            if group.closed:  # a broken group: nothing more can arrive through it
                # the abandoned collective stays pending inside gloo until its timeout, and an interpreter
                # exit waits for it: leave at once (a service keeps running and joins a new group instead)
                out.close()
                out.join_thread()
                os._exit(0)
            continue
        # exact, and where the group's buffers are: a GPU worker's GPU under NCCL
        on_device = all(t.device == group.device for _, t in tensors)
        out.put((rank, version, on_device and is_version(version, tensors)))
    group.close()


OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 1.00 GiB (a stand-in)\nmore lines"


def no_room(buffers: Any) -> Any:
    """``CollectiveReceiver._buffers`` on a device without room for the version: every bucket buffer it asks
    ``torch.empty`` for raises torch's out-of-memory error (``torch.empty`` is itself again outside it)."""

    def without_room(self: CollectiveReceiver, layout: list[Bucket], version: int) -> list[torch.Tensor]:
        real = torch.empty

        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise torch.OutOfMemoryError(OUT_OF_MEMORY)

        torch.empty = empty
        try:
            result: list[torch.Tensor] = buffers(self, layout, version)
            return result
        finally:
            torch.empty = real

    return without_room


# receivers are spawned processes that import torch before they arrive: on a loaded 2-core machine that has
# taken over 30 s (the default form timeout); these tests are about what follows the forming
SPAWNED_FORM_S = 120.0


def start_receivers(spec: GroupSpec, behaviours: list[str], versions: int) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(spec, r + 1, versions, b, out), daemon=True)
        for r, b in enumerate(behaviours)
    ]
    for p in procs:
        p.start()
    return procs, out


def test_bucket_layout_aligns_packs_and_isolates_big_tensors() -> None:
    specs = specs_of(version_tensors(1))
    layout = bucket_layout(specs, 8192)
    placed = [i for b in layout for i, _ in b.items]
    assert placed == list(range(len(specs)))  # every tensor once, in order
    for b in layout:
        assert all(off % ALIGN == 0 for _, off in b.items)
        ends = [off + specs[i].nbytes for i, off in b.items]
        assert b.nbytes == ends[-1] and all(e <= s for e, (_, s) in zip(ends, b.items[1:], strict=False))
        assert b.nbytes <= 8192 or len(b.items) == 1
    assert any(len(b.items) == 1 and b.nbytes > 8192 for b in layout)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 64"):
        bucket_layout(specs, 16)


def test_group_spec_names_bad_values() -> None:
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        GroupSpec("127.0.0.1", 1234, 2, backend="mpi")
    with pytest.raises(ValueError, match="at least one receiver"):
        GroupSpec("127.0.0.1", 1234, 1)
    with pytest.raises(ValueError, match=r"port must be in 1\.\.65535"):
        GroupSpec("127.0.0.1", 0, 2)


def test_versions_reach_every_receiver_bit_exact() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=4, timeout_s=60, form_timeout_s=SPAWNED_FORM_S)
    procs, out = start_receivers(spec, ["ok", "ok", "ok"], versions=2)
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, bucket_bytes=8192)
    for version in (5, 6):
        tensors = version_tensors(version)
        stats = publisher.send(version, specs_of(tensors), iter(tensors))
        assert stats.version == version and stats.tensors == len(tensors) and stats.buckets >= 2
    got = [out.get(timeout=60) for _ in range(6)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    group.close()
    assert sorted((r, v) for r, v, _ in got) == [(r, v) for r in (1, 2, 3) for v in (5, 6)]
    assert all(same for *_, same in got)  # names, dtypes, shapes and bytes of every tensor


def test_a_receiver_killed_mid_broadcast_fails_the_version_everywhere() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=4, timeout_s=120, form_timeout_s=SPAWNED_FORM_S)
    procs, out = start_receivers(spec, ["ok", "die-after-header", "ok"], versions=1)
    group = WeightGroup(spec, 0)
    tensors = version_tensors(7)
    with pytest.raises(TransferFailed, match="version 7"):
        CollectivePublisher(group, bucket_bytes=8192).send(7, specs_of(tensors), iter(tensors))
    t0 = time.monotonic()
    results = [out.get(timeout=60) for _ in range(2)]
    # the survivors gave up when rank 0 declared the broadcast failed, not after the 120 s timeout (closing a
    # gloo group does not wake its peers)
    assert time.monotonic() - t0 < 10
    assert sorted(r for r, *_ in results) == [1, 3]
    assert all(status == "failed" and "version 7" in why for _, status, why in results)  # nothing applied
    for p in procs:
        p.join(timeout=30)
    assert procs[1].exitcode == 3


@pytest.mark.parametrize("world", [3, 4])
def test_a_receiver_killed_between_broadcasts_fails_the_next_one_fast(world: int) -> None:
    """A member dies while the group is idle; the next version's broadcast fails on every rank within seconds,
    not after the group's timeout: the rank that meets the dead peer (rank 0, or a receiver whose link to it
    breaks while rank 0 waits on another) marks the broadcast failed in the store, which rank 0 watches. A
    chaos run saw rank 0 wait the whole 120 s timeout here, the samplers starved of versions meanwhile."""
    spec = GroupSpec("127.0.0.1", free_port(), world_size=world, timeout_s=90, form_timeout_s=SPAWNED_FORM_S)
    behaviours = ["ok", "die-idle", "ok"][: world - 1]
    procs, out = start_receivers(spec, behaviours, versions=1)
    group = WeightGroup(spec, 0)
    group._store.set("test/formed/0", "1")
    procs[1].join(timeout=30)
    assert procs[1].exitcode == 3
    tensors = version_tensors(7)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="version 7"):
        CollectivePublisher(group, bucket_bytes=8192).send(7, specs_of(tensors), iter(tensors))
    assert time.monotonic() - t0 < 15, time.monotonic() - t0
    results = [out.get(timeout=30) for _ in range(world - 2)]
    assert all(status == "failed" and "version 7" in why for _, status, why in results), results
    assert time.monotonic() - t0 < 20  # the survivors gave up too


def test_a_receiver_whose_part_failed_stops_every_rank_at_once() -> None:
    """A receiver whose part of a collective failed marks it in the store; rank 0 (in the commit vote, which
    would wait for that receiver until the group's timeout) and the other receivers give up within a second of
    their next check. Seen in a chaos run: the broker's link to a killed sampler broke at once, but rank 0
    waited the whole 120 s in the vote."""
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=90, form_timeout_s=SPAWNED_FORM_S)
    procs, out = start_receivers(spec, ["fail-and-linger", "ok"], versions=1)
    group = WeightGroup(spec, 0)
    tensors = version_tensors(7)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="rank 1's part failed: Connection reset by peer"):
        CollectivePublisher(group, bucket_bytes=8192).send(7, specs_of(tensors), iter(tensors))
    assert time.monotonic() - t0 < 10, time.monotonic() - t0
    rank, status, why = out.get(timeout=30)
    assert (rank, status) == (2, "failed") and "version 7" in why
    assert time.monotonic() - t0 < 15
    for p in procs:
        p.kill()


def test_a_receiver_whose_own_step_fails_names_it_to_every_rank_at_once() -> None:
    """A receiver whose own step fails (here: no room on its device for the version's buffers, torch's
    out-of-memory error) marks its failure in the store before it closes: every other rank gives up at its
    next check with that reason, the one to act on (how much room, and the settings that make it), and nobody
    commits the version. Under NCCL nothing else would wake them (an aborted rank's peers wait in the next
    bucket until the group's timeout, 90 s here)."""
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=90, form_timeout_s=SPAWNED_FORM_S)
    procs, out = start_receivers(spec, ["no-room-and-linger", "ok"], versions=1)
    group = WeightGroup(spec, 0)
    tensors = version_tensors(7)
    t0 = time.monotonic()
    why = (
        r"rank 1's part failed: version 7: receiving failed: version 7 \(0\.00 GiB\) does not fit on cpu beside "
        r"the engine: lower sampler\.gpu_memory_utilization .* or set weight_broker\.transport = \"tcp\" "
        r"\(CUDA out of memory\. Tried to allocate 1\.00 GiB \(a stand-in\)\)$"
    )
    with pytest.raises(TransferFailed, match=why):
        CollectivePublisher(group, bucket_bytes=8192).send(7, specs_of(tensors), iter(tensors))
    assert time.monotonic() - t0 < 10, time.monotonic() - t0
    failed = {rank: (status, message) for rank, status, message in (out.get(timeout=30) for _ in range(2))}
    assert sorted(failed) == [1, 2] and all(status == "failed" for status, _ in failed.values()), failed
    # the one without room says so (its sampler then takes versions through the broker instead)
    assert failed[1][1].startswith(
        "NoRoom: rank 1's part failed: version 7: receiving failed: version 7 (0.00 GiB)"
    )
    assert "rank 1's part failed" in failed[2][1] and "sampler.gpu_memory_utilization" in failed[2][1], failed
    assert time.monotonic() - t0 < 15
    for p in procs:
        p.kill()


def test_a_receiver_without_room_for_the_version_names_what_to_change() -> None:
    """Every bucket of a version is received into a buffer on the receiver's device (a GPU worker's GPU, beside
    its engine): where torch cannot allocate them, the error says which version, how many GiB it needs, and
    the two settings that make room (``sampler.gpu_memory_utilization``) or avoid it (the broker's TCP
    transport); torch's own first line follows, and is its cause."""
    specs = [
        TensorSpec("model.embed_tokens.weight", "bfloat16", (3 << 29,)),
        TensorSpec("b", "float32", (4,)),
    ]
    layout = bucket_layout(specs, 256 << 20)
    receiver = object.__new__(CollectiveReceiver)
    receiver.group = type("Group", (), {"device": torch.device("cuda", 3)})()
    buffers = no_room(CollectiveReceiver._buffers)
    with pytest.raises(NoRoom) as info:
        buffers(receiver, layout, 12)
    said = str(info.value)
    assert said.startswith("version 12 (3.00 GiB) does not fit on cuda:3 beside the engine: "), said
    assert "lower sampler.gpu_memory_utilization so that a version fits" in said
    assert 'or set weight_broker.transport = "tcp"' in said
    assert said.endswith("(CUDA out of memory. Tried to allocate 1.00 GiB (a stand-in))") and "\n" not in said
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert torch.empty(2).numel() == 2  # torch.empty is itself again
    # with room, one buffer of each bucket's size on the group's device
    receiver.group = type("Group", (), {"device": torch.device("cpu")})()
    small = bucket_layout(specs_of(version_tensors(1)), 8192)
    made = receiver._buffers(small, 1)
    assert [(b.numel(), b.dtype, b.device.type) for b in made] == [
        (b.nbytes, torch.uint8, "cpu") for b in small
    ]


def test_pinned_staging_is_exact_size_reused_and_replaced_by_a_bigger_one() -> None:
    """The publisher's staging buffer: exactly the bytes asked for (torch's pinned allocator, left as it is,
    would round a 65 GB version up to 128 GB), the same memory for a later version of the same size or
    smaller, a new buffer for a bigger one, dropped on release (views of it stay readable). Page-locked only
    where CUDA is there."""
    from torch.multiprocessing.reductions import StorageWeakRef

    staging = PinnedStaging()
    nbytes = (5 << 20) + 3
    first = staging.take(nbytes)
    assert first.numel() == nbytes and first.dtype == torch.uint8 and first.device.type == "cpu"
    assert first.untyped_storage().nbytes() == nbytes  # not a rounded-up buffer
    assert first.is_pinned() is torch.cuda.is_available()
    first.fill_(7)
    for later in (nbytes, nbytes - 100):
        again = staging.take(later)
        assert again.numel() == later and again.data_ptr() == first.data_ptr()
        assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        assert bool((again == 7).all())
    old = StorageWeakRef(first.untyped_storage())
    del first, again
    bigger = staging.take(nbytes + 1)
    assert bigger.numel() == nbytes + 1 and bigger.untyped_storage().nbytes() == nbytes + 1
    assert old.expired()  # the smaller one went (not kept beside the bigger one): no views of it were left
    view = bigger[:10]
    view.fill_(3)
    held = StorageWeakRef(bigger.untyped_storage())
    del bigger
    staging.release()
    assert not held.expired() and view.tolist() == [3] * 10  # a view still holds it
    del view
    assert held.expired()  # dropped: the staging buffer keeps nothing after its release
    assert staging.take(64).numel() == 64  # and makes a new one when asked again
    staging.release()


@pytest.mark.slow
def test_a_member_that_dies_while_the_group_connects_fails_it_within_the_forming_timeout() -> None:
    """Every rank arrived, then one died before connecting: the others give up after the forming timeout
    (3 s here), not the collective timeout (90 s), which a chaos run saw a sampler's join wait out (its engine
    stood still meanwhile)."""
    import torch.distributed as dist

    from services.weight_transport.weight_group import open_store

    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=90, form_timeout_s=3)
    store = open_store(spec, master=True)
    procs, out = start_receivers(spec, ["ok", "arrive-and-die"], versions=1)
    # rank 0 comes once both receivers arrived: a spawned receiver's start (importing torch) may take longer
    # than the 3 s forming timeout on a loaded machine, which this test is not about
    arrived, deadline = 0, time.monotonic() + 60
    while arrived < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
        arrived = int(dist.PrefixStore(spec.prefix(), store).add("ranks_arrived", 0))
    assert arrived == 2
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="the ranks did not connect within 3s"):
        WeightGroup(spec, 0, store=store)
    assert time.monotonic() - t0 < 20, time.monotonic() - t0
    rank, status, _ = out.get(timeout=30)
    assert (rank, status) == (1, "failed")
    assert time.monotonic() - t0 < 20
    for p in procs:
        p.join(timeout=10)
    assert procs[1].exitcode == 3


def test_a_rank_arriving_after_its_epoch_was_given_up_fails_at_once() -> None:
    """Rank 0 stopped waiting for a rank that had not arrived: that rank arriving later (a sampler whose loop
    was in a long load) fails at once, naming why, instead of waiting out the forming timeout for an epoch
    that can no longer form, its engine's loop standing still meanwhile."""
    from services.weight_transport.weight_group import open_store

    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=30, form_timeout_s=3)
    store = open_store(spec, master=True)  # the coordinator's, which outlives each epoch
    with pytest.raises(TransferFailed, match="1 of 2 ranks arrived within 3s"):
        WeightGroup(spec, 0, store=store)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match=r"the epoch was given up \(.*1 of 2 ranks arrived within 3s"):
        WeightGroup(spec, 1)
    assert time.monotonic() - t0 < 1.5


def test_a_failing_source_raises_before_anything_is_announced_and_the_group_goes_on() -> None:
    """Rank 0 stages the whole version before it announces it: a source that yields a tensor other than the
    header names, ends early, yields more, or fails itself (a ZeRO-3 gather) raises its own error from
    ``send`` (``publish_collective`` makes it a ``VersionNotSent``). Nothing is announced and no collective
    issued: a receiver already waiting in its receive is not disturbed and takes the next version, exact,
    through the same group, the only version ever announced."""
    from tests.test_weight_group_nccl import form

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=30))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    issued = _issued(groups[0])
    tensors = version_tensors(8)
    wrong = [(n, t.double() if n == "model.norm.weight" else t) for n, t in tensors]

    def failing() -> Any:
        yield from tensors[:3]
        raise RuntimeError("the gather of bucket 2 failed")

    cases = [
        (wrong, ValueError, r"tensor 1 is .*float64.*header said.*bfloat16"),
        (tensors[:-1], ValueError, r"the source ended at tensor 5 \('ids'\)"),
        (
            [*tensors, ("extra", torch.zeros(1))],
            ValueError,
            "more tensors than the header named, e.g. 'extra'",
        ),
        (failing(), RuntimeError, "the gather of bucket 2 failed"),
    ]
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(CollectiveReceiver(groups[1]).receive()))
    thread.start()
    try:
        for version, (source, error, why) in enumerate(cases, start=8):
            with pytest.raises(error, match=why):
                publisher.send(version, specs_of(tensors), iter(source))
        assert issued == [] and groups[0].broadcasts == 0 and not groups[0].closed
        assert not groups[0]._announcements.check(["announce/1"])
        assert thread.is_alive() and got == []  # still waiting for a version, undisturbed
        publisher.send(12, specs_of(version_tensors(12)), iter(version_tensors(12)))
        thread.join(60)
        [(version, received, _)] = got
        assert version == 12 and is_version(12, received)
        assert groups[1].next_announcement(timeout_s=1) == 12
        assert groups[1].next_announcement(timeout_s=0.2) is None
    finally:
        for group in groups:
            group.close()


def test_a_background_broadcast_returns_once_staged_and_sends_the_staged_bytes() -> None:
    """The learner's next step overlaps the broadcast: ``send_background`` returns once the version is copied
    into the staging buffer; changing the weights after that does not change what the receivers get. A
    ``send`` right after it stages into the same buffer only once that broadcast has ended."""
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=30, form_timeout_s=SPAWNED_FORM_S)
    procs, out = start_receivers(spec, ["late", "late"], versions=3)
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, bucket_bytes=8192)
    for version in (11, 12):
        tensors = version_tensors(version)
        t0 = time.monotonic()
        blocked = publisher.send_background(version, specs_of(tensors), iter(tensors))
        returned = time.monotonic() - t0
        assert blocked <= returned
        if version == 11:  # the receivers are still 2 s away from receiving
            assert returned < 1.0, returned
        for _, t in tensors:  # the optimizer steps on: the staged copy is what goes out
            t.zero_()
    stats = publisher.send(13, specs_of(version_tensors(13)), iter(version_tensors(13)))
    assert stats.version == 13 and publisher.wait() is None  # version 12's ended before 13 was staged
    assert publisher._buffers == []  # every bucket went straight from the staging buffer, none copied
    got = sorted(out.get(timeout=60) for _ in range(6))
    assert got == [(r, v, True) for r in (1, 2) for v in (11, 12, 13)]
    publisher.close()
    for p in procs:
        p.join(timeout=30)
    group.close()


def test_a_failed_background_broadcast_is_raised_by_the_next_call() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=5, form_timeout_s=SPAWNED_FORM_S)
    procs, _ = start_receivers(spec, ["die-after-header"], versions=1)
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, bucket_bytes=8192)
    tensors = version_tensors(13)
    publisher.send_background(13, specs_of(tensors), iter(tensors))
    with pytest.raises(TransferFailed, match="version 13"):
        publisher.send_background(14, specs_of(tensors), iter(tensors))
    assert publisher.wait() is None  # the failure was handed over once; version 14 was never staged
    procs[0].join(timeout=30)
    publisher.close()


def _announcing_publisher(spec: GroupSpec, plan: list[tuple[int, float]], out: Any) -> None:
    """The learner's rank 0, in its own process: announces and broadcasts each version of ``plan`` after the
    given idle seconds (the members wait on the announcements, not inside a collective)."""
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, bucket_bytes=8192)
    for version, idle_s in plan:
        time.sleep(idle_s)
        tensors = version_tensors(version)
        publisher.send(version, specs_of(tensors), iter(tensors))
        out.put(version)
    group.close()
    # leave without the interpreter's teardown, as the receivers do: a run saw this process end in SIGABRT
    # there after both versions were sent (the closed group's gloo threads are kept from their destructors)
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.slow
def test_announcements_wake_receivers_after_idling_past_the_group_timeout() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    learner = ctx.Process(target=_announcing_publisher, args=(spec, [(21, 0.0), (22, 3.0)], out))
    learner.start()
    group = WeightGroup(spec, 1)
    receiver = CollectiveReceiver(group)
    got = []
    for _ in range(2):
        version = None
        while version is None:  # idle longer than the 2 s timeout between the two versions
            version = group.next_announcement(timeout_s=0.5)
        v, tensors, _ = receiver.receive()
        assert v == version
        got.append((v, is_version(v, tensors)))
    assert got == [(21, True), (22, True)]
    learner.join(timeout=30)
    assert learner.exitcode == 0
    with pytest.raises(TransferFailed, match="store is unreachable"):  # its host, the publisher, is gone
        group.next_announcement(timeout_s=5)
    assert group.closed


def _receive_in_background(group: WeightGroup) -> tuple[Any, str | None, list[tuple[str, torch.Tensor]]]:
    """One version received as a worker receives it (:class:`Background`, on the group's device): its number
    (None if none came), the work's state, and its tensors."""
    got: list[Any] = []
    work = Background("receive", lambda: got.append(CollectiveReceiver(group).receive()), group.device)
    work.wait(60)
    version, tensors, _ = got[0] if got else (None, [], None)
    return version, work.state(), tensors


def _cuda_receiver(spec: GroupSpec, out: Any, versions: int = 1) -> None:
    """A GPU worker's receiver (over gloo, which moves CUDA tensors through the host, so one GPU runs it): each
    version into buffers on its GPU, reported with whether every tensor is there and exact, and the memory
    torch's allocator holds on the GPU once the version's tensors are dropped."""
    cuda = torch.device("cuda", 0)
    group = WeightGroup(spec, 1, device=cuda)
    for _ in range(versions):
        version, state, tensors = _receive_in_background(group)
        on_gpu = bool(tensors) and all(t.device == cuda for _, t in tensors)
        exact = on_gpu and is_version(version, tensors)
        del tensors  # its engine loaded it: the buffers go back to torch's allocator
        out.put((version, state, exact, torch.cuda.memory_reserved(cuda)))
    group.close()


def test_a_receive_in_the_background_says_when_it_ended_and_why_it_failed() -> None:
    """What a sampler's worker runs on a thread of its own (the engine's loop goes on meanwhile): "running"
    until the version is whole, then nothing; a version whose broadcast failed part-way (rank 0's link broke
    in its first bucket), its error as text."""
    from tests.test_weight_group_nccl import form

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    try:
        got: list[Any] = []
        work = Background("receive", lambda: got.append(CollectiveReceiver(groups[1]).receive()), None)
        time.sleep(0.2)
        assert work.running and work.state() == "running"  # waiting for the publisher
        tensors = version_tensors(45)
        publisher.send(45, specs_of(tensors), iter(tensors))
        assert work.wait(60) and work.state() is None
        [(version, received, _)] = got
        assert version == 45 and is_version(45, received)

        work = Background("receive", lambda: CollectiveReceiver(groups[1]).receive(), None)
        break_link(groups[0])
        with pytest.raises(TransferFailed, match="version 46: broadcast failed: Connection reset by peer"):
            publisher.send(46, specs_of(tensors), iter(tensors))
        assert work.wait(60)
        assert (work.state() or "").startswith("TransferFailed: version 46: receiving failed: "), work.state()
        assert "rank 0 declared the broadcast failed" in (work.state() or ""), work.state()
    finally:
        for group in groups:
            group.close()


def _busy_cuda_receiver(spec: GroupSpec, out: Any) -> None:
    """A GPU worker's receive on a thread and CUDA stream of its own while the default stream computes, as an
    engine's forward does: both progress, and the version arrives exact, in buffers on the GPU."""
    cuda = torch.device("cuda", 0)
    group = WeightGroup(spec, 1, device=cuda)  # gloo moves CUDA tensors through the host
    got: list[Any] = []
    work = Background("receive", lambda: got.append(CollectiveReceiver(group).receive()), cuda)
    x, steps = torch.randn(2048, 2048, device=cuda), 0
    while work.running:
        x = torch.tanh(x @ x) / 8  # the default stream, never waited on by the receive
        torch.cuda.current_stream(cuda).synchronize()
        steps += 1
    version, tensors, _ = got[0] if got else (None, [], None)
    on_gpu = bool(tensors) and all(t.device == cuda for _, t in tensors)  # received into buffers on its GPU
    out.put((version, work.state(), steps, on_gpu and is_version(version, tensors)))
    del tensors
    got.clear()
    group.close()


@pytest.mark.gpu
def test_a_cuda_receive_in_the_background_leaves_the_default_stream_computing() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_busy_cuda_receiver, args=(spec, out))
    proc.start()
    group = WeightGroup(spec, 0)
    try:
        time.sleep(1.0)  # the receiver's default stream computes while it waits for the version too
        tensors = version_tensors(47)
        CollectivePublisher(group, bucket_bytes=8192).send(47, specs_of(tensors), iter(tensors))
        version, state, steps, exact = out.get(timeout=60)
        assert (version, state, exact) == (47, None, True) and steps > 1
    finally:
        proc.join(timeout=30)
        group.close()


@pytest.mark.gpu
def test_a_cuda_publisher_broadcasts_in_the_background_from_page_locked_staging() -> None:
    """The learner's side on a GPU, over gloo (which moves CUDA tensors through the host) so one GPU runs it:
    CUDA source tensors staged into the exact-size page-locked buffer, broadcast from the background thread on
    a stream of its own (every piece copied non-blocking into one of two piece-sized CUDA buffers), two
    versions back to back into a CUDA receiver, bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_cuda_receiver, args=(spec, out, 2))
    proc.start()
    cuda = torch.device("cuda", 0)
    group = WeightGroup(spec, 0, device=cuda)
    publisher = CollectivePublisher(group, bucket_bytes=8192)
    try:
        for version in (42, 43):
            tensors = [(n, t.to(cuda)) for n, t in version_tensors(version)]
            publisher.send_background(version, specs_of(tensors), iter(tensors))
            assert publisher._staging.take(1).is_pinned()
            assert out.get(timeout=60)[:3] == (version, None, True)
        assert publisher.wait() is not None and publisher._stream is not None
        assert len(publisher._buffers) == 2 and all(
            b.is_cuda and b.numel() <= 8192 for b in publisher._buffers
        )
    finally:
        publisher.close()
        proc.join(timeout=30)
        group.close()


@pytest.mark.gpu
def test_a_cuda_receiver_takes_each_version_into_buffers_on_its_gpu_and_reuses_them() -> None:
    """A GPU worker receives each version straight into buffers on its GPU (its engine loads it from there,
    device to device), bit-exact; the next version's buffers are the last one's memory, freed once its
    tensors were dropped: the worker's receives run on one CUDA stream, and torch's allocator reuses a block
    only on the stream it was made on (a stream per version left each version's buffers reserved)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_cuda_receiver, args=(spec, out, 2))
    proc.start()
    group = WeightGroup(spec, 0)
    try:
        publisher = CollectivePublisher(group, bucket_bytes=8192)
        reserved = []
        for version in (41, 42):
            tensors = version_tensors(version)
            publisher.send(version, specs_of(tensors), iter(tensors))
            got, state, exact, held = out.get(timeout=60)
            assert (got, state, exact) == (version, None, True)
            reserved.append(held)
        assert reserved[1] == reserved[0], reserved
    finally:
        proc.join(timeout=30)
        group.close()


@pytest.mark.gpu
def test_a_gpu_source_sent_over_gloo_is_staged_and_committed() -> None:
    """``send`` of CUDA tensors over a gloo group: staged into host memory first, as ``send_background`` does
    (gloo moves host bytes), every piece broadcast from there, and the version arrives exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.test_weight_group_nccl import form

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60))
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(CollectiveReceiver(groups[1]).receive()))
    thread.start()
    try:
        tensors = [(n, t.to("cuda")) for n, t in version_tensors(44)]
        CollectivePublisher(groups[0], bucket_bytes=8192).send(44, specs_of(tensors), iter(tensors))
        thread.join(60)
        [(version, received, _)] = got
        assert version == 44 and is_version(44, received)
    finally:
        for group in groups:
            group.close()


class _OnCuda(torch.Tensor):
    """A CUDA tensor's stand-in where there is no GPU: its bytes are in host memory, but it says it is on
    ``cuda:0`` to whatever asks (``.device``: the publisher takes it for one off a CPU group's device),
    ``.cpu()`` is a copy of its bytes as a plain host tensor (as a CUDA tensor's is), and every other op
    (``detach``, ``contiguous``, ``view``, slicing, being copied from or into) works on its bytes and keeps the
    stand-in."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == torch.Tensor.device.__get__:
            return torch.device("cuda", 0)
        if func == torch.Tensor.cpu:
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_device_source_sent_over_gloo_is_staged_and_committed_exactly() -> None:
    """The GPU test above on a CPU: ``send`` of tensors that say they are on a GPU (:class:`_OnCuda`) over a
    real gloo group into a real receiver: staged into host memory, every piece broadcast from there (no
    device buffer made), and the receiver commits the exact version."""
    from tests.test_weight_group_nccl import form

    tensors = [(n, t.as_subclass(_OnCuda)) for n, t in version_tensors(44)]
    assert tensors[2][1].device.type == "cuda"
    specs = specs_of(version_tensors(44))
    layout = bucket_layout(specs, 8192)
    alone = [b for b, bucket in enumerate(layout) if len(bucket.items) == 1]
    assert [layout[b].items[0][0] for b in alone] == [2]  # model.layers.0.big alone, the others packed
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60))
    got: list[Any] = []

    def receive() -> None:
        try:
            got.append(CollectiveReceiver(groups[1]).receive())
        except TransferFailed as exc:
            got.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
        publisher.send(44, specs, iter(tensors))
        thread.join(60)
        [(version, received, _)] = got
        assert version == 44 and is_version(44, received) and publisher._buffers == []
    finally:
        for group in groups:
            group.close()


def break_link(group: WeightGroup, at: int = 3) -> None:
    """Rank 0's link breaks at its ``at``-th broadcast from now (3: a version's first piece, after its head and
    header): that broadcast raises, as gloo's does when a peer's connection is reset."""
    real, calls = group.broadcast, [0]

    def broadcast(tensor: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError("Connection reset by peer")
        return real(tensor)

    group.broadcast = broadcast  # type: ignore[method-assign]


def _issued(group: WeightGroup) -> list[float]:
    """When each of ``group``'s collectives was issued (its broadcasts), recorded from now on."""
    times: list[float] = []
    real = group.broadcast

    def broadcast(tensor: torch.Tensor) -> Any:
        times.append(time.monotonic())
        return real(tensor)

    group.broadcast = broadcast  # type: ignore[method-assign]
    return times


def test_under_nccl_rank_0_issues_no_collective_before_every_receiver_is_ready() -> None:
    """Under NCCL a collective waiting for a late receiver is a kernel on the learner's GPU, which every
    device-wide synchronize of its training step waits for (DeepSpeed's gathers make them): rank 0 waits in
    the store until every receiver is in its receive. The same code over gloo here, made to wait as under
    NCCL: a receiver 1.5 s late, and no collective before it."""
    from tests.test_weight_group_nccl import form

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=3, timeout_s=60))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    assert not publisher.await_ready  # gloo: its collectives wait in its own threads
    publisher.await_ready = True
    issued, got, started, buffers_made = _issued(groups[0]), {}, {}, {}

    def receive(group: WeightGroup, late_s: float, slow_buffers_s: float = 0.0) -> None:
        time.sleep(late_s)
        started[group.rank] = time.monotonic()
        receiver = CollectiveReceiver(group)
        make = receiver._buffers

        def slow_buffers(layout: list[Bucket], version: int) -> list[torch.Tensor]:
            time.sleep(slow_buffers_s)  # its buffers take long to make (a whole model's on its GPU)
            buffers = make(layout, version)
            buffers_made[group.rank] = time.monotonic()
            return buffers

        receiver._buffers = slow_buffers  # type: ignore[method-assign]
        got[group.rank] = receiver.receive()

    threads = [
        threading.Thread(target=receive, args=(g, late)) for g, late in ((groups[1], 0.0), (groups[2], 1.5))
    ]
    try:
        for t in threads:
            t.start()
        for version in (8, 9):
            tensors = version_tensors(version)
            publisher.send(version, specs_of(tensors), iter(tensors))
            if version == 8:
                assert issued and issued[0] >= started[2]  # not one before the late receiver was ready
                for t in threads:
                    t.join(30)
                issued.clear()
                threads = [
                    threading.Thread(target=receive, args=(g, 0.0, 1.5 * (g.rank == 1))) for g in groups[1:]
                ]
                for t in threads:
                    t.start()
        for t in threads:
            t.join(30)
        assert all(got[r][0] == 9 and is_version(9, got[r][1]) for r in (1, 2))
        # the head and the header, then nothing until the slow receiver's buffers were made
        assert len(issued) > 2 and issued[2] >= buffers_made[1] > issued[1]
    finally:
        for group in groups:
            group.close()


def test_under_nccl_a_receiver_that_never_gets_ready_fails_the_version_without_a_collective() -> None:
    """Rank 0 waiting for receivers in the store gives up as its collectives do: at once where the control
    plane says a member is gone (a killed sampler, whose heartbeat ran out), else at the group's timeout."""
    from tests.test_weight_group_nccl import form

    for gone in (True, False):
        groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=3 if not gone else 60))
        publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
        publisher.await_ready = True
        t0 = time.monotonic()
        if gone:
            groups[0].alive_every_s = 0.1
            groups[0].members_gone = lambda t0=t0: (  # type: ignore[misc]
                "sampler-1.a is gone" if time.monotonic() - t0 > 0.5 else None
            )
        issued = _issued(groups[0])
        tensors = version_tensors(3)
        try:
            with pytest.raises(TransferFailed) as info:
                publisher.send(3, specs_of(tensors), iter(tensors))
            waited = time.monotonic() - t0
            assert issued == [] and groups[0].closed
            # the cause, marked for the receivers waiting (not rank 0's abort after it)
            marked = bytes(groups[1]._announcements.get("failed")).decode()
            assert marked == str(info.value).split(": broadcast failed: ", 1)[1]
            if gone:
                assert "sampler-1.a is gone" in str(info.value) and waited < 5.0, waited
            else:
                assert "0 of 1 receivers were ready within 3s" in str(info.value) and 3.0 <= waited < 10.0
        finally:
            for group in groups:
                group.close()


def test_pieces_cover_a_bucket_in_order_at_most_the_bucket_size_each() -> None:
    assert pieces(20_000, 8192) == [(0, 8192), (8192, 16384), (16384, 20_000)]
    assert pieces(8192, 8192) == [(0, 8192)] and pieces(100, 8192) == [(0, 100)]
    assert pieces(0, 8192) == [(0, 0)]  # an empty bucket is still one broadcast on every rank
    with pytest.raises(ValueError, match="bucket_bytes must be >= 64"):
        pieces(100, 16)


class _StagedOffDevice(PinnedStaging):
    """A staging buffer off the group's device, as a GPU publisher's host staging is under NCCL: it says it is
    on ``cuda:0`` (:class:`_OnCuda`), so every piece is copied into the publisher's device buffers."""

    def take(self, nbytes: int) -> torch.Tensor:
        return super().take(nbytes).as_subclass(_OnCuda)


@pytest.mark.parametrize("off_device", [False, True])
def test_a_weight_larger_than_a_bucket_travels_in_bucket_sized_pieces(off_device: bool) -> None:
    """The staged version goes out in pieces of at most the bucket size, whatever the largest weight. From a
    staging buffer on the group's device (gloo) each goes out in place, no device buffer made; from one off it
    (NCCL's host staging) each is copied into one of two buffers of at most the bucket size: never a buffer of
    the largest weight's size on a GPU beside the training (an embedding of a 70B model is 2 GB). The receiver
    takes each bucket, however large its one weight, into its buffer piece by piece."""
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=60)
    tensors = [*version_tensors(3), ("model.lm_head.weight", torch.randn(2000, 7))]  # 56 kB: 7 pieces
    results: list[Any] = []
    received: list[int] = []  # the bytes of each of the receiver's broadcasts

    def receive() -> None:
        group = WeightGroup(spec, 1)
        real = group.broadcast

        def broadcast(tensor: torch.Tensor) -> Any:
            received.append(tensor.nbytes)
            return real(tensor)

        group.broadcast = broadcast  # type: ignore[method-assign]
        version, got, _ = CollectiveReceiver(group).receive()
        results.append((version, got))
        group.close()

    thread = threading.Thread(target=receive)
    thread.start()
    group = WeightGroup(spec, 0)
    publisher = CollectivePublisher(group, 8192, _StagedOffDevice() if off_device else None)
    publisher.send(3, specs_of(tensors), iter(tensors))
    thread.join(timeout=60)
    group.close()
    [(version, got)] = results
    assert version == 3 and [n for n, _ in got] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, tensors, strict=True))
    made = [(buf.numel(), buf.device.type) for buf in publisher._buffers]
    assert made == ([(8192, "cpu"), (8192, "cpu")] if off_device else []), made
    layout = bucket_layout(specs_of(tensors), 8192)
    assert any(b.nbytes > 8192 for b in layout)
    # the head and the header, then every bucket in pieces of at most the bucket size
    data = received[2:]
    assert len(data) == sum(len(pieces(b.nbytes, 8192)) for b in layout) and max(data) <= 8192, received
    assert sum(data) == sum(b.nbytes for b in layout)
