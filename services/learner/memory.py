"""The learner's memory: a start-up estimate of a step's peak per rank, and the choice of the step's mode.

    peak per rank = model states (ZeRO-3 partitions: weights, fp32 master, AdamW moments, fp32 gradients;
                    with LoRA those of the adapters, and the frozen base's weights alone)
                  + ZeRO-3 working buffers (gathered weights, reduce bucket; sizes from deepspeed_config)
                  + the step's tensors, found by running the step's own code on fake tensors
                    (torch's FakeTensorMode: shapes and dtypes, no memory, no arithmetic) at the configured
                    micro-batch and length, with a tracker that counts every live storage's bytes

The step is simulated on a copy of the model's config with one and with two transformer layers and
extrapolated to the real depth (every layer holds the same tensors), so a 7B estimate takes seconds on a CPU.
The simulation runs the very functions a step runs (the norm passes, chunked log-probs, activation
checkpointing), so it follows the code rather than a hand-kept formula. It cannot see the CUDA caching
allocator's fragmentation or kernels' private workspaces: :data:`HEADROOM` is kept free for those.

``memory_mode = "auto"``: the saved path when its estimate for the step fits, else recompute. The saved
path's memory grows with the step's micro-batches, so it is estimated per step from two coefficients fitted
at start-up (bytes per token and per token², the Gram matrices of the norm pass).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from services.learner.config import LearnerConfig, LoraConfig

GiB = 2**30
HEADROOM = 0.10  # of the device memory, kept free for the allocator's fragmentation and kernel workspaces
CUDA_CONTEXT = 1 * GiB  # the CUDA context and NCCL's buffers, outside torch's allocator

# ZeRO-3's working buffers, in elements; set in deepspeed_config so the estimate and the engine agree
ZERO3_REDUCE_BUCKET = 50_000_000  # gradients gathered for one reduce-scatter (fp32 communication)
ZERO3_PREFETCH_BUCKET = 50_000_000  # weights fetched ahead of the module that needs them
ZERO3_MAX_LIVE_PARAMETERS = 300_000_000  # gathered weights kept at once (beyond the module in use)
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # weights this small stay gathered on every rank


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage created under it while the storage is alive; keeps the peak.

    Tensors that existed before (the model's weights) are not counted; a gradient a hook drops is counted
    while it lives. Works on real and on fake tensors alike.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an output that shares an input's storage (a view, an in-place op) allocated nothing
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        if storage in self._seen or id(storage) in inputs:
            return
        n = storage.nbytes()
        self._seen[storage] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.current -= n


@contextmanager
def _without_zero3() -> Iterator[None]:
    """Build whole models even while a ZeRO-3 engine's ``HfDeepSpeedConfig`` is alive in the process (it
    makes ``from_config`` partition the weights as they are created)."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover - transformers without the integration
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model's config."""

    num_params: int  # every weight, a LoRA model's frozen base and adapters together
    largest_param: int  # elements of the largest single weight (ZeRO-3 gathers it whole)
    trainable_params: int = -1  # what the optimizer holds (LoRA: the adapters); -1: every weight

    @property
    def trained(self) -> int:
        return self.num_params if self.trainable_params < 0 else self.trainable_params


def model_shape(hf_config: Any, lora: LoraConfig | None = None) -> ModelShape:
    """Parameter counts of a Hugging Face causal-LM config (with ``lora``'s adapters when it is enabled),
    from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    from services.learner.lora import apply_lora

    with torch.device("meta"), _without_zero3():
        model = AutoModelForCausalLM.from_config(hf_config)
        if lora is not None and lora.enabled:
            apply_lora(model, lora)
    params = {id(p): p for p in model.parameters()}  # tied weights once
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    return ModelShape(
        sum(p.numel() for p in params.values()), max(p.numel() for p in params.values()), trainable
    )


def weight_bytes(precision: str) -> int:
    """Bytes per weight in the model's working precision (what ZeRO-3 gathers and a version carries)."""
    return 2 if precision == "bf16" else 4


