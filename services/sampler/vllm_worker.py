"""What the sampler runs inside vLLM's workers, as named methods (vLLM's ``worker_extension_cls``).

A multi-process engine (every GPU engine: the engine core and its workers are separate processes) ships a
``collective_rpc`` call to its workers by name; a Python function is refused unless insecure serialization
is switched on, and that refusal would hide the error that made the call necessary. So each worker-side step
the sampler needs is a method here, mixed into vLLM's worker class, and called as
``llm.collective_rpc("vcpo_<name>")`` in-process and out alike.

Every call the sampler makes goes through :meth:`VcpoWorkerExtension.vcpo_call`, which returns a worker's
error instead of raising it. vLLM's multi-process executor (every engine with tensor parallelism) reads the
workers' replies one by one and raises at the first failure, leaving the other workers' replies queued:
every later call, vLLM's own too, would then read the reply of the call before it (a failed join made the
next pause raise that join's error, and a join that worked look failed).
"""

from __future__ import annotations

import logging
from typing import Any

from services.sampler.kernel_tensors import finish_interrupted_reload, hold

WORKER_EXTENSION = "services.sampler.vllm_worker.VcpoWorkerExtension"

# every worker process imports this module before it builds its model: make the collective weight-transfer
# backend known to vLLM there (services/sampler/weight_transfer.py)
from services.sampler.weight_transfer import register as _register_weight_transfer  # noqa: E402

_register_weight_transfer()

log = logging.getLogger(__name__)
_logging_checked = False


def _worker_logging() -> None:
    """A worker process that vLLM spawned (every GPU engine's) starts with no logging set up: the project's
    own lines (joining the weight group, each version received) would be lost below warnings, and those
    would come bare. Set up where nothing is (a forked or in-process worker keeps what its parent set up).
    Checked at the first call into the worker rather than at import, so that a service which imports this
    module before setting up its own logging (``actor_logging``) does not print every line twice."""
    global _logging_checked
    if _logging_checked:
        return
    _logging_checked = True
    if not logging.getLogger().handlers and not logging.getLogger("services").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s sampler worker %(levelname)s %(name)s: %(message)s")
        )
        logging.getLogger("services").addHandler(handler)
        logging.getLogger("services").setLevel(logging.INFO)


class VcpoWorkerExtension:
    """Mixed into each vLLM worker; ``self`` is the worker (``self.model_runner`` is its model runner)."""

    model_runner: Any

    def vcpo_call(self, method: str, *args: Any, **kwargs: Any) -> str | None:
        """Run this worker's ``method``; None once it returned, or its error as text (never raised: see the
        module's docstring). The sampler raises one error for all workers (``VllmEngine._rpc``)."""
        _worker_logging()
        try:
            getattr(self, method)(*args, **kwargs)
        except Exception as exc:
            log.exception("worker call %s failed", method)
            return f"{type(exc).__name__}: {exc}"
        return None

    def vcpo_reload_weights(self, **source: Any) -> None:
        """vLLM's ``reload_weights``, with the layers' own tensors held first (``kernel_tensors.py``)."""
        hold(self.model_runner.get_model())
        self.reload_weights(**source)  # type: ignore[attr-defined]

    def vcpo_finish_interrupted_reload(self) -> None:
        """After ``reload_weights`` raised part-way: vLLM reloads layer by layer and holds the layers it has
        not reached on the meta device; finish its reload state so every layer is back on the device, on the
        tensors it was built with (those a GPU engine's CUDA graphs read, ``kernel_tensors.py``), and a whole
        version can be loaded again (the sampler then loads the previous version back)."""
        runner = self.model_runner
        finish_interrupted_reload(runner.get_model(), runner.model_config)

    def vcpo_leave_weight_group(self, why: str | None) -> None:
        """Leave the weight group this worker is in (``CollectiveWeightTransferEngine.leave``); nothing where it
        is in none."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "leave"):
            engine.leave(why)

    def vcpo_weight_work(self) -> str | None:
        """Where this worker's weight-group work (a join, a receive) stands: None once it ended well (or where
        there is none), "running", or its error. Called without ``vcpo_call``: it never raises."""
        engine = getattr(self, "weight_transfer_engine", None)
        work = getattr(engine, "work", None)
        return None if work is None else work.state()

    def vcpo_end_failed_weight_update(self) -> None:
        """After a weight update failed in any worker: vLLM's worker clears its "update session active" mark
        only after a load that succeeded, or where its own ``update_weights`` raised, and refuses every later
        ``start_weight_update`` while it is set, so the engine could never take a broadcast version again
        (after ``finish_weight_update`` raised, or, with tensor parallelism, where another worker's part of the
        update failed). End the session as vLLM does after a failed ``update_weights``, dropping what this
        worker staged; nothing where no session is open."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "discard_staged"):
            engine.discard_staged()
        if getattr(self, "_weight_update_active", False):
            if engine is not None:
                engine.reset_weight_update_target()
            self._weight_update_active = False
