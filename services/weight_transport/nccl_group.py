"""The weight group's NCCL process group, built so that its failures are the caller's to handle: a member
killed mid-broadcast must fail the broadcast (a new epoch forms), not take the learner's process down, now or
minutes later; and connected within a bound, so that a rank that never joins fails the forming."""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

# torch's NCCL error handling, read by each ProcessGroupNCCL it constructs. Its default (3, SkipCleanUp) has the
# watchdog end the process when a collective fails or times out: a sampler killed mid-broadcast would kill learner
# rank 0. 2 (CleanUpOnly): the watchdog aborts the communicator and WeightGroup.wait reads the failure.
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
# After a failure torch's watchdog sleeps 4 x this (a minute by default) before it aborts the communicator,
# every collective issued meanwhile blocking in torch. Read when the group is built.
DUMP_WAIT_VAR, DUMP_WAIT_MS = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "100"
_ENV_LOCK = threading.Lock()
# torch's watchdog raises one process-wide "dump" flag when a collective of ANY of the process's NCCL groups
# fails, and the monitor of its first NCCL group (DeepSpeed's, vLLM's) then ends the process 8 minutes later: a
# failed weight broadcast, handled, would still kill the learner. "0", read when that group is made, has it
# ignore the flag (its own collectives' failures still end the process, through the watchdog).
DUMP_ON_FAILURE = "TORCH_NCCL_DUMP_ON_TIMEOUT"
# c10d's WorkResult codes. torch does not raise every failed collective of a CleanUpOnly group (on an H200 a
# broadcast the watchdog had timed out "waited" as if its bytes had arrived): the work's result and the group's
# error tell (:func:`failure`).
_WORK_RESULTS = {0: "SUCCESS", 1: "TIMEOUT", 2: "COMM_ERROR", 100: "UNKNOWN"}
log = logging.getLogger(__name__)


def survive_weight_group_failures() -> None:
    """Call in a process that will be in an NCCL weight group (its vLLM workers inherit it), before it makes its
    first NCCL process group (:data:`DUMP_ON_FAILURE`); a value the user set is kept, with a warning."""
    value = os.environ.setdefault(DUMP_ON_FAILURE, "0")
    if value.strip().lower() not in ("0", "false", "no", "n", "off"):
        log.warning(
            "%s=%s: a weight broadcast that fails (a sampler killed mid-broadcast) will end this process "
            "about TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later (torch's NCCL monitor); unset it or set 0 to keep it",
            DUMP_ON_FAILURE,
            value,
        )


def nccl_backend(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL over ``store`` whose failures are the caller's to read (:func:`failure`), never fatal
    (:data:`NCCL_ERROR_HANDLING_VARS`), aborted soon after one (:data:`DUMP_WAIT_VAR`); the variables are
    restored once it is built, so no other group of the process is changed."""
    import torch.distributed as dist

    # high priority: each epoch's group takes the next of torch's pooled streams, and the low-priority pool is
    # shared with DeepSpeed's, whose collectives would, after enough epochs, queue behind a weight broadcast
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    options._timeout = timeout
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in (*NCCL_ERROR_HANDLING_VARS, DUMP_WAIT_VAR)}
        os.environ.update(dict.fromkeys(NCCL_ERROR_HANDLING_VARS, "2"))  # CleanUpOnly
        os.environ[DUMP_WAIT_VAR] = DUMP_WAIT_MS
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def connect(pg: Any, device: Any, limit_s: float) -> None:
    """Run ``pg``'s first collectives within ``limit_s``: an all-reduce, in which NCCL makes its communicator,
    and a broadcast, since NCCL connects each algorithm's links at its first use (``NCCL_RUNTIME_CONNECT``) and
    a ring link that cannot connect would otherwise fail the first version after the group's timeout. Raises
    (TimeoutError, or NCCL's error) having aborted ``pg``, not destroyed it (the reaper thread does,
    ``retired.py``). torch's blocking initialization returns only once every rank has connected, so the calls
    run on a thread, and so does an abort while the communicator is still being made."""
    import torch
    import torch.distributed as dist

    deadline = time.monotonic() + limit_s
    started: list[Any] = []  # the collectives' works, or what one raised

    def first_collectives() -> None:
        try:
            # on a stream of their own: NCCL's waits for the caller's, here the device's default one, where a
            # training step's backlog would read as a member that cannot connect
            own = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()
            with own:  # (and on its device: a stream's context makes its device current)
                started.append(pg.allreduce([torch.zeros(1, device=device)], dist.AllreduceOptions()))
                started.append(pg.broadcast([torch.zeros(1, device=device)], dist.BroadcastOptions()))
        except BaseException as exc:
            started.append(exc)

    caller = threading.Thread(target=first_collectives, name="nccl-connect", daemon=True)
    caller.start()
    caller.join(limit_s)
    try:
        if caller.is_alive():
            raise TimeoutError(f"NCCL's communicator was not made within {limit_s:.0f}s")
        for work in started:
            if isinstance(work, BaseException):
                raise work
        for work in started:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not connect within {limit_s:.0f}s")
                time.sleep(0.005)
            work.wait(timedelta(seconds=limit_s))
            why = failure(pg, work)
            if why:
                raise RuntimeError(why)
    except BaseException:
        if caller.is_alive():
            threading.Thread(target=_abort, args=(pg,), name="nccl-abort", daemon=True).start()
        else:
            _abort(pg)
        raise


def _abort(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:
        log.debug("aborting an unconnected NCCL group raised", exc_info=True)


def failure(pg: Any, work: Any) -> str | None:
    """Why ``work``, a completed or pending collective of ``pg``, failed (None: no failure known). torch marks
    a result as soon as it fails, its success only on the watchdog's next pass: an unmarked one is not waited
    for. The group's error stays set after any failure, so it also fails a collective issued after it."""
    try:
        result = work.get_future_result()
        if result.done():
            code = int(result.value())
            if code != 0:
                return f"NCCL ended the collective with {_WORK_RESULTS.get(code, code)}"
    except Exception:  # a torch without work results: the group's error below still tells
        log.debug("cannot read an NCCL collective's result", exc_info=True)
    try:
        error = pg.get_error()
    except Exception:
        log.debug("cannot read the NCCL group's error", exc_info=True)
        return None
    name = getattr(error, "name", None) or str(error).rsplit(".", 1)[-1]
    return None if name == "SUCCESS" else f"the NCCL group failed ({name})"
