"""Configuration of the learner service (the ``[learner]`` table of a run file)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PositiveFloat, field_validator, model_validator

from services.common.config import Section, ServiceConfig
from services.common.lora import PROJECTIONS as PROJECTIONS
from services.common.lora import LoraConfig as LoraConfig
from services.common.lora import check_adapter_transport
from services.learner.lr_schedule import LrDecay
from services.learner.objectives import NAMES as OBJECTIVES
from services.learner.objectives import get as objective_named
from services.learner.objectives import settings_of as objective_settings_of
from services.weight_transport import WeightBrokerConfig


class LearnerConfig(Section):
    """Distributed training, the optimizer and the objective (docs/research/vcpo.md) of the learner."""

    num_ranks: int = Field(1, ge=1, description="Data-parallel DeepSpeed ZeRO-3 ranks.")
    gpus_per_rank: float = Field(0, ge=0, description="GPUs per rank on a cluster; 0 on CPU.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl with GPUs, gloo without."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Training precision; auto = bf16 on GPU, fp32 on CPU."
    )
    micro_batch_size: int = Field(4, ge=1, description="Trajectories per forward/backward on each rank.")
    memory_mode: Literal["auto", "saved", "recompute"] = Field(
        "auto",
        description="VCPO step memory: saved keeps every micro-batch's activations until the step's "
        "coefficients are known (fastest); recompute keeps only norms and runs a second forward and backward per "
        "micro-batch (memory of one micro-batch); auto picks saved when the start-up estimate fits the device.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer layer's activations in the backward (both VCPO passes).",
    )
    logit_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Positions whose output-head logits and log-softmax exist at once (outside the saved "
        "norm pass); 0 = the whole sequence.",
    )
    max_sequence_tokens: int = Field(
        0,
        ge=0,
        description="Longest trajectory (prompt + response tokens) the learner's memory is sized for; "
        "0 = the run file's sampler.max_model_len.",
    )
    device_memory_gb: float = Field(
        0.0,
        ge=0,
        description="Memory one rank may use, in GiB; 0 = the GPU's total, times gpus_per_rank when that is a "
        "fraction (the samplers sharing the GPU use the rest); the machine's on CPU.",
    )
    lr: float = Field(1e-6, gt=0, description="Base learning rate η₀ (scaled per step by the ESS rule).")
    lr_decay: LrDecay = Field(
        "constant",
        description="How η₀ decays over learner.lr_decay_steps (services/learner/lr_schedule.py); the ESS "
        "rule scales the decayed rate.",
    )
    lr_decay_steps: int = Field(
        0, ge=0, description="Learner steps over which lr decays to lr_min_ratio · η₀ (then held there)."
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="The decayed rate's floor, a fraction of η₀.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    objective: str = Field(
        "vcpo",
        description="Advantage/baseline estimator of the policy-gradient loss: a module of "
        f"services/learner/objectives/ ({', '.join(OBJECTIVES)}).",
    )
    objective_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The objective's own settings, checked against the settings model its module declares "
        "(docs/research/adding-an-objective.md); an objective that declares none takes none.",
    )
    importance_weighting: Literal["truncated", "masked", "none"] = Field(
        "truncated", description="How the sequence importance weight enters the loss (TIS, MIS, none)."
    )
    truncation: float = Field(8.0, gt=0, description="Importance-weight cap C.")
    ess_rule: Literal["sqrt", "linear", "off"] = Field("sqrt", description="ESS learning-rate scale rule.")
    rho_base: float = Field(1.0, gt=0, le=1, description="ESS ratio at and above which the rate is unscaled.")
    baseline_weighting: Literal["paper", "exact", "released"] = Field(
        "paper", description="OPOB weighting W_i (docs/research/vcpo.md §3)."
    )
    loss_aggregation: Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"] = Field(
        "seq-mean-token-mean", description="How token terms aggregate into the loss."
    )
    std_normalize: bool = Field(True, description="Divide advantages by the group's reward std (vcpo, grpo).")
    ppo_clip: float = Field(0.0, ge=0, description="PPO ratio clip ε; 0 disables clipping.")
    max_group_size: int = Field(
        64, ge=1, description="Largest rollout group accepted; larger groups are rejected and counted."
    )
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints.")
    checkpoint_dir: str = Field(
        "", description="DeepSpeed checkpoints; empty = <run_dir>/learner/checkpoints."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest deleted first).")
    publish_bucket_mb: int = Field(
        256, ge=1, description="ZeRO-3 parameters gathered at once while publishing a version."
    )
    read_block_ms: int = Field(1000, ge=1, description="Longest wait on the scored stream per read.")
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest wait of one collective between the ranks (the process group's timeout): a rank "
        "that hangs past it fails the group, which the launcher restarts from its checkpoint.",
    )
    master_port: int = Field(
        0, ge=0, le=65535, description="torch.distributed rendezvous port; 0 = a free one."
    )
    grpc_port: int = Field(50054, ge=0, le=65535, description="Status and health gRPC port; 0 = a free port.")
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on a frozen base instead of full fine-tuning (docs/guides/lora.md).",
    )
    ray_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources added to every rank's placement-group bundle, e.g. "
        "{vcpo_learner = 1}: ranks run only on the nodes that offer them (the Helm chart's learner pods).",
    )

    @field_validator("objective")
    @classmethod
    def _registered_objective(cls, v: str) -> str:
        if v not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _objective_settings_fit(self) -> LearnerConfig:
        # an empty table needs no look at the module (every setting has a default): validating the usual
        # config imports no objective, and so no torch
        if self.objective_settings:
            objective_settings_of(self.objective, self.objective_settings)
        return self

    @model_validator(mode="after")
    def _decay_has_steps(self) -> LearnerConfig:
        if self.lr_decay != "constant" and self.lr_decay_steps < 1:
            raise ValueError(
                f"lr_decay = {self.lr_decay!r} needs lr_decay_steps >= 1, got {self.lr_decay_steps}"
            )
        return self

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> LearnerConfig:
        # Ray would place two ranks' fractions on one GPU, and NCCL refuses a group with two ranks on one
        # device ("Duplicate GPU detected") at DeepSpeed's first collective, after every pod was scheduled
        if self.num_ranks > 1 and 0 < self.gpus_per_rank < 1 and self.backend != "gloo":
            raise ValueError(
                f"learner.gpus_per_rank = {self.gpus_per_rank:g} with learner.num_ranks = {self.num_ranks}: "
                "ranks would share a GPU, which NCCL refuses; give each rank a whole GPU (gpus_per_rank >= 1) "
                "or run one rank"
            )
        return self

    @model_validator(mode="after")
    def _batch_baseline_on_one_rank(self) -> LearnerConfig:
        # an objective whose baseline is the step's batch (reinforce: the mean reward, and its zero-signal
        # rule) sees only its own rank's trajectories: each rank would subtract its own mean, silently
        if self.num_ranks > 1 and objective_named(self.objective).zero_signal == "batch":
            raise ValueError(
                f"learner.objective = {self.objective!r} with learner.num_ranks = {self.num_ranks}: its "
                "baseline is the mean reward over the step's batch, which each rank would take over its own "
                "share of the step only (a different baseline per rank); use one rank, or a per-group "
                "objective (grpo, rloo, vcpo)"
            )
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {v}")
        return v


def resolve_max_sequence_tokens(data: Any) -> Any:
    """A run file's raw sections with ``learner.max_sequence_tokens`` 0 set to ``sampler.max_model_len``
    (the longest prompt + response a trajectory can have; its default when the run file does not set it)."""
    from services.sampler.config import SamplerConfig

    if not isinstance(data, dict):
        return data
    learner, sampler = data.get("learner"), data.get("sampler")
    learner = learner.model_dump() if isinstance(learner, BaseModel) else dict(learner or {})
    sampler = sampler.model_dump() if isinstance(sampler, BaseModel) else dict(sampler or {})
    if learner.get("max_sequence_tokens", 0):
        return data
    default = SamplerConfig.model_fields["max_model_len"].default
    learner["max_sequence_tokens"] = sampler.get("max_model_len", default)
    return {**data, "learner": learner}


def check_scored_capacity(scored_maxlen: int, learner: LearnerConfig, groups_per_step: int) -> None:
    """The learner keeps every group it consumed on `scored` until the checkpoint that covers it (that is
    what makes a restart exact), so the stream must hold a checkpoint interval of steps plus the step being
    formed; with less, the reward service waits on a full stream the learner cannot drain: a stalled run."""
    held = (learner.checkpoint_every + 1) * groups_per_step
    if scored_maxlen < held:
        raise ValueError(
            f"streams.scored_maxlen = {scored_maxlen} is less than (learner.checkpoint_every + 1) * "
            f"run.groups_per_step = {held}: the learner acknowledges scored groups only at a checkpoint, so "
            "the stream would fill up before the next one and the run would stall; raise streams.scored_maxlen "
            "or lower learner.checkpoint_every"
        )


def check_groups_per_rank(groups_per_step: int, learner: LearnerConfig) -> None:
    """Every rank trains on whole groups: a step with fewer groups than ranks leaves a rank with none, which
    raises while the others wait for it in a collective until the supervisor ends them."""
    if groups_per_step < learner.num_ranks:
        raise ValueError(
            f"run.groups_per_step = {groups_per_step} is less than learner.num_ranks = "
            f"{learner.num_ranks}: every rank trains on whole groups, so each step needs one per rank"
        )


class LearnerServiceConfig(ServiceConfig):
    """Everything the learner reads: the shared sections and ``[learner]``."""

    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)  # where versions go

    @model_validator(mode="before")
    @classmethod
    def _sequence_length_from_sampler(cls, data: Any) -> Any:
        return resolve_max_sequence_tokens(data)

    @model_validator(mode="after")
    def _run_fits_the_learner(self) -> LearnerServiceConfig:
        check_scored_capacity(self.streams.scored_maxlen, self.learner, self.run.groups_per_step)
        check_groups_per_rank(self.run.groups_per_step, self.learner)
        check_adapter_transport(self.learner.lora, self.weight_broker.transport)
        return self
