"""The tensors a vLLM model's layers were built with, put back after a reload that failed part-way.

vLLM reloads weights layer by layer (``model_loader/reload/layerwise.py``): a layer whose weights have all
arrived is materialized on new tensors, loaded, processed, and its values copied back into the tensors it had
before, those a GPU engine's CUDA graphs were captured on. A reload that fails inside that processing (out of
memory, a weight loader's error) leaves the layer on new tensors or partly on meta, and vLLM's finalize drops
the originals: graphed steps would then serve one version and eager ones another, silently. So every reload
runs inside :func:`guarded_reload`, which registers the layers' own tensors again after a failure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
_ATTR = "_vcpo_kernel_tensors"  # on the model: (module, name, tensor, parameter?, persistent buffer?)


def hold(model: Any) -> None:
    """Remember every layer's tensors, once per model: call before each reload (the first is before any)."""
    if getattr(model, _ATTR, None) is not None:
        return
    held: list[tuple[Any, str, Any, bool, bool]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                held.append((module, name, param, True, True))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                held.append((module, name, buffer, False, name not in module._non_persistent_buffers_set))
    # on the model itself (a plain attribute): it goes with the model
    object.__setattr__(model, _ATTR, held)


def put_back(model: Any) -> None:
    """After a failed reload and vLLM's finalize: register again, in every layer, each tensor :func:`hold`
    held that the layer no longer has."""
    names = {id(m): prefix for prefix, m in model.named_modules()}
    changed = []
    for module, name, tensor, is_param, persistent in getattr(model, _ATTR):
        if (module._parameters if is_param else module._buffers).get(name) is tensor:
            continue
        if hasattr(module, name):
            delattr(module, name)
        if is_param:
            module.register_parameter(name, tensor)
        else:
            module.register_buffer(name, tensor, persistent=persistent)
        prefix = names.get(id(module), "?")
        changed.append(f"{prefix}.{name}" if prefix else name)
    if changed:
        log.warning(
            "a failed reload left %d tensors off the storage the engine was built on (e.g. %s): put back",
            len(changed),
            ", ".join(changed[:3]),
        )


@contextlib.contextmanager
def guarded_reload(model: Any, model_config: Any) -> Iterator[None]:
    """Around every reload: the layers' tensors held first; should it raise part-way, vLLM's reload state
    finished (every layer back on the device, where the whole previous version can be loaded) and every layer
    on its own tensors again (:func:`put_back`)."""
    hold(model)
    try:
        yield
    except BaseException:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(model, model_config)
        put_back(model)
        raise
