"""One learner rank: a DeepSpeed ZeRO-3 engine that turns a step's trajectories into the next policy version.

    every rank r of N, each step:
      its whole groups as TrajectoryTensors
        ├─ step.backward(StepInputs(..., backward=engine.backward, collectives=DistCollectives))
        │     same micro-batch count on every rank · global ρ · loss rescaled to the global normaliser
        ├─ lr ← η₀ · s(ρ) for this step only; engine.step(): clip at grad_clip, AdamW, ZeRO-3 partitions
        └─ metrics gathered from every rank and merged (identical on all ranks)
      publish_version(...) after the step (publish.py), checkpoints (save/load) as collectives

The process group is initialised from the usual environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), set by ``services.learner.supervisor`` (plain processes) or the Ray actor group.
The model comes through ``AutoModelForCausalLM.from_pretrained`` (a hub id or a local directory); with
ZeRO-3 it is partitioned while it loads (``HfDeepSpeedConfig``), so no rank ever holds a full copy.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from services.learner import checkpoints, objectives
from services.learner.config import LearnerConfig
from services.learner.ess import distributed_effective_sample_size, lr_scale
from services.learner.lora import apply_lora, register_with_zero3, trainable_parameters
from services.learner.lr_schedule import lr_factor
from services.learner.memory import (
    CUDA_CONTEXT,
    ZERO3_MAX_LIVE_PARAMETERS,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET,
    ZERO3_REDUCE_BUCKET,
    MemoryPlan,
    device_budget,
    plan_memory,
)
from services.learner.step import MemoryOptions, StepInputs, TrajectoryTensors, backward, plan_step
from services.learner.vcpo import METRIC_KEYS, objective_config

log = logging.getLogger(__name__)

# merged over ranks by summing; the rest of METRIC_KEYS are recomputed or averaged (see merge_metrics)
SUMMED = (
    "baseline_fallbacks",
    "skipped_empty",
    "skipped_nonfinite",
    "singleton_groups",
    "num_trajectories",
    "num_valid",
    "num_tokens",
)


def resolve_backend(learner: LearnerConfig) -> str:
    if learner.backend != "auto":
        return learner.backend
    return "nccl" if torch.cuda.is_available() and learner.gpus_per_rank > 0 else "gloo"


def resolve_precision(learner: LearnerConfig) -> str:
    if learner.precision != "auto":
        return learner.precision
    return "bf16" if torch.cuda.is_available() and learner.gpus_per_rank > 0 else "fp32"


def deepspeed_config(learner: LearnerConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of the learner: ZeRO-3, AdamW, clipping, bf16 on GPU, fp32 on CPU."""
    bf16 = resolve_precision(learner) == "bf16"
    return {
        "train_micro_batch_size_per_gpu": learner.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": learner.micro_batch_size * world_size,
        "gradient_clipping": learner.grad_clip,
        # AdamW is torch's (passed to deepspeed.initialize): its update does not depend on where a tensor
        # sits in memory, so a run resumed from a checkpoint is bit-exact on CPU; DeepSpeed's CPU FusedAdam
        # differed by an ulp after a reload
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_16bit_weights_on_model_save": False,
            # ZeRO-3's replacement of F.linear is an autograd Function that always forms the weight
            # gradient, even in the norm pass's backward to layer outputs, where it is thrown away (it
            # made that pass as costly as a full backward); torch's linear skips what is not needed
            "memory_efficient_linear": False,
            # the working buffers the memory estimate (memory.py) counts
            "reduce_bucket_size": ZERO3_REDUCE_BUCKET,
            "stage3_prefetch_bucket_size": ZERO3_PREFETCH_BUCKET,
            "stage3_max_live_parameters": ZERO3_MAX_LIVE_PARAMETERS,
            "stage3_param_persistence_threshold": ZERO3_PERSISTENCE_THRESHOLD,
        },
        "bf16": {"enabled": bf16},
        # bf16 weights, float32 gradients once they leave the backward: ZeRO-3 otherwise reduce-scatters and
        # sums micro-batch gradient partitions in the model's dtype (bf16 rounds every addition)
        **({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"} if bf16 else {}),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DistCollectives:
    """:class:`services.learner.step.StepCollectives` over the default process group."""

    def __init__(self, world_size: int, device: torch.device | str = "cpu") -> None:
        self.world_size = world_size
        self.device = torch.device(device)  # NCCL communicates CUDA tensors only
        self.ess = math.nan  # the global ESS of the last step, set by ess_ratio
        self.log_weights: list[float] = []  # this rank's valid log weights of the last step

    def num_micro_batches(self, local: int) -> int:
        t = torch.tensor([local], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def max_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def ess_ratio(self, log_weights: Tensor) -> float:
        self.log_weights = [float(w) for w in log_weights.detach().cpu().tolist()]
        self.ess, rho = distributed_effective_sample_size(log_weights)
        return rho

    def loss_scale(self, metrics: dict[str, float], aggregation: str) -> float:
        local = metrics["num_tokens"] if aggregation == "token-mean" else metrics["num_valid"]
        # a rank with nothing valid skips locally and harmlessly; one that skipped with valid trajectories
        # (an overflowing coefficient) skips the whole step, so no rank's gradient is dropped unseen
        overflow = float(metrics["step_skipped"] > 0 and metrics["num_valid"] > 0)
        t = torch.tensor([local, overflow], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        total, overflows = float(t[0]), float(t[1])
        if overflows > 0 or total == 0:
            metrics["step_skipped"] = 1.0
            return 0.0
        return self.world_size * local / total


def merge_metrics(
    per_rank: list[tuple[dict[str, float], list[float]]], ess: float, rho: float, config: LearnerConfig
) -> dict[str, float]:
    """The step's metrics over all ranks from each rank's ``(metrics, valid log weights)``.

    Counts and the (rescaled) loss add up; ρ, ESS and the LR scale are the global ones; log-weight
    statistics are recomputed from every rank's weights; per-trajectory means are weighted by valid counts.
    The objective's own metrics follow its declaration: ``summed_metrics`` add up, ``metrics`` are means.
    """
    ms = [m for m, _ in per_rank]
    spec = objectives.get(config.objective)
    out: dict[str, float] = dict.fromkeys((*METRIC_KEYS, *spec.metrics, *spec.summed_metrics), 0.0)
    for key in (*SUMMED, *spec.summed_metrics):
        out[key] = sum(m[key] for m in ms)
    out["loss"] = sum(m["loss"] for m in ms) / len(ms)  # each rank's loss carries the world size factor
    skipped = any(m["step_skipped"] for m in ms) or not math.isfinite(rho)
    out.update(ess=ess, ess_ratio=rho, step_skipped=float(skipped))
    out["lr_scale"] = 0.0 if skipped else lr_scale(rho, config.rho_base, config.ess_rule)
    lw = torch.tensor([w for _, ws in per_rank for w in ws], dtype=torch.float64)
    if lw.numel():
        q = torch.quantile(lw, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        out.update(log_weight_max=float(lw.max()), log_weight_min=float(lw.min()))
        out.update(log_weight_p50=q[0], log_weight_p90=q[1], log_weight_p99=q[2])
        out["frac_truncated"] = float((lw > math.log(config.truncation)).double().mean())
    else:
        for key in ("log_weight_max", "log_weight_min", "log_weight_p50", "log_weight_p90", "log_weight_p99"):
            out[key] = math.nan
    valid = out["num_valid"]
    for key in ("baseline_shift_mean_abs", "advantage_abs_mean", *spec.metrics):
        # a rank without valid trajectories weighs 0 (its rule did not run: its figure is a placeholder)
        out[key] = sum(m[key] * m["num_valid"] for m in ms if m["num_valid"]) / valid if valid else 0.0
    tokens = out["num_tokens"]
    out["ppo_clip_fraction"] = (
        sum(m["ppo_clip_fraction"] * m["num_tokens"] for m in ms) / tokens if tokens else 0.0
    )
    return out


def init_distributed(backend: str, timeout_s: float) -> None:
    """DeepSpeed's process group over ``backend``. Under gloo, DeepSpeed's shared-memory all-reduce op is
    switched off first: only its inference all-reduce uses it (ZeRO-3 training never does), and on a machine's
    first run it JIT-compiles C++ for a minute or more, in every test session and every fresh container."""
    import deepspeed

    if backend == "gloo":
        # DeepSpeed probes its ops once per process into this dict and keeps it, so the edit holds
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))


@dataclass
class StepResult:
    """What one optimizer step did: the version it produced, its metrics and its phase times."""

    version: int
    step: int
    metrics: dict[str, float]
    timings: dict[str, float] = field(default_factory=dict)


class Trainer:
    """One rank of the learner. Every method that touches the model is a collective across all ranks."""

    # every micro-batch at the batch's full width, rows unsorted (step.plan_step): benchmarks' baseline only
    full_width = False

    def __init__(
        self,
        learner: LearnerConfig,
        model: str,
        seed: int = 0,
        broadcast_bucket_bytes: int = 0,
    ) -> None:
        """``broadcast_bucket_bytes``: the weight group's bucket when rank 0 broadcasts versions in the
        background (the collective transport); on a GPU its buffers overlap the next step, and the memory
        plan counts them (0: versions go through the broker)."""
        import deepspeed
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        self.config = learner
        self.model_source = model  # the base a LoRA checkpoint's adapters belong to
        self.objective = objective_config(learner)
        self.backend = resolve_backend(learner)
        self.precision = resolve_precision(learner)
        if self.backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # a hung collective (a rank stuck or gone) raises after the timeout, instead of holding the group forever
        init_distributed(self.backend, learner.collective_timeout_s)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        torch.manual_seed(seed)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.memory_plan: MemoryPlan | None = None
        if learner.max_sequence_tokens > 0:  # refuse a step that cannot fit before loading anything
            self.memory_plan = plan_memory(
                AutoConfig.from_pretrained(model),
                learner,
                self.precision,
                self.world_size,
                device_budget(learner, device),
                CUDA_CONTEXT if device.type == "cuda" else 0,
                broadcast_bucket_bytes if device.type == "cuda" else 0,
                device.type,
            )
            if self.rank == 0:
                log.info("learner memory: %s", self.memory_plan.summary())
        elif learner.memory_mode == "auto":
            log.warning("learner.max_sequence_tokens is 0: no memory estimate; auto runs the saved path")
        ds_config = deepspeed_config(learner, self.world_size)
        self._hf_ds_config = HfDeepSpeedConfig(
            ds_config
        )  # must stay alive: from_pretrained loads partitioned
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        module = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
        if learner.lora.enabled:  # adapters in place of the targeted modules, the base frozen (lora.py)
            apply_lora(module, learner.lora)
        module.train()
        if learner.activation_checkpointing:
            # non-reentrant: the norm pass's taps save their inputs like any activation (grad_norms.py)
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(
            trainable_parameters(module),
            lr=learner.lr,
            betas=learner.betas,
            eps=1e-8,
            weight_decay=learner.weight_decay,
            foreach=False,
        )
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
        if learner.lora.enabled:
            register_with_zero3(module)
        self.device = self.engine.device
        self.collectives = DistCollectives(self.world_size, self.device)
        self.version = 0  # the policy version the current weights are
        self.step = 0  # optimizer steps taken

    @property
    def module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.engine.module
        return module

    def train_step(self, batch: TrajectoryTensors) -> StepResult:
        """One optimizer step on this rank's share of the step's groups; advances the version by one."""
        t0 = time.perf_counter()
        batch = _to(batch, self.device)
        memory = MemoryOptions(self._memory_mode(batch), self.config.logit_chunk_tokens)
        metrics = backward(
            StepInputs(
                self.module,
                batch,
                self.objective,
                self.config.micro_batch_size,
                backward=self._backward,
                collectives=self.collectives,
                memory=memory,
                full_width=self.full_width,
            )
        )
        t1 = time.perf_counter()
        tokens = float(batch.attention_mask.sum())
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, (metrics, self.collectives.log_weights, tokens))
        per_rank = [(m, lw) for m, lw, _ in gathered]
        merged = merge_metrics(per_rank, self.collectives.ess, metrics["ess_ratio"], self.config)
        base_lr = self.config.lr * lr_factor(
            self.step, self.config.lr_decay, self.config.lr_decay_steps, self.config.lr_min_ratio
        )
        if merged["step_skipped"]:
            self._skip_optimizer_step()
            merged["grad_norm"] = 0.0  # nothing was applied (the skipped step's loss is 0·Σ log π)
        else:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = base_lr * merged["lr_scale"]
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            merged["grad_norm"] = math.nan if norm is None else float(norm)
        merged["lr"] = base_lr * merged["lr_scale"]
        merged["recompute"] = float(memory.mode == "recompute")
        t2 = time.perf_counter()
        self.step += 1
        self.version += 1
        timings = {
            "gradient_s": t1 - t0,
            "optimizer_s": t2 - t1,
            "step_s": t2 - t0,
            "tokens": tokens,
            "tokens_all_ranks": sum(t for *_, t in gathered),
        }
        return StepResult(self.version, self.step, merged, timings)

    def _skip_optimizer_step(self) -> None:
        """End a skipped step (ρ not finite, nothing valid, an overflowing coefficient) without touching the
        optimizer: no AdamW step, so its step count and moments stay as they were (a step at learning rate 0
        would advance the one and decay the others). The step's gradients are dropped as DeepSpeed drops an
        overflowed step's, and its engine counts the step as skipped; the next backward starts afresh."""
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "_overflow_clean_up"):  # ZeRO-3: what its step() does after an overflow
            optimizer._pre_step()  # the micro-step count (the next backward copies, not adds)
            optimizer._partition_all_parameters()
            optimizer._overflow_clean_up(optimizer.loss_scale)  # the gradients and their partitions
        else:
            optimizer.zero_grad(set_to_none=True)
        self.engine.skipped_steps += 1
        self.engine.global_steps += 1
        self.engine.micro_steps += 1

    def _memory_mode(self, batch: TrajectoryTensors) -> Literal["saved", "recompute"]:
        """This step's memory mode, the same on every rank (the modes run different numbers of forwards)."""
        if self.config.memory_mode == "recompute":
            return "recompute"
        if self.config.memory_mode == "saved":
            return "saved"
        if self.memory_plan is None:
            return "saved"
        # this rank's micro-batches as the step runs them, each at its own rows' width
        shapes = plan_step(batch, self.config.micro_batch_size, full_width=self.full_width).shapes()
        local = self.memory_plan.mode_for(shapes)
        flag = torch.tensor([float(local == "recompute")], device=self.collectives.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return "recompute" if float(flag) > 0 else "saved"

    def _backward(self, loss: Tensor) -> None:
        # engine.forward would mark the start of a micro-step (ZeRO-3 then adds, not copies, the next
        # backward's gradient partitions); the step calls the module directly, so mark it here
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()
        self.engine.backward(loss)

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any], keep: int) -> Path:
        """Write a DeepSpeed checkpoint (weights, optimizer, ``client_state``) tagged by step; keep ``keep``.
        ``latest`` names it only once every rank's shards are on disk (services/learner/checkpoints.py)."""
        state = dict(client_state, version=self.version, step=self.step)
        if self.config.lora.enabled:  # what an export needs to merge the adapters into their base
            state["lora"] = dict(self.config.lora.model_dump(), base_model=self.model_source)
        return checkpoints.save(self.engine, directory, self.step, state, self.rank, keep)

    def load_checkpoint(self, directory: Path) -> dict[str, Any] | None:
        """Resume from the last complete checkpoint in ``directory`` (``checkpoints.resolve``); its client
        state, or None when there is none. Every rank must find the same (``checkpoints.agree``)."""
        found = checkpoints.resolve(directory)
        checkpoints.agree(found, directory, self.rank, self.world_size, self.device)
        if found.tag is None:
            return None
        path, state = self.engine.load_checkpoint(
            str(directory), tag=found.tag, load_module_strict=not checkpoints.has_frozen_weights(self.module)
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {directory / found.tag}")
        self.version, self.step = int(state["version"]), int(state["step"])
        return dict(state)


def _to(batch: TrajectoryTensors, device: torch.device) -> TrajectoryTensors:
    if device.type == "cpu":
        return batch
    return TrajectoryTensors(*(getattr(batch, f).to(device) for f in TrajectoryTensors.__dataclass_fields__))
