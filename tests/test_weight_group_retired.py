"""Closed weight groups give their threads and sockets back (services/weight_broker/retired.py), on real gloo
groups: a process group is destroyed on the reaper thread, never on the thread that closed or dropped it, even
while one of its collectives still waits on a peer that hung; every epoch's descriptors and threads are gone
once the reaper has run, so a run that re-forms its group again and again does not run out of them."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.weight_broker import retired
from services.weight_broker.weight_group import GroupSpec, TransferFailed, WeightGroup


def _held() -> tuple[int, int]:
    """This process's open descriptors and threads (the operating system's: gloo's own are not Python's)."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _form(spec: GroupSpec) -> list[WeightGroup]:
    groups: list[WeightGroup | None] = [None] * spec.world_size

    def join(rank: int) -> None:
        groups[rank] = WeightGroup(spec, rank, torch.device("cpu"))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(spec.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups), groups
    return groups  # type: ignore[return-value]


def _reaped(limit_s: float) -> float:
    """Seconds until every retired group was destroyed (fails after ``limit_s``)."""
    t0 = time.monotonic()
    while retired.waiting():
        assert time.monotonic() - t0 < limit_s, f"{retired.waiting()} retired groups not destroyed"
        time.sleep(0.1)
    gc.collect()  # the groups' stores go with the groups themselves (which the announcement watch keeps in a cycle)
    return time.monotonic() - t0


def _epoch(epoch: int) -> None:
    """Form a group of three ranks, move a tensor, close it."""
    groups = _form(GroupSpec("127.0.0.1", free_port(), 3, "gloo", epoch=epoch, timeout_s=30.0))
    sent = torch.arange(1000, dtype=torch.float32)
    got = [sent.clone() if g.rank == 0 else torch.zeros(1000) for g in groups]
    works = [g.broadcast(t) for g, t in zip(groups, got, strict=True)]
    for g, w in zip(groups, works, strict=True):
        g.wait(w)
    assert all(torch.equal(t, sent) for t in got)
    for g in groups:
        g.close()
    with pytest.raises(TransferFailed, match=f"weight group epoch {epoch} is closed"):
        groups[1].broadcast(torch.zeros(3))


def _epochs(out: Any) -> None:
    try:
        out.put(_measure())
    except BaseException:
        out.put({"error": traceback.format_exc()})


def _measure() -> dict[str, Any]:
    """In a process of its own (no other test's threads or sockets come and go in it): what it held after
    the first epoch, after four more, after a fifth whose broadcast waited on a hung rank when it was closed,
    how long closing and dropping that one took and how long its destruction then took."""
    _epoch(0)  # torch's and gloo's own first use (a few descriptors kept for good), the reaper thread's start
    _reaped(30)
    fds, threads = _held()
    for epoch in range(1, 5):  # a run re-forming its group again and again
        _epoch(epoch)
    _reaped(30)
    four = _held()

    # rank 2 hangs: ranks 0 and 1 are in a broadcast that only the group's timeout ends
    groups = _form(GroupSpec("127.0.0.1", free_port(), 3, "gloo", epoch=5, timeout_s=4.0))
    works = [g.broadcast(torch.zeros(1000)) for g in groups[:2]]
    time.sleep(0.5)
    t0 = time.monotonic()
    for g in groups:
        g.close()
    del groups, works
    gc.collect()
    dropped = time.monotonic() - t0
    waited = _reaped(30)
    return {"first": (fds, threads), "four": four, "hung": _held(), "dropped": dropped, "waited": waited}


@pytest.mark.timeout(120)
def test_closed_groups_give_back_their_sockets_and_threads_off_the_callers_thread() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_epochs, args=(out,))
    proc.start()
    got = out.get(timeout=100)
    proc.join(30)
    assert "error" not in got, got.get("error")
    (fds, threads), four, hung = got["first"], got["four"], got["hung"]
    # four epochs of three ranks kept about 120 descriptors and 40 threads when closed groups were never destroyed
    assert four[0] <= fds + 2 and four[1] <= threads + 1, got
    assert hung[0] <= fds + 2 and hung[1] <= threads + 1, got
    # destroying rank 1's group waited out its pending broadcast (the 4 s timeout): the reaper's wait, not the
    # wait of the thread that closed and dropped it
    assert got["dropped"] < 1.0 and got["waited"] > 1.5, got


_EXIT_WHILE_DESTROYING = """
import atexit, gc, sys, threading, time

# registered before the reaper's own exit handler, so it runs after it (atexit runs the last registered first)
atexit.register(lambda: print("destroyed at exit:", sys.modules["services.weight_broker.retired"].destroyed))

import torch
from services.common.ports import free_port
from services.weight_broker import retired
from services.weight_broker.weight_group import GroupSpec, WeightGroup

spec = GroupSpec("127.0.0.1", free_port(), 3, "gloo", epoch=0, timeout_s=3.0)
groups = [None] * 3
threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, WeightGroup(spec, r))) for r in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
works = [g.broadcast(torch.zeros(1000)) for g in groups[:2]]  # rank 2 hangs: rank 1's waits for the timeout
time.sleep(0.3)
for g in groups:
    g.close()
del groups, works, g
gc.collect()
deadline = time.monotonic() + 20
while retired.waiting() + retired.destroyed == 3 and time.monotonic() < deadline:  # until one is under way
    time.sleep(0.01)
time.sleep(0.3)  # the group whose broadcast is pending: its destroy waits out the broadcast's timeout
print("exiting with", retired.waiting(), "waiting and", retired.destroyed, "destroyed", flush=True)
sys.exit(0)
"""


@pytest.mark.timeout(120)
def test_the_interpreter_exits_cleanly_while_a_retired_group_is_being_destroyed() -> None:
    """A thread that takes the GIL back while Python finalizes is ended by a forced unwind, which torch's
    destructor frames do not allow: a test session whose tests had all passed aborted so (std::terminate) when
    the reaper finished a destroy during its exit. The exit now stops the reaper and waits for a destroy under
    way: the process ends with 0, the destroy finished before Python finalized."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "gen")])}
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_DESTROYING],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    said = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, said
    found = re.search(r"exiting with (\d) waiting and (\d) destroyed", said)
    assert found, said
    waiting, destroyed = int(found[1]), int(found[2])
    assert waiting + destroyed == 2, said  # of the three groups, one was being destroyed when it exited
    assert f"destroyed at exit: {destroyed + 1}" in said, said  # and that ended before Python finalized
