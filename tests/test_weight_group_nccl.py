"""The weight group under NCCL: its failure handling and the shared-GPU fallback.

On CPU, torch has no ProcessGroupNCCL: these tests stand one in (a recorder, never a transport) to check what
the weight group asks of it, and run the fallback's gloo group for real. The ``gpu``-marked tests run the same
paths on CUDA: ranks on one GPU (any machine with a GPU), and real NCCL between GPUs (two or more).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from services.common.ports import free_port
from services.weight_transport import nccl_group, retired, weight_group
from services.weight_transport.collective import CollectivePublisher
from services.weight_transport.receiver import CollectiveReceiver
from services.weight_transport.weight_group import GroupSpec, TransferFailed, WeightGroup
from tests.test_collective_weights import _receiver, is_version, specs_of, version_tensors


class StandInNCCL:
    """Records how the weight group builds and closes its NCCL backend; moves nothing."""

    built: ClassVar[list[StandInNCCL]] = []
    # False: a collective never completes (as when NCCL cannot connect); "blocks": the call itself does not
    # return (NCCL's default, blocking, initialization of a communicator some rank never joins)
    connects: ClassVar[bool | str] = True
    released: ClassVar[threading.Event] = threading.Event()
    # what torch's get_future_result gives every collective (None: not marked yet)
    result: ClassVar[int | None] = 0

    class Options:
        _timeout: timedelta | None = None

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        self.rank, self.size, self.timeout = rank, size, options._timeout
        self.high_priority = options.is_high_priority_stream
        names = (*nccl_group.NCCL_ERROR_HANDLING_VARS, nccl_group.DUMP_WAIT_VAR)
        self.env = {name: os.environ.get(name) for name in names}
        self.calls: list[str] = []
        self.error = "SUCCESS"  # what get_error gives: torch's watchdog sets it on the group's first failure
        StandInNCCL.built.append(self)

    def _start(self, what: str) -> None:
        self.calls.append(what)
        if "abort" in self.calls:  # as torch does for a communicator it has aborted
            raise RuntimeError(f"NCCL communicator was aborted on rank {self.rank}.")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self._start("allreduce")
        if StandInNCCL.connects == "blocks":
            StandInNCCL.released.wait(60)
        return _Work(StandInNCCL.connects is True, StandInNCCL.result)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self._start("broadcast")
        return _Work(True, StandInNCCL.result)

    def get_error(self) -> Any:
        return _Named(self.error)

    def abort(self) -> None:
        self.calls.append("abort")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class _Named:  # as torch's ErrorType members read
    def __init__(self, name: str) -> None:
        self.name = name


class _Result:  # as the future of torch's get_future_result reads
    def __init__(self, code: int | None) -> None:
        self.code = code

    def done(self) -> bool:
        return self.code is not None

    def value(self) -> int:
        assert self.code is not None, "torch raises for a result not marked yet"
        return self.code


class _Work:
    def __init__(self, completes: bool | float, result: int | None = 0) -> None:
        """``completes``: at once (True), never (False), or after that many seconds (as a kernel the watchdog
        timed out ends once it aborts the communicator)."""
        self.completes, self.result = completes, result
        self.ends = time.monotonic() + completes if not isinstance(completes, bool) else None
        self.waits = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.ends if self.ends is not None else bool(self.completes)

    def wait(self, timeout: timedelta) -> bool:  # NCCL's, for a group built with CleanUpOnly: never raises
        self.waits += 1
        return True

    def get_future_result(self) -> _Result:
        return _Result(self.result)


@pytest.fixture
def stand_in_nccl(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[StandInNCCL]]:
    StandInNCCL.built, StandInNCCL.connects, StandInNCCL.released = [], True, threading.Event()
    StandInNCCL.result = 0
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInNCCL, raising=False)
    yield StandInNCCL
    StandInNCCL.released.set()  # let calls still blocked return


def gpus(monkeypatch: pytest.MonkeyPatch, by_rank: list[str]) -> None:
    """Each rank's GPU identity, as device_identity would read it (ranks run in threads named rank-<n>)."""
    monkeypatch.setattr(
        weight_group,
        "device_identity",
        lambda device: by_rank[int(threading.current_thread().name.split("-")[1])],
    )


