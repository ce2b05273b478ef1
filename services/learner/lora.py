"""LoRA adapters on the learner's model (``[learner.lora]``), through peft, and the merged weights it publishes.

    from_pretrained (ZeRO-3 partitions the base while it loads)
      └─ apply_lora: peft's inject_adapter_in_model puts LoraLayers in place of the targeted modules of the
         Hugging Face model itself (no PeftModel wrapper, so the decoder, the head and the norm rules see the
         usual module tree); peft freezes every base weight; deepspeed.initialize partitions the adapters
      └─ the optimizer holds the adapters alone (trainable_parameters)
      └─ a published version (published_units) is either the adapters alone, in peft's saved names
         (``publish = "adapter"``: only the adapter partitions are gathered), or the merged model in the base's
         names (``"merged"``): ``X.weight`` = base + Σ peft's get_delta_weight, formed bucket by bucket from
         gathered base and adapter partitions
      └─ a checkpoint holds the adapters; its export merges them into the base read from disk (merged_checkpoint)

The merges are this module's own because peft's ``merge_adapter`` writes into the base weight, which under
ZeRO-3 is a partition that would have to be gathered, modified and re-partitioned on every rank, and undone
before the next step (here the merged tensor exists only in the publish bucket), and because an export reads
the adapters from DeepSpeed's consolidated checkpoint, not from a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from services.common.lora import HEAD_AND_EMBEDDING, LoraConfig, adapter_tensor_name, matches, peft_config

ADAPTABLE = (nn.Linear, nn.Embedding)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject ``cfg``'s adapters into ``model`` in place (base weights frozen); a ``ValueError`` names a target
    that matches no module, or a tied embedding/head that a merged version could not carry."""
    import peft

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and any(matches(t, h) or matches(h, t) for t in cfg.target_modules for h in HEAD_AND_EMBEDDING):
        raise ValueError(
            f"learner.lora.target_modules = {list(cfg.target_modules)} adapts the input embedding or output head "
            "of a model whose word embeddings are tied (config.tie_word_embeddings): the merged version would "
            "put one side's adapter into both; leave lm_head and embed_tokens out of target_modules"
        )
    modules = dict(model.named_modules())
    leaves = sorted({n.rpartition(".")[2] for n, m in modules.items() if isinstance(m, ADAPTABLE)})
    for target in cfg.target_modules:
        matched = [m for n, m in modules.items() if matches(n, target)]
        if not matched:
            raise ValueError(
                f"learner.lora.target_modules: {target!r} names no module of {type(model).__name__} "
                f"(its Linear and Embedding modules: {', '.join(leaves)})"
            )
        other = sorted({type(m).__name__ for m in matched if not isinstance(m, ADAPTABLE)})
        if other:
            raise ValueError(
                f"learner.lora.target_modules: {target!r} names modules LoRA cannot adapt ({', '.join(other)}); "
                f"name Linear or Embedding modules ({', '.join(leaves)})"
            )
    peft.inject_adapter_in_model(peft_config(cfg), model)
    model.vcpo_adapter_versions = cfg.adapter_versions  # what published_units forms a version of
    return model


