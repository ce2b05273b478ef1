"""``[learner.lora]``: LoRA adapters on a frozen base, and what a version of them is to every service.

The learner trains the adapters (``services/learner/lora.py``); the samplers serve them. With
``publish = "adapter"`` (the default) a policy version is the adapters' tensors alone, in peft's saved names
(``base_model.model.<module>.lora_A.weight``), which vLLM loads as a LoRA adapter: megabytes per version where
the model is gigabytes. With ``publish = "merged"`` a version is the whole model with the adapters merged in,
under the base's names, which any sampler loads as a full version.

Both sides derive the adapter's tensor names and shapes from the base model's config and this table
(:func:`adapter_shapes`), so the sampler checks each version against what the learner publishes without
either reading the other's code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config import Section

# peft's usual LoRA targets on Qwen2/Llama-style decoders: every attention and MLP projection
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD_AND_EMBEDDING = ("lm_head", "embed_tokens")
# the ranks vLLM 0.32 can be started with (its LoRAConfig.max_lora_rank)
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Section):
    """LoRA adapters (peft) trained in place of the full weights: ``W x + (alpha / rank)·B A x`` on each
    targeted module, the base frozen. ``rank = 0`` trains every weight."""

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 = full fine-tuning (no adapters).")
    alpha: int = Field(
        0, ge=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank; 0 = 2 · rank."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on each adapter's input (peft's lora_dropout); a second pass over a micro-batch "
        "replays the first one's masks, so VCPO's norms stay those of the gradient taken.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(PROJECTIONS),
        min_length=1,
        description="Modules that get adapters, by name or name suffix as peft matches them (e.g. q_proj, "
        "model.layers.0.mlp.down_proj); lm_head and embed_tokens only with publish = merged. A name that "
        "matches no module is an error.",
    )
    publish: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What a policy version is: adapter = the adapters' tensors alone (megabytes; the samplers "
        "run vLLM with LoRA and load each version as an adapter; projections only), merged = the whole model "
        "with the adapters merged in (any target; the samplers load full versions).",
    )

    @field_validator("target_modules")
    @classmethod
    def _plain_names(cls, v: list[str]) -> list[str]:
        bad = [name for name in v if not name or name != name.strip() or name.startswith(".")]
        if bad or len(set(v)) != len(v):
            raise ValueError(f"target_modules must be distinct module names or suffixes, got {v}")
        return v

    @model_validator(mode="after")
    def _servable(self) -> LoraConfig:
        if not (self.enabled and self.publish == "adapter"):
            return self
        head = [
            t for t in self.target_modules if any(matches(h, t) or matches(t, h) for h in HEAD_AND_EMBEDDING)
        ]
        if head:
            raise ValueError(
                f"target_modules {head} adapt the output head or input embedding, which vLLM serves no adapter "
                'on (it takes LoRA on linear projections only): leave them out, or set publish = "merged" '
                "(versions are then the whole merged model)"
            )
        if self.rank > VLLM_MAX_RANKS[-1]:
            raise ValueError(f"rank {self.rank} exceeds {VLLM_MAX_RANKS[-1]}, the largest rank vLLM serves")
        return self

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapter_versions(self) -> bool:
        """Whether a policy version is the adapters alone (which the samplers load as a vLLM LoRA adapter)."""
        return self.enabled and self.publish == "adapter"

    @property
    def lora_alpha(self) -> int:
        """alpha, its 0 read as 2 · rank."""
        return self.alpha or 2 * self.rank

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.rank

    @property
    def vllm_max_rank(self) -> int:
        """The smallest rank vLLM can be started with that holds this adapter (``max_lora_rank``)."""
        return next(r for r in VLLM_MAX_RANKS if r >= self.rank)


def check_adapter_transport(lora: LoraConfig, transport: str) -> None:
    """Adapter versions (megabytes) travel through the broker: a ValueError if ``weight_broker.transport`` is
    the collective, whose weight group broadcasts whole models into the samplers' workers. Every service
    that reads both tables checks it (the learner, the sampler, the launcher's whole run)."""
    if lora.adapter_versions and transport == "collective":
        raise ValueError(
            'learner.lora publishes adapter versions (publish = "adapter"), which the samplers load from the '
            'broker: set weight_broker.transport = "tcp" (the weight group is for full versions), or '
            'learner.lora.publish = "merged"'
        )


def matches(name: str, target: str) -> bool:
    """Whether a module named ``name`` is one that ``target`` names (peft's rule: the name or a suffix)."""
    return name == target or name.endswith("." + target)


def peft_config(cfg: LoraConfig) -> Any:
    """peft's ``LoraConfig`` for ``[learner.lora]``."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )


def adapter_config(cfg: LoraConfig) -> dict[str, Any]:
    """The ``adapter_config.json`` of a version: what vLLM (and peft) read beside the adapters' tensors."""
    return {
        "peft_type": "LORA",
        "r": cfg.rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "bias": "none",
    }


_PEFT_PARAMETER = re.compile(r"(?P<owner>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight")


def adapter_tensor_name(parameter: str) -> str | None:
    """A LoRA matrix's name in an adapter version (peft's saved form, which vLLM loads) from its parameter
    name in the model: ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` →
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; None for any other parameter."""
    m = _PEFT_PARAMETER.fullmatch(parameter)
    if m is None:
        return None
    return f"base_model.model.{m['owner']}.{m['kind']}.weight"


def adapter_shapes(model_dir: str | Path, cfg: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an adapter version of the model in ``model_dir`` and its shape, in the order the model
    holds them: the adapters injected into the model built on the meta device (no weights read)."""
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft.inject_adapter_in_model(peft_config(cfg), model)
    shapes = {}
    for name, p in model.named_parameters():
        tensor = adapter_tensor_name(name)
        if tensor is not None:
            shapes[tensor] = tuple(p.shape)
    return shapes
