"""The tensors a vLLM model's layers were built with, put back after a reload that failed part-way.

vLLM reloads weights layer by layer (``vllm/model_executor/model_loader/reload/layerwise.py``): every layer's
tensors go to the meta device; once all of a layer's weights have arrived, the layer is materialized (new
tensors), loaded and processed, and its values are copied back into the tensors it had before, which are
registered again. Those are the storages a GPU engine's CUDA graphs were captured on.

A reload that fails inside that processing (an out-of-memory error while materializing a layer, in the
headroom vLLM leaves beside its KV cache; a weight loader's error) leaves that layer on its new tensors, or
partly on meta, and vLLM's finalize drops the originals. Loading the previous version back then goes into
those tensors: on a GPU the captured graphs go on reading the originals, so graphed steps would serve one
version and eager ones another, silently, from then on; a layer left on meta fails every step. So the worker
holds each layer's tensors at its first reload and, after a failed one, registers them again before anything
is loaded (:func:`put_back`). Their values are then the last version's or part of the failed one: the sampler
loads a whole version into them next.
"""

from __future__ import annotations

import logging
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


def put_back(model: Any) -> list[str]:
    """After a failed reload and vLLM's finalize: register again, in every layer, each tensor held that the
    layer no longer has. Returns their names (qualified), logged; nothing where :func:`hold` never ran."""
    held = getattr(model, _ATTR, None)
    if held is None:
        return []
    names = {id(m): prefix for prefix, m in model.named_modules()}
    changed = []
    for module, name, tensor, is_param, persistent in held:
        current = (module._parameters if is_param else module._buffers).get(name)
        if current is tensor:
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
    return changed


def finish_interrupted_reload(model: Any, model_config: Any) -> list[str]:
    """After a reload raised part-way: vLLM's reload state finished (every layer back on the device, the
    layers it had not reached on meta included), then every layer on its own tensors (:func:`put_back`, whose
    names it returns)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    return put_back(model)