def register_with_zero3(model: nn.Module) -> None:
    """Tell ZeRO-3 which module reads a LoRA embedding's adapter matrices. They are parameters of peft's
    ``ParameterDict``s, which no forward is called on, so ZeRO-3's module hooks never fetch them (its discovery
    of such reads works only inside ``engine.forward``, and the step calls the model directly); registered as
    external parameters of the embedding, they are fetched with it and released after it."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for module in model.modules():
        for holder in ("lora_embedding_A", "lora_embedding_B"):
            for p in getattr(module, holder, {}).values():
                if hasattr(p, "ds_id"):
                    register_external_parameter(module, p)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer holds: with LoRA the adapters alone (peft froze the base), else every weight."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass(frozen=True)
class PublishedUnit:
    """One tensor of a published version: its name, the parameters to gather to form it, and how."""

    name: str
    like: nn.Parameter  # the parameter whose dtype and full shape the tensor has
    params: tuple[nn.Parameter, ...]
    value: Callable[[], Tensor]  # valid while ``params`` are gathered


def published_units(model: nn.Module) -> list[PublishedUnit]:
    """The tensors of a version, in ``named_parameters()`` order. Without adapters: every parameter as it is
    (tied weights once, as in ``named_parameters()``). With ``publish = "adapter"``: the adapters' matrices
    alone, in peft's saved names (``services/common/lora.py``), the base never gathered. With ``"merged"``: the
    base model's names, a LoRA layer's base weight merged (base + its active adapters' deltas, summed in
    float32, one rounding to the weight's dtype), its base bias under the plain name, its adapters not at
    all."""
    if not any(hasattr(m, "lora_A") for m in model.modules()):  # no adapters: no need to import peft
        return [PublishedUnit(name, p, (p,), _as_is(p)) for name, p in model.named_parameters()]
    if getattr(model, "vcpo_adapter_versions", False):
        return [
            PublishedUnit(tensor, p, (p,), _as_is(p))
            for name, p in model.named_parameters()
            if (tensor := adapter_tensor_name(name)) is not None
        ]
    from peft.tuners.lora import LoraLayer

    layers: dict[str, Any] = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    adapters_of = {
        name: tuple(q for sub, q in layer.named_parameters() if not sub.startswith("base_layer."))
        for name, layer in layers.items()
    }
    adapter_ids = {id(q) for params in adapters_of.values() for q in params}
    units: list[PublishedUnit] = []
    for name, p in model.named_parameters():
        if id(p) in adapter_ids:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if leaf else None
        if layer is None:
            units.append(PublishedUnit(name, p, (p,), _as_is(p)))
            continue
        if leaf != "weight":
            units.append(PublishedUnit(f"{owner}.{leaf}", p, (p,), _as_is(p)))
            continue
        adapters = [a for a in layer.active_adapters if a in layer.scaling]
        units.append(
            PublishedUnit(f"{owner}.weight", p, (p, *adapters_of[owner]), _merged(layer, p, adapters))
        )
    return units


def _as_is(p: nn.Parameter) -> Callable[[], Tensor]:
    return lambda: p.data


def _merged(layer: Any, weight: nn.Parameter, adapters: list[str]) -> Callable[[], Tensor]:
    def value() -> Tensor:
        total = weight.data.float()
        for adapter in adapters:
            total = total + layer.get_delta_weight(adapter).float()
        return total.to(weight.dtype)

    return value


_ADAPTER_NAME = re.compile(
    r"(?P<owner>.+)\.lora_(?P<kind>A|B|embedding_A|embedding_B)\.(?P<adapter>[^.]+)(\.weight)?"
)


class _MergedTensor:
    """A base tensor plus its adapters' deltas, formed when asked (``contiguous``): one at a time, as the
    export's lazy checkpoint tensors are."""

    def __init__(
        self,
        path: Path,
        name: str,
        shape: tuple[int, ...],
        deltas: list[tuple[bool, Any, Any]],
        scaling: float,
    ) -> None:
        self.path, self.name, self.shape, self.deltas, self.scaling = (
            path,
            name,
            torch.Size(shape),
            deltas,
            scaling,
        )

    def contiguous(self) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            total = f.get_tensor(self.name).float()
        for embedding, a, b in self.deltas:
            delta = _full(b) @ _full(a)
            total += self.scaling * (delta.T if embedding else delta)
        return total


def _full(value: Any) -> Tensor:
    return (value if isinstance(value, Tensor) else value.contiguous()).float()


def merged_checkpoint(
    state: dict[str, Any], base: dict[str, tuple[Path, tuple[int, ...]]], cfg: LoraConfig
) -> dict[str, Any]:
    """A LoRA checkpoint's consolidated tensors (the adapters; the base is not in it) as the merged model's,
    by the base's names: ``W + (alpha / rank)·B A`` for each adapted weight (in float32, from the adapters'
    fp32 master weights), the base's other tensors as they are. ``base``: each of the base model's tensors'
    safetensors file and shape (``export.base_tensor_files``). A ``ValueError`` names adapters whose base tensor
    the base model lacks."""
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    merged: dict[str, Any] = {}
    for name, value in state.items():
        m = _ADAPTER_NAME.fullmatch(name)
        if m is None:
            merged[name] = value  # a trained weight of the model itself
            continue
        pairs.setdefault((m["owner"], m["adapter"]), {})[m["kind"]] = value
    deltas: dict[str, list[tuple[bool, Any, Any]]] = {}
    for (owner, _), kinds in pairs.items():
        embedding = "embedding_A" in kinds
        a, b = (
            (kinds.get("embedding_A"), kinds.get("embedding_B"))
            if embedding
            else (kinds.get("A"), kinds.get("B"))
        )
        if a is None or b is None:
            raise ValueError(f"the checkpoint holds one matrix of {owner}'s adapter, not both A and B")
        deltas.setdefault(f"{owner}.weight", []).append((embedding, a, b))
    unknown = sorted(n for n in deltas if n not in base)
    if unknown:
        raise ValueError(f"the checkpoint adapts tensors the base model does not have: {', '.join(unknown)}")
    for name, (path, shape) in base.items():
        if name in merged:
            continue
        merged[name] = _MergedTensor(path, name, shape, deltas.get(name, []), cfg.scaling)
    return merged