def model_state_bytes(shape: ModelShape, precision: str, world_size: int) -> dict[str, int]:
    """Per-rank bytes of ZeRO-3's partitions and working buffers (see deepspeed_config in trainer.py)."""
    weight = weight_bytes(precision)
    # a trained weight, bf16: the bf16 partition, its fp32 master, AdamW's two fp32 moments, the fp32
    # gradient partition; fp32: the weights are the master. A frozen one (a LoRA run's base): its partition
    per_param = (2 + 4 + 8 + 4) if precision == "bf16" else (4 + 8 + 4)
    frozen = shape.num_params - shape.trained
    partitions = math.ceil(shape.trained / world_size) * per_param + math.ceil(frozen / world_size) * weight
    gathered = (max(shape.largest_param, ZERO3_MAX_LIVE_PARAMETERS) + ZERO3_PREFETCH_BUCKET) * weight
    gathered = min(gathered, shape.num_params * weight)
    reduce_bucket = min(ZERO3_REDUCE_BUCKET, shape.trained) * 4 * 2  # the bucket and its reduced copy
    return {"partitions": partitions, "gathered_weights": gathered, "reduce_bucket": reduce_bucket}


@dataclass(frozen=True)
class StepMemory:
    """The step's own tensors for one micro-batch shape (bytes)."""

    peak: int  # the highest count while the micro-batch's passes run
    retained: int  # what the saved path keeps per micro-batch until the step's backward (0: recompute)


def drop_gradients_as_zero3(model: nn.Module) -> None:
    """Free each parameter's gradient as soon as it is formed, as ZeRO-3's reduce-scatter does."""
    for p in model.parameters():
        if p.requires_grad:  # a frozen weight (a LoRA run's base) never has one
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))