def form(spec: GroupSpec) -> list[WeightGroup]:
    """Every rank of ``spec`` joined from a thread of this process (each waits for all the others)."""
    groups: list[Any] = [None] * spec.world_size

    def join(rank: int) -> None:
        groups[rank] = WeightGroup(spec, rank, torch.device("cpu"))

    threads = [threading.Thread(target=join, args=(r,), name=f"rank-{r}") for r in range(spec.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups), groups
    return groups


def forming_errors(spec: GroupSpec) -> dict[int, str]:
    """Every rank of ``spec`` joined from a thread of this process; what each that failed to form said."""
    errors: dict[int, str] = {}

    def join(rank: int) -> None:
        try:
            WeightGroup(spec, rank, torch.device("cpu"))
        except TransferFailed as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=join, args=(r,), name=f"rank-{r}") for r in range(spec.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


def test_an_nccl_group_raises_its_failures_instead_of_ending_the_process(
    stand_in_nccl: type[StandInNCCL], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built with torch's CleanUpOnly error handling (its default takes the process down when a collective
    fails or times out: a sampler killed mid-broadcast would kill learner rank 0), and the process's own setting
    is back once the group is built."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    dump_wait = os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")
    gpus(monkeypatch, ["GPU-a", "GPU-b", "GPU-c"])
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=42)
    groups = form(spec)
    assert sorted(b.rank for b in stand_in_nccl.built) == [0, 1, 2]
    for built in stand_in_nccl.built:
        assert built.env == {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
            "NCCL_ASYNC_ERROR_HANDLING": "2",
            # torch's watchdog sleeps 4 x this before it aborts a failed group's communicator (a minute)
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
        }
        assert built.timeout == timedelta(seconds=42) and built.size == 3
        # its stream from the high-priority pool, never one of the low-priority pool's that DeepSpeed's share
        assert built.high_priority
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert os.environ.get("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC") == dump_wait
    assert all(g.backend == "nccl" for g in groups)
    groups[1].close()
    groups[1].close()  # once
    # abort (ncclCommAbort), not shutdown: destroying a communicator waits for a kernel a dead peer never ends
    # each rank connected while the group formed: an all-reduce (NCCL makes its communicator at the first
    # collective) and a broadcast (NCCL connects each algorithm's links at its first use)
    assert [b.calls for b in stand_in_nccl.built if b.rank == 1] == [["allreduce", "broadcast", "abort"]]
    for g in groups:
        g.close()


