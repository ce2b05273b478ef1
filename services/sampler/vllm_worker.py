"""What the sampler runs inside vLLM's workers, as named methods (vLLM's ``worker_extension_cls``): a
multi-process engine (every GPU engine) ships a ``collective_rpc`` call to its workers by name, and refuses a
Python function unless insecure serialization is switched on.

Every call the sampler makes goes through :meth:`VcpoWorkerExtension.vcpo_call`, which returns a worker's
error instead of raising it. vLLM's multi-process executor (every engine with tensor parallelism) reads the
workers' replies one by one and raises at the first failure, leaving the other workers' replies queued:
every later call, vLLM's own too, would then read the reply of the call before it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from services.sampler.kernel_tensors import guarded_reload

WORKER_EXTENSION = "services.sampler.vllm_worker.VcpoWorkerExtension"

# every worker process imports this module before it builds its model: make the collective weight-transfer
# backend known to vLLM there (services/sampler/weight_transfer.py)
from services.sampler.weight_transfer import register as _register_weight_transfer  # noqa: E402

_register_weight_transfer()

log = logging.getLogger(__name__)


@functools.cache
def _worker_logging() -> None:
    """A worker process that vLLM spawned starts with no logging: the project's lines would be lost. Set up
    where nothing is, once, at the first call rather than at import (a service that imports this module
    before setting up its own logging would print every line twice)."""
    services = logging.getLogger("services")
    if not logging.getLogger().handlers and not services.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s sampler worker %(levelname)s %(name)s: %(message)s")
        )
        services.addHandler(handler)
        services.setLevel(logging.INFO)


class VcpoWorkerExtension:
    """Mixed into each vLLM worker; ``self`` is the worker (``self.model_runner`` is its model runner)."""

    model_runner: Any
    weight_transfer_engine: Any  # the collective transport's (weight_transfer.py), where the engine has one
    _weight_update_active: bool  # vLLM's worker's: a weight-update session is open

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
        """vLLM's ``reload_weights``; should it fail, every layer back on its own tensors (kernel_tensors.py)."""
        with guarded_reload(self.model_runner.get_model(), self.model_runner.model_config):
            self.reload_weights(**source)  # type: ignore[attr-defined]

    def vcpo_load_adapter(self, name: str, slot: int, path: str) -> None:
        """vLLM's ``add_lora`` in place: the adapter in ``slot`` replaced by the one in ``path``, for requests in
        flight too (services/sampler/engine_lora.py)."""
        from vllm.lora.request import LoRARequest

        if not self.add_lora(LoRARequest(name, slot, path, load_inplace=True)):  # type: ignore[attr-defined]
            raise RuntimeError(f"vLLM did not load adapter {name} from {path}")

    def vcpo_unload_adapter(self, slot: int) -> None:
        self.remove_lora(slot)  # type: ignore[attr-defined]

    def vcpo_leave_weight_group(self, why: str | None) -> None:
        if getattr(self, "weight_transfer_engine", None) is not None:
            self.weight_transfer_engine.shutdown(why)

    def vcpo_weight_work(self) -> str | None:
        """Where this worker's join or receive stands (``Background.state``); never raises: no ``vcpo_call``."""
        work = getattr(getattr(self, "weight_transfer_engine", None), "work", None)
        return None if work is None else work.state()

    def vcpo_end_failed_weight_update(self) -> None:
        """vLLM's worker clears its "update session active" mark only after a load that succeeded or where its
        own ``update_weights`` raised, and refuses every later ``start_weight_update`` while it is set: after
        ``finish_weight_update`` raised, or another worker's part of an update failed, the engine could never
        take a broadcast version again. End the session as vLLM does, dropping what this worker staged."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.discard_staged()
            engine.reset_weight_update_target()
            self._weight_update_active = False