def _fake_model(
    hf_config: Any, layers: int, dtype: torch.dtype, checkpointing: bool, lora: LoraConfig | None = None
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from services.learner.lora import apply_lora

    values = {**hf_config.to_dict(), "num_hidden_layers": layers}
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = values["layer_types"][:layers]
    cfg = type(hf_config).from_dict(values)
    with _without_zero3():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    if lora is not None and lora.enabled:
        # peft moves new adapters to their base layer's device and dtype, which a fake tensor cannot take
        # (torch swaps a tensor subclass's storage, and a fake tensor is weakly referenced): the adapters are
        # real tensors (a layer or two's, small), which the fake mode takes as inputs like any constant
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            apply_lora(model, lora)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    drop_gradients_as_zero3(model)
    return model


def _batch(rows: int, tokens: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    ids = torch.zeros(rows, tokens, dtype=torch.long) + (vocab - 1)
    attention = torch.ones(rows, tokens, dtype=torch.long)
    response = torch.ones(rows, tokens, dtype=torch.long)
    response[:, 0] = 0
    return ids, attention, response


def run_micro_batch(
    model: nn.Module,
    mode: str,
    ids: Tensor,
    attention: Tensor,
    response: Tensor,
    chunks: int,
    tracker: LiveBytes,
) -> int:
    """One micro-batch of a step in ``mode`` ("saved", "recompute", "grpo"), its gradient handed to the
    parameters; returns the bytes the saved path keeps until the step's backward (0 for the others)."""
    from services.learner.grad_norms import accumulate_weighted_gradients, norm_pass, streaming_norm_pass
    from services.learner.logprobs import token_logprobs

    coefficients = torch.ones(ids.shape[0], dtype=torch.float64, device=ids.device)
    if mode == "saved":
        result = norm_pass(model, ids, attention, response)
        retained = tracker.current
        accumulate_weighted_gradients([result], [coefficients])
        result.release()
        return retained
    if mode == "recompute":
        streaming_norm_pass(model, ids, attention, response, chunks)
    elif mode != "grpo":
        raise ValueError(f"mode must be saved, recompute or grpo, got {mode!r}")
    logp = token_logprobs(model, ids, attention, chunks)
    terms = torch.where(response.bool(), logp, torch.zeros_like(logp)).sum(1)
    (coefficients.to(terms.dtype) * terms).sum().backward()
    return 0


def simulate_micro_batch(
    hf_config: Any,
    *,
    layers: int,
    mode: str,
    rows: int,
    tokens: int,
    dtype: torch.dtype,
    checkpointing: bool,
    logit_chunk_tokens: int,
    device_type: str = "cpu",
    lora: LoraConfig | None = None,
) -> StepMemory:
    """Peak bytes of one micro-batch of the step in ``mode`` on fake tensors (:func:`run_micro_batch`), as
    it runs on a ``device_type`` device (on CUDA the norm pass forms float32 products from bf16 parts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from services.learner.logprobs import chunk_count
    from services.learner.mm32 import products

    with FakeTensorMode(allow_non_fake_inputs=True), products("split" if device_type == "cuda" else "plain"):
        model = _fake_model(hf_config, layers, dtype, checkpointing, lora)
        ids, attention, response = _batch(rows, tokens, int(hf_config.vocab_size))
        tracker = LiveBytes()
        with tracker:
            retained = run_micro_batch(
                model, mode, ids, attention, response, chunk_count(tokens, logit_chunk_tokens), tracker
            )
    return StepMemory(tracker.peak, retained)


def step_memory(
    hf_config: Any,
    *,
    mode: str,
    rows: int,
    tokens: int,
    dtype: torch.dtype,
    checkpointing: bool,
    logit_chunk_tokens: int,
    device_type: str = "cpu",
    lora: LoraConfig | None = None,
) -> StepMemory:
    """:func:`simulate_micro_batch` at the model's real depth, from one- and two-layer simulations."""
    one, two = (
        simulate_micro_batch(
            hf_config,
            layers=n,
            mode=mode,
            rows=rows,
            tokens=tokens,
            dtype=dtype,
            checkpointing=checkpointing,
            logit_chunk_tokens=logit_chunk_tokens,
            device_type=device_type,
            lora=lora,
        )
        for n in (1, 2)
    )
    extra = int(hf_config.num_hidden_layers) - 1
    return StepMemory(
        one.peak + extra * (two.peak - one.peak), one.retained + extra * (two.retained - one.retained)
    )


@dataclass
class MemoryPlan:
    """The learner's memory at start-up: what a step needs in each mode against what a rank has."""

    budget: int  # bytes one rank may use
    states: dict[str, int]  # model_state_bytes
    recompute: StepMemory  # one micro-batch of micro_batch_size rows of max_sequence_tokens
    saved: StepMemory
    # the saved path's bytes kept per row and micro-batch as a·T + b·T² (fitted at two lengths)
    saved_per_token: float
    saved_per_token_sq: float
    configured_mode: str
    overhead: int = 0

    @property
    def fixed(self) -> int:
        return sum(self.states.values()) + self.overhead

    @property
    def usable(self) -> int:
        return int(self.budget * (1 - HEADROOM))

    def peak(self, mode: str) -> int:
        """The estimated peak per rank of a step of one micro-batch at the configured worst case."""
        return self.fixed + (self.recompute if mode == "recompute" else self.saved).peak

    def saved_step_peak(self, micro_batches: list[tuple[int, int]]) -> int:
        """The saved path's estimated peak for a step of ``(rows, padded tokens)`` micro-batches."""
        kept = [r * (self.saved_per_token * t + self.saved_per_token_sq * t * t) for r, t in micro_batches]
        transient = max(self.saved.peak - self.saved.retained, 0)
        return int(self.fixed + sum(kept) + transient)

    def mode_for(self, micro_batches: list[tuple[int, int]]) -> str:
        """The mode of a step: the configured one, or under ``auto`` saved when it fits, else recompute."""
        if self.configured_mode != "auto":
            return self.configured_mode
        return "saved" if self.saved_step_peak(micro_batches) <= self.usable else "recompute"

    def summary(self) -> str:
        gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        broadcast = self.states.get("weight_broadcast", 0)
        return (
            f"model states {gib(self.fixed)}"
            + (f" (with {gib(broadcast)} of weight broadcast buffers)" if broadcast else "")
            + f", one micro-batch: recompute {gib(self.recompute.peak)}, saved "
            f"{gib(self.saved.peak)} (+{gib(self.saved.retained)} per further micro-batch); device budget "
            f"{gib(self.budget)} ({int(HEADROOM * 100)}% kept free)"
        )


def device_budget(learner: LearnerConfig, device: torch.device) -> int:
    """Bytes one rank may use: ``learner.device_memory_gb``, else the GPU's total (its share of it, where the
    rank has a fraction of a GPU, ``learner.gpus_per_rank`` < 1: the samplers that share it use the rest),
    else the machine's (or its container's limit)."""
    if learner.device_memory_gb > 0:
        return int(learner.device_memory_gb * GiB)
    if device.type == "cuda":
        share = learner.gpus_per_rank if 0 < learner.gpus_per_rank < 1 else 1.0
        return int(torch.cuda.get_device_properties(device).total_memory * share)
    import os
    from pathlib import Path

    total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = Path("/sys/fs/cgroup/memory.max")  # a container's limit (cgroup v2), when it has one
    text = limit.read_text().strip() if limit.is_file() else "max"
    return min(total, int(text)) if text.isdigit() else total


def version_params(shape: ModelShape, lora: LoraConfig | None = None) -> int:
    """Weights in a published version: every weight; with ``lora`` enabled the adapters alone
    (``publish = "adapter"``) or the base's weights with the adapters merged in (``"merged"``)."""
    if lora is None or not lora.enabled:
        return shape.num_params
    return shape.trained if lora.adapter_versions else shape.num_params - shape.trained


def broadcast_buffer_bytes(
    shape: ModelShape, precision: str, bucket_bytes: int, lora: LoraConfig | None = None
) -> int:
    """Rank 0's GPU memory for a background broadcast into the weight group (the collective transport under
    NCCL), which overlaps the next step: two buffers of at most a bucket, which every piece of the version
    goes through from the host staging buffer, a weight larger than a bucket too (weight_broker/buckets.py);
    no more than the version holds (:func:`version_params`)."""
    return 2 * min(bucket_bytes, version_params(shape, lora) * weight_bytes(precision))


def plan_memory(
    hf_config: Any,
    learner: LearnerConfig,
    precision: str,
    world_size: int,
    budget: int,
    overhead: int = 0,
    broadcast_bucket_bytes: int = 0,
    device_type: str = "cpu",
) -> MemoryPlan:
    """Estimate the configured step's memory; raise ``ValueError`` naming the keys to change when even the
    least memory-hungry allowed mode cannot fit ``budget``. ``overhead``: bytes outside torch's tensors
    (:data:`CUDA_CONTEXT` on a GPU). ``broadcast_bucket_bytes``: the weight group's bucket when rank 0
    broadcasts on this device while stepping (:func:`broadcast_buffer_bytes`; 0: it does not). ``device_type``:
    the step's device ("cuda" or "cpu"), whose code paths the simulation follows."""
    if learner.max_sequence_tokens < 2:
        raise ValueError(
            f"learner.max_sequence_tokens = {learner.max_sequence_tokens}: the learner's memory is sized for "
            "the longest trajectory; set it (or sampler.max_model_len in the run file)"
        )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    common = dict(
        dtype=dtype,
        checkpointing=learner.activation_checkpointing,
        logit_chunk_tokens=learner.logit_chunk_tokens,
        device_type=device_type,
        lora=learner.lora,
    )
    rows, tokens = learner.micro_batch_size, learner.max_sequence_tokens
    recompute = step_memory(hf_config, mode="recompute", rows=rows, tokens=tokens, **common)
    saved = step_memory(hf_config, mode="saved", rows=rows, tokens=tokens, **common)
    half = step_memory(hf_config, mode="saved", rows=1, tokens=max(tokens // 2, 2), **common)
    # retained(T) per row = a·T + b·T², from T (rows rows) and T/2 (one row)
    t1, r1 = tokens, saved.retained / rows
    t2, r2 = max(tokens // 2, 2), half.retained
    b = (r1 / t1 - r2 / t2) / (t1 - t2) if t1 != t2 else 0.0
    a = r1 / t1 - b * t1
    shape = model_shape(hf_config, learner.lora)
    states = model_state_bytes(shape, precision, world_size)
    if broadcast_bucket_bytes > 0:
        states["weight_broadcast"] = broadcast_buffer_bytes(
            shape, precision, broadcast_bucket_bytes, learner.lora
        )
    plan = MemoryPlan(
        budget=budget,
        states=states,
        recompute=recompute,
        saved=saved,
        saved_per_token=max(a, 0.0),
        saved_per_token_sq=max(b, 0.0),
        configured_mode=learner.memory_mode,
        overhead=overhead,
    )
    least = "saved" if learner.memory_mode == "saved" else "recompute"
    if plan.peak(least) > plan.usable:
        keys = [
            f"learner.micro_batch_size ({learner.micro_batch_size})",
            f"learner.max_sequence_tokens / sampler.max_model_len ({learner.max_sequence_tokens})",
        ]
        if not learner.activation_checkpointing:
            keys.append("learner.activation_checkpointing (false)")
        if learner.memory_mode == "saved":
            keys.append("learner.memory_mode (saved: try auto or recompute)")
        if learner.logit_chunk_tokens == 0 or learner.logit_chunk_tokens > 1024:
            keys.append(f"learner.logit_chunk_tokens ({learner.logit_chunk_tokens})")
        keys.append(f"learner.num_ranks ({world_size}: more ranks hold smaller partitions)")
        raise ValueError(
            f"the learner step cannot fit one rank's memory: estimated peak {plan.peak(least) / GiB:.1f} GiB "
            f"in {least} mode against {plan.usable / GiB:.1f} GiB usable ({plan.summary()}); lower or change "
            + ", ".join(keys)
            + "; or set learner.device_memory_gb if the device has more than detected"
        )
    return plan