def test_a_process_in_a_weight_group_is_not_ended_by_torchs_monitor_after_the_groups_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's NCCL watchdog signals every failure process-wide, and the monitor of the process's first NCCL
    group (DeepSpeed's, vLLM's) would end the process minutes after a failed weight broadcast: unless the
    user chose otherwise, that monitor is told to ignore the signal before that group is made."""
    monkeypatch.delenv(nccl_group.DUMP_ON_FAILURE, raising=False)
    with caplog.at_level(logging.WARNING, logger=nccl_group.__name__):
        nccl_group.survive_weight_group_failures()
        assert os.environ[nccl_group.DUMP_ON_FAILURE] == "0" and not caplog.records
        monkeypatch.setenv(nccl_group.DUMP_ON_FAILURE, "false")
        nccl_group.survive_weight_group_failures()
        assert os.environ[nccl_group.DUMP_ON_FAILURE] == "false" and not caplog.records
        monkeypatch.setenv(nccl_group.DUMP_ON_FAILURE, "1")  # the user's: kept, and said what it costs
        nccl_group.survive_weight_group_failures()
    assert os.environ[nccl_group.DUMP_ON_FAILURE] == "1"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1: a weight broadcast that fails" in caplog.text


@pytest.mark.parametrize(
    ("connects", "why"),
    [
        (False, "the ranks did not connect within 1s"),
        ("blocks", "NCCL's communicator was not made within 1s"),
    ],
)
def test_an_nccl_group_that_cannot_connect_fails_its_forming_within_the_forming_timeout(
    stand_in_nccl: type[StandInNCCL], monkeypatch: pytest.MonkeyPatch, connects: bool | str, why: str
) -> None:
    """NCCL connects at a group's first collective, which the weight group runs while it forms: ranks that
    cannot connect (a wrong NCCL_SOCKET_IFNAME) give up after the forming timeout (1 s here), aborting their
    communicator, not at the first version's broadcast after the group's 90 s. That holds too where the call
    itself does not return (torch makes the communicator inside it, blocking until every rank has joined:
    a rank that died after arriving never does)."""
    gpus(monkeypatch, ["GPU-a", "GPU-b"])
    stand_in_nccl.connects = connects
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=90, form_timeout_s=1)
    t0 = time.monotonic()
    errors = forming_errors(spec)
    assert time.monotonic() - t0 < 10
    assert sorted(errors) == [0, 1]
    assert all(f"NCCL did not connect: {why}" in said for said in errors.values()), errors
    deadline = time.monotonic() + 5  # (an abort while the call is blocked runs on a thread of its own)
    issued = ["allreduce"] if connects == "blocks" else ["allreduce", "broadcast"]
    while any(b.calls[-1:] != ["abort"] for b in stand_in_nccl.built) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(b.calls for b in stand_in_nccl.built) == [[*issued, "abort"]] * 2


@pytest.mark.parametrize(
    ("by_rank", "sharing"),
    [(["GPU-a", "GPU-b", "GPU-a"], "0, 2"), (["GPU-a"] * 3, "0, 1, 2")],
    ids=["two-on-one-gpu", "all-on-one-gpu"],
)
def test_ranks_sharing_a_gpu_run_the_epoch_on_gloo_and_carry_a_version(
    stand_in_nccl: type[StandInNCCL],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    by_rank: list[str],
    sharing: str,
) -> None:
    """NCCL refuses two ranks of a communicator on one GPU (a learner and a sampler given fractions of it):
    every rank reads the same identities and falls back to gloo alike, and a version arrives bit-exact over
    its sockets, in buckets; so too where every rank is on the one GPU (a learner and all its samplers on
    fractions of it)."""
    gpus(monkeypatch, by_rank)
    spec = GroupSpec("127.0.0.1", free_port(), world_size=3, backend="nccl", timeout_s=60, epoch=4)
    with caplog.at_level(logging.WARNING, logger=weight_group.__name__):
        groups = form(spec)
    assert stand_in_nccl.built == []
    assert [(g.backend, g.device.type) for g in groups] == [("gloo", "cpu")] * 3
    assert (
        f"weight group epoch 4 runs on gloo, not NCCL: ranks {sharing} share a GPU (versions go through host "
        "memory and sockets)" in caplog.text
    )
    got: dict[int, Any] = {}

    def receive(rank: int) -> None:
        version, tensors, _ = CollectiveReceiver(groups[rank]).receive()
        got[rank] = (version, is_version(version, tensors))

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    tensors = version_tensors(12)
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    stats = publisher.send(12, specs_of(tensors), iter(tensors))
    for t in threads:
        t.join(timeout=60)
    assert got == {1: (12, True), 2: (12, True)}
    assert stats.buckets > 1  # over the sockets, bucket by bucket
    publisher.close()
    for g in groups:
        g.close()


class FailedQuietly:
    """A collective that completed with an error which only a timed wait raises: NCCL's work after a peer
    died (its untimed wait only orders the current stream after it, and returns)."""

    def __init__(self) -> None:
        self.waits: list[timedelta | None] = []

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if timeout:
            raise RuntimeError("NCCL communicator was aborted: remote process exited")
        return True


@pytest.mark.parametrize("stuck", [False, True])
def test_closing_the_group_waits_for_a_collective_another_thread_is_issuing(
    stuck: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NCCL forbids aborting a communicator while another thread enqueues onto it (the background broadcast
    issues collectives while the learner's thread may abort an overdue one): ``close`` waits for the
    collective being issued, and only ``ISSUE_WAIT_S`` for one that is stuck there."""
    monkeypatch.setattr(weight_group, "ISSUE_WAIT_S", 0.5 if stuck else 10.0)
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=30))
    group, pg = groups[0], groups[0]._pg
    entered, release = threading.Event(), threading.Event()

    class Done:
        def is_completed(self) -> bool:
            return True

    def issuing() -> Any:
        entered.set()
        release.wait(10)
        return Done()

    issuer = threading.Thread(target=group._issue, args=(issuing,), name="issuer")
    issuer.start()
    assert entered.wait(10)
    closer = threading.Thread(target=group.close, name="closer")
    t0 = time.monotonic()
    closer.start()
    if stuck:
        closer.join(timeout=10)
        assert not closer.is_alive() and 0.4 <= time.monotonic() - t0 < 5
        assert "while a collective was being issued for 0.5s" in caplog.text
    else:
        time.sleep(0.5)
        assert closer.is_alive() and group._pg is pg  # not shut down yet
        release.set()
        closer.join(timeout=10)
        assert not closer.is_alive()
    assert group.closed and group._pg is not pg
    release.set()
    issuer.join(timeout=10)
    for g in groups[1:]:
        g.close()


