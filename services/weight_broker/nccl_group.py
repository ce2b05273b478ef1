"""The weight group's NCCL process group, built so that its failures are the caller's to handle: a member
killed mid-broadcast must fail the broadcast (a new epoch forms), not take the learner's process down."""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Any

# torch's NCCL error handling, read once by each ProcessGroupNCCL it constructs. Its default (3, SkipCleanUp)
# has the watchdog take the whole process down when a collective fails or times out: a sampler killed
# mid-broadcast would kill learner rank 0 with it. The weight group's failures are expected and survivable
# (the version goes through the broker, a new epoch forms), so its group is built with 2 (CleanUpOnly): the
# watchdog aborts the communicator and the collective's error reaches WeightGroup.wait instead.
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
NCCL_CLEAN_UP_ONLY = "2"
_ENV_LOCK = threading.Lock()
# torch's NCCL watchdog raises one process-wide "dump" flag when a collective of ANY of the process's NCCL
# groups fails or times out, and the monitor thread of its first NCCL group (DeepSpeed's in the learner, vLLM's
# in a GPU worker) then writes a debug dump, waits TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) and ends the
# process: a weight broadcast that failed, and was handled, would still kill the learner minutes later. That
# monitor reads this variable when that group is made; "0" has it ignore the flag (its own collectives'
# failures still end the process, through the watchdog's error handling, and so does a hung watchdog).
DUMP_ON_FAILURE = "TORCH_NCCL_DUMP_ON_TIMEOUT"
log = logging.getLogger(__name__)


def survive_weight_group_failures() -> None:
    """Call in a process that will be in an NCCL weight group, before it makes its first NCCL process group
    (:data:`DUMP_ON_FAILURE`). Its vLLM workers, spawned from it, inherit the setting. A value the user set is
    kept, with a warning where it leaves the process to be ended after a failed weight broadcast."""
    value = os.environ.setdefault(DUMP_ON_FAILURE, "0")
    if value.strip().lower() not in ("0", "false", "no", "n", "off"):
        log.warning(
            "%s=%s: a weight broadcast that fails (a sampler killed mid-broadcast) will end this process "
            "about TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later (torch's NCCL monitor); unset it or set 0 to keep it",
            DUMP_ON_FAILURE,
            value,
        )


def nccl_backend(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL over ``store`` whose failures are raised to the caller, never fatal to the process
    (:data:`NCCL_ERROR_HANDLING_VARS`; the variables are restored once it is built, so no other group of the
    process is changed). NCCL connects lazily, at the first collective."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in NCCL_ERROR_HANDLING_VARS}
        os.environ.update(dict.fromkeys(NCCL_ERROR_HANDLING_VARS, NCCL_CLEAN_UP_ONLY))
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