def test_a_collective_that_completed_with_an_error_fails_and_marks_the_group() -> None:
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, timeout_s=30)
    groups = form(spec)
    work = FailedQuietly()
    with pytest.raises(RuntimeError, match="remote process exited"):
        groups[1].wait(work)
    assert work.waits == [timedelta(seconds=30)]
    # the mark every other rank's wait watches for, so none waits out the timeout for this one
    assert groups[0]._announcements.get("failed").decode().startswith("rank 1's part failed: NCCL")
    with pytest.raises(TransferFailed, match="rank 1's part failed"):
        groups[0].wait(_Pending())
    for g in groups:
        g.close()


class _Pending:
    def is_completed(self) -> bool:
        return False


def test_an_nccl_collective_that_failed_without_raising_fails_the_wait_and_marks_the_group(
    stand_in_nccl: type[StandInNCCL], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch raises nothing for a failed collective of a group built with CleanUpOnly (seen on an H200: a
    broadcast the watchdog timed out "waited" as if its bytes had arrived): its result is read. Marked as
    failed, a collective fails as soon as it is, before its kernel ends; one the watchdog has not yet marked a
    success is not waited for; and once the group has failed, so does a collective issued after it, which
    completes without running (a commit vote would otherwise pass on every rank's own ballot)."""
    gpus(monkeypatch, ["GPU-a", "GPU-b"])
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=30)
    groups = form(spec)
    succeeded, unmarked = _Work(True, 0), _Work(True, None)
    groups[0].wait(succeeded)
    groups[0].wait(unmarked)  # returns at once: the watchdog marks a success on its next pass
    assert (succeeded.waits, unmarked.waits) == (1, 1) and not groups[0].closed

    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="rank 1's part failed: NCCL ended the collective with TIMEOUT"):
        groups[1].wait(_Work(3.0, 1))  # timed out by the watchdog, its kernel still running
    assert time.monotonic() - t0 < 2 and groups[1].closed
    # the mark every other rank's wait watches for
    assert groups[0]._announcements.get("failed").decode() == (
        "rank 1's part failed: NCCL ended the collective with TIMEOUT"
    )
    with pytest.raises(TransferFailed, match="rank 1's part failed"):
        groups[0].wait(_Pending())
    for g in groups:
        g.close()

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=30, epoch=1))
    with pytest.raises(TransferFailed, match="NCCL ended the collective with COMM_ERROR"):
        groups[0].wait(_Work(True, 2))  # an NCCL error found when it was checked
    groups[1]._announcements.delete_key("failed")
    # the group failed before: a later vote's result is never marked, but the group's error stays set
    groups[1]._pg.error = "TIMEOUT"
    with pytest.raises(TransferFailed, match=r"rank 1's part failed: the NCCL group failed \(TIMEOUT\)"):
        groups[1].commit()
    for g in groups:
        g.close()


def test_an_nccl_collective_refused_or_cut_by_a_close_fails_this_ranks_part(
    stand_in_nccl: type[StandInNCCL], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch refuses a collective on a communicator it has aborted (the watchdog's, after a failure): that
    fails the rank's part, marked for the others, as a failed wait does. A collective pending when another
    thread closes the group ends with the abort and reads as done: it fails too, the bytes never came."""
    gpus(monkeypatch, ["GPU-a", "GPU-b"])
    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=30))
    groups[1]._pg.calls.append("abort")  # aborted by torch's watchdog
    with pytest.raises(TransferFailed, match="rank 1's part failed: NCCL communicator was aborted on rank 1"):
        groups[1].broadcast(torch.zeros(3))
    assert groups[1].closed
    assert groups[0]._announcements.get("failed").decode().startswith("rank 1's part failed: NCCL comm")
    with pytest.raises(TransferFailed, match="rank 1's part failed"):
        groups[0].wait(_Pending())

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=30, epoch=1))
    work = _Work(1.0, None)  # the success torch marks on the watchdog's next pass: never, once aborted
    threading.Timer(0.2, groups[0].close).start()
    with pytest.raises(TransferFailed, match="rank 0's weight group was closed during the collective"):
        groups[0].wait(work)
    for g in groups:
        g.close()


def test_an_nccl_group_whose_first_collective_failed_without_raising_does_not_form(
    stand_in_nccl: type[StandInNCCL], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(monkeypatch, ["GPU-a", "GPU-b"])
    stand_in_nccl.result = 2
    spec = GroupSpec("127.0.0.1", free_port(), world_size=2, backend="nccl", timeout_s=30, form_timeout_s=5)
    errors = forming_errors(spec)
    assert sorted(errors) == [0, 1], errors
    assert all(
        "NCCL did not connect: NCCL ended the collective with COMM_ERROR" in e for e in errors.values()
    )
    assert sorted(b.calls for b in stand_in_nccl.built) == [["allreduce", "broadcast", "abort"]] * 2


# ------------------------------------------------------------------ on GPUs


def _gpu_receiver(spec: GroupSpec, rank: int, gpu: int, behaviour: str, out: Any) -> None:  # a process
    torch.cuda.set_device(gpu)
    _receiver(spec, rank, 1, behaviour, out)


def _gpu_publisher(
    spec: GroupSpec, version: int, out: Any
) -> None:  # a process: a teardown shows as its exit
    torch.cuda.set_device(0)
    group = WeightGroup(spec, 0)
    tensors = [(n, t.cuda()) for n, t in version_tensors(version)]
    t0 = time.monotonic()
    try:
        stats = CollectivePublisher(group, bucket_bytes=8192).send(version, specs_of(tensors), iter(tensors))
        out.put(("sent", group.backend, stats.gb_per_s, time.monotonic() - t0))
    except TransferFailed as exc:
        out.put(("failed", group.backend, str(exc), time.monotonic() - t0))
    out.close()
    out.join_thread()
    os._exit(0)


def run_gpu_group(
    behaviours: list[str], gpus: list[int], timeout_s: float = 20
) -> tuple[Any, list[Any], Any]:
    """A publisher process on GPU 0 and a receiver process per behaviour on ``gpus`` (backend nccl)."""
    spec = GroupSpec(
        "127.0.0.1", free_port(), world_size=1 + len(behaviours), backend="nccl", timeout_s=timeout_s
    )
    ctx = mp.get_context("spawn")
    out, results = ctx.Queue(), ctx.Queue()
    receivers = [
        ctx.Process(target=_gpu_receiver, args=(spec, r + 1, gpu, b, out), daemon=True)
        for r, (b, gpu) in enumerate(zip(behaviours, gpus, strict=True))
    ]
    publisher = ctx.Process(target=_gpu_publisher, args=(spec, 21, results), daemon=True)
    for p in [*receivers, publisher]:
        p.start()
    return publisher, receivers, (out, results)


@pytest.mark.gpu
def test_ranks_on_one_gpu_fall_back_to_gloo_and_deliver_the_version_exactly() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    publisher, _, (out, results) = run_gpu_group(["ok"], [0])
    assert results.get(timeout=120)[:2] == ("sent", "gloo")  # over host memory and sockets
    assert out.get(timeout=60) == (1, 21, True)
    publisher.join(timeout=30)
    assert publisher.exitcode == 0


@pytest.mark.gpu
def test_nccl_between_gpus_delivers_the_version_exactly() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL refuses two ranks on one)")
    n = min(torch.cuda.device_count() - 1, 2)
    publisher, _, (out, results) = run_gpu_group(["ok"] * n, list(range(1, n + 1)))
    status, backend, gb_per_s, seconds = results.get(timeout=120)
    assert (status, backend) == ("sent", "nccl")
    assert sorted(out.get(timeout=60) for _ in range(n)) == [(r, 21, True) for r in range(1, n + 1)]
    print(f"NCCL weight group, {n} receiver(s): {gb_per_s:.2f} GB/s ({seconds:.2f} s, small version)")
    publisher.join(timeout=30)
    assert publisher.exitcode == 0


@pytest.mark.gpu
def test_nccl_a_receiver_killed_mid_broadcast_fails_the_version_and_the_publisher_lives() -> None:
    """The publisher's process survives (torch's default NCCL error handling would end it) and raises the
    failure; a surviving receiver gives up too, with nothing applied."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (NCCL refuses two ranks on one)")
    behaviours = ["die-after-header", "ok"][: torch.cuda.device_count() - 1]
    publisher, receivers, (out, results) = run_gpu_group(behaviours, list(range(1, len(behaviours) + 1)))
    status, backend, why, seconds = results.get(timeout=180)
    assert (status, backend) == ("failed", "nccl") and "version 21" in why, why
    assert seconds < 60, seconds  # within the group's 20 s timeout and the watchdog's abort, not hung
    publisher.join(timeout=60)
    assert publisher.exitcode == 0, f"the publisher's process ended with {publisher.exitcode}"
    if len(behaviours) > 1:
        rank, status, why = out.get(timeout=60)
        assert (rank, status) == (2, "failed") and "version 21" in why
    receivers[0].join(timeout=30)
    assert receivers[0].exitcode == 3  # the one killed mid-broadcast


def _one_gpu_nccl(mode: str, port: int, out: Any) -> None:  # a process, alone on GPU 0
    """Real NCCL groups of one rank: the process's first group as DeepSpeed's is built (torch's defaults),
    then a weight group (nccl_backend, connect) whose broadcast times out behind a busy GPU. ``mode``
    "survive" calls survive_weight_group_failures first, as the learner and the engines do; "torch-default"
    leaves torch's monitor as it is. Each finding goes to ``out`` as it is made."""
    os.environ.pop(nccl_group.DUMP_ON_FAILURE, None)
    # torch's monitor ends the process this long after a failure it is told of (480 s by default)
    os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = "15"
    os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "1000"
    os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = f"/tmp/vcpo-test-nccl-trace-{os.getpid()}-"
    if mode == "survive":
        nccl_group.survive_weight_group_failures()
    try:
        device = torch.device("cuda:0")
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30), wait_for_workers=False)
        first = dist.ProcessGroupNCCL(
            dist.PrefixStore("first/", store), 0, 1, dist.ProcessGroupNCCL.Options()
        )
        first.allreduce([torch.ones(1, device=device)], dist.AllreduceOptions()).wait()
        weights = nccl_group.nccl_backend(dist.PrefixStore("weights/", store), 0, 1, timedelta(seconds=2))
        t0 = time.monotonic()
        nccl_group.connect(weights, device, 60)
        payload = torch.randn(1 << 20, device=device).to(torch.bfloat16)
        sent = payload.clone()
        weights.broadcast([payload], dist.BroadcastOptions()).wait()
        torch.cuda.synchronize()
        out.put(("connected", time.monotonic() - t0, bool(torch.equal(payload, sent))))

        # the GPU busy for 5 s: the broadcast queued behind it times out after the group's 2 s
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        torch.cuda._sleep(200_000_000)
        torch.cuda.synchronize()
        cycles_per_s = 200_000_000 / (time.monotonic() - t0)
        torch.cuda._sleep(int(cycles_per_s * 5))
        work = weights.broadcast([payload], dist.BroadcastOptions())
        t0 = time.monotonic()
        # as WeightGroup.wait does: until the collective ends, or its result says it failed before that
        while (
            not work.is_completed() and not nccl_group.failure(weights, work) and time.monotonic() - t0 < 30
        ):
            time.sleep(0.01)
        failure = nccl_group.failure(weights, work) or "none seen"
        try:  # what torch's own wait says of it (on the H200: returned True)
            said_by_wait: Any = work.wait(timedelta(seconds=30))
        except Exception as exc:
            said_by_wait = f"raised: {str(exc).splitlines()[0][:200]}"
        out.put(("torch's wait", None, said_by_wait))
        # a commit vote after the failure: refused once the watchdog has aborted the communicator; issued
        # before that, it "completes", and only the group's error tells
        started = time.monotonic()
        try:
            vote = weights.allreduce([torch.ones(1, device=device)], dist.AllreduceOptions())
            while not vote.is_completed() and time.monotonic() - started < 30:
                time.sleep(0.01)
            seen = nccl_group.failure(weights, vote) or "none seen"
        except Exception as exc:
            seen = f"refused: {str(exc).splitlines()[0][:200]}"
        out.put(("vote", time.monotonic() - started, seen))
        out.put(("failed", time.monotonic() - t0, failure))
        time.sleep(30)  # torch's monitor, told of the failure, ends the process within about 17 s of it
        out.put(("alive", None, None))
        if mode == "survive":
            # a weight group whose other rank never connects: rank 0's connect gives up within its bound
            lonely = nccl_group.nccl_backend(dist.PrefixStore("lonely/", store), 0, 2, timedelta(seconds=30))
            t0 = time.monotonic()
            try:
                nccl_group.connect(lonely, device, 3)
                said = "connected"
            except TimeoutError as exc:
                said = str(exc)
            out.put(("lonely", time.monotonic() - t0, said))
            # and the process goes on: a new group still moves bytes
            again = nccl_group.nccl_backend(dist.PrefixStore("again/", store), 0, 1, timedelta(seconds=30))
            nccl_group.connect(again, device, 60)
            torch.cuda.synchronize()
            payload = sent.clone()
            again.broadcast([payload], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize()
            out.put(("again", None, bool(torch.equal(payload, sent))))
            # the failed group and the unconnected one, aborted, are destroyed on the reaper thread as a closed
            # weight group's are (retired.py); the process and its other groups go on
            weights.abort()
            for pg in (weights, lonely):
                retired.retire(pg, 0)
            del pg, weights, lonely
            t0 = time.monotonic()
            while retired.waiting() and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            again.broadcast([payload], dist.BroadcastOptions()).wait()
            torch.cuda.synchronize()
            out.put(
                ("destroyed", time.monotonic() - t0, (retired.waiting(), bool(torch.equal(payload, sent))))
            )
    except BaseException as exc:
        out.put(("raised", None, f"{type(exc).__name__}: {exc}"[:400]))
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.gpu
def test_on_a_gpu_a_failed_weight_broadcast_leaves_the_process_up_and_a_missing_rank_fails_the_connect() -> (
    None
):
    """Real NCCL on one GPU (groups of one rank, since NCCL refuses two ranks on one GPU): the weight
    group's builder and its bounded connect against torch's ProcessGroupNCCL. A broadcast that times out is
    seen to have failed (torch raises nothing for it: its wait returns), and so is a vote issued after it
    (refused by torch once the communicator is aborted, which the weight group has done within a second);
    torch's NCCL monitor does not end the process afterwards (with torch's default setting, beside it, the
    monitor does: the check can fail). A rank that never connects fails the connect within its bound, and
    the process then forms new groups; the failed groups, retired as a closed weight group's are, are destroyed
    on the reaper thread while the process goes on."""
    ctx = mp.get_context("spawn")
    runs = {}
    for mode in ("survive", "torch-default"):
        out = ctx.Queue()
        process = ctx.Process(target=_one_gpu_nccl, args=(mode, free_port(), out), daemon=True)
        process.start()
        runs[mode] = (process, out)
    said: dict[str, dict[str, tuple[Any, Any]]] = {}
    codes: dict[str, int | None] = {}
    for mode, (process, out) in runs.items():
        process.join(timeout=180)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        codes[mode], said[mode] = process.exitcode, {}
        while True:
            try:
                what, seconds, detail = out.get(timeout=2)
            except Exception:
                break
            said[mode][what] = (seconds, detail)
    print(f"real NCCL on one GPU: exit codes {codes}, findings {said}")
    survive = said["survive"]
    assert "raised" not in survive, survive
    assert survive["connected"][1] is True and survive["connected"][0] < 60, survive
    # the timed-out broadcast is seen to have failed, as is the vote issued after it
    assert survive["failed"][1] == "NCCL ended the collective with TIMEOUT", survive
    assert survive["failed"][0] < 10, survive  # within the watchdog's pass after the 2 s timeout, not 5 s
    vote = survive["vote"][1]
    assert vote.startswith(("the NCCL group failed (TIMEOUT)", "refused: ")), survive
    assert "alive" in survive and codes["survive"] == 0, (codes, survive)
    seconds, why = survive["lonely"]
    assert why == "NCCL's communicator was not made within 3s" and seconds < 10, survive
    assert survive["again"][1] is True, survive
    assert survive["destroyed"][1] == (0, True) and survive["destroyed"][0] < 30, survive
    control = said["torch-default"]
    assert "raised" not in control and "failed" in control, control
    assert "alive" not in control and codes["torch-default"] not in (0, None), (
        f"torch's NCCL monitor did not end the process after the failure ({codes}, {control}): this test "
        "does not reach the monitor that survive_weight_group_failures turns off"
    )


@pytest.mark.parametrize("gives_up", [True, False])
def test_closing_a_publisher_waits_for_an_overdue_broadcast_at_most_twice_its_budget(gives_up: bool) -> None:
    """A broadcast still going when ``close`` can wait no longer is aborted and counted as failed (rank 0
    cannot tell whether every receiver committed it), and its thread is given the same wait again to give up.
    One that does not is left behind: ``close`` returns (it waited for that thread without bound before,
    here the 30 s this stand-in for a stuck broadcast ignores the abort for), the thread is a daemon (one of an
    executor would hold the process at exit), and what it may still use is let go once it ends: a device
    buffer the broadcast makes after ``close`` had let go of everything goes too."""
    from services.weight_transport import broadcast_thread
    from services.weight_transport.buckets import TransferStats
    from services.weight_transport.collective import BroadcastOverdue

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=20))
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    release = threading.Event()
    made: list[bool] = []

    def sending(version: int, *args: Any, **kwargs: Any) -> TransferStats:
        while not release.is_set() and not (gives_up and groups[0].closed):  # deaf to the abort, or not
            time.sleep(0.01)
        publisher._buffer(0, 4096)  # as a broadcast from host staging under NCCL does
        made.append(bool(publisher._buffers))
        return TransferStats(version, 1, 1, 1, 0.0)

    publisher._broadcast = sending  # type: ignore[method-assign]
    tensors = version_tensors(3)
    try:
        publisher.send_background(3, specs_of(tensors), iter(tensors))
        thread = publisher._thread
        assert thread is not None and thread.daemon
        t0 = time.monotonic()
        failure = publisher.close(timeout_s=0.5)
        waited = time.monotonic() - t0
        assert isinstance(failure, BroadcastOverdue) and groups[0].closed
        assert waited < 2.0, waited
        assert (thread in broadcast_thread.left_behind()) != gives_up
    finally:
        release.set()
    thread.join(timeout=10)
    assert made == [True]
    deadline = time.monotonic() + 10
    while publisher._buffers and time.monotonic() < deadline:
        time.sleep(0.01)  # a done callback runs just after the thread's result is set
    assert publisher._buffers == []
    for g in groups:
        g.close()


def test_the_interpreters_exit_waits_a_while_for_broadcasts_left_behind() -> None:
    """A daemon thread that takes the GIL back while Python finalizes is ended by a forced unwind, which
    torch's frames turn into std::terminate: the exit waits for broadcasts left behind first (for at most
    broadcast_thread.EXIT_WAIT_S), and what they leave is let go of as each ends."""
    import subprocess
    import sys

    code = """
import time
from concurrent.futures import Future
from services.weight_transport import broadcast_thread
def stuck():
    time.sleep(1.5)
    raise RuntimeError("the group was aborted")
thread, future = broadcast_thread.start("weight-broadcast-1", stuck)
broadcast_thread.leave_behind(thread, future, lambda: print("let go", flush=True))
print("exiting", flush=True)
"""
    t0 = time.monotonic()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exiting", "let", "go"]
    assert time.monotonic() - t0 >= 1.5


def test_closing_a_publisher_logs_any_failure_of_its_last_broadcast_and_lets_its_buffers_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The coordinator closes an epoch's publisher when it drops the epoch: an error other than a
    TransferFailed from its background broadcast is logged there too (it used to escape into learner rank
    0's publish, while the other ranks waited in their agreement), and its bucket buffers go with it. So
    does the staged version at once: the failure's traceback held it in a reference cycle until the garbage
    collector ran (a whole model of page-locked memory, beside the next version's)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    groups = form(GroupSpec("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=20))
    gc.collect()
    gc.disable()
    publisher = CollectivePublisher(groups[0], bucket_bytes=8192)
    publisher._buffer(0, 4096)
    assert publisher._buffers

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    publisher._broadcast = broken  # type: ignore[method-assign]
    tensors = version_tensors(3)
    try:
        publisher.send_background(3, specs_of(tensors), iter(tensors))
        staging = publisher._staging._tensor
        assert staging is not None  # staged
        staged = StorageWeakRef(staging.untyped_storage())
        del staging
        with caplog.at_level(logging.WARNING, logger="services.weight_transport.collective"):
            publisher.close()
        assert staged.expired()  # freed, and no garbage collection has run
    finally:
        gc.enable()
    assert "the last background broadcast failed: CUDA error: an illegal memory access" in caplog.text
    assert publisher._buffers == []
    for g in groups:
        g.close()
