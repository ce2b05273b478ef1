"""The whole-run config: every section of a run file, validated together (launcher, presets, Helm values).

Each service validates its own sections at start-up; this model checks a run file as a whole, so a typo
in any table is caught before anything starts.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.config import Section, ServiceConfig
from services.common.lora import check_adapter_transport
from services.learner.config import (
    LearnerConfig,
    check_groups_per_rank,
    check_scored_capacity,
    resolve_max_sequence_tokens,
)
from services.reward.config import RewardConfig
from services.sampler.agents.config import AgentsConfig
from services.sampler.config import EvaluationConfig, SamplerConfig, eval_set_environment
from services.weight_transport import WeightBrokerConfig


class LauncherConfig(Section):
    """How the launcher brings the system up."""

    ray_address: str = Field(
        "",
        description="Address of an existing Ray cluster ('auto', 'ray://host:10001'); empty = start a local one.",
    )
    max_steps: int = Field(0, ge=0, description="Stop after this many learner steps; 0 = run until stopped.")
    max_minutes: float = Field(0.0, ge=0, description="Stop after this much wall time; 0 = no limit.")
    progress_interval_s: float = Field(5.0, gt=0, description="Seconds between live progress lines.")
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds each service gets to come up at start: the learner to publish its first version, "
        "the samplers to generate, the reward app and the evaluator to be ready. On GPUs a sampler's start "
        "holds the model's download, its load, torch.compile, CUDA graph capture and the first version's "
        "fetch: raise it for large models (vLLM's own engine start is bounded by VLLM_ENGINE_READY_TIMEOUT_S, "
        "600 s by default, set in the services' environment).",
    )
    cluster_fit: Literal["refuse", "warn"] = Field(
        "refuse",
        description="What the launcher does, once Ray is up and before any model is downloaded, with a run that "
        "asks for more than the Ray cluster has (GPUs, CPUs, the services' ray_resources; in total, and per "
        "node for what one process needs): refuse it, naming both figures and the keys to change; or warn and "
        "start anyway, for a cluster whose autoscaler adds nodes for what waits (one that reports its largest "
        "size to Ray is compared with that size by itself, and only warned about below it).",
    )
    unplaced_report_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a learner, sampler replica, evaluator or reward replica may wait for Ray to place "
        "it (its GPUs or CPUs held by something else) before the launcher names it and says what each node "
        "has free; the start still waits up to start_timeout_s, whose error then names it too.",
    )
    max_restarts: int = Field(
        10,
        ge=0,
        description="Times a service whose process died is restarted before the run fails: each sampler "
        "replica and the weight broker (by Ray), the learner group (by the launcher, from its last checkpoint) "
        "and a local redis-server (from its append-only file).",
    )
    restart_backoff_s: float = Field(
        2.0,
        ge=0,
        description="Wait before restarting the learner group; doubled for each of its failures in the last 10 "
        "minutes (at most 60 s).",
    )
    learner_hang_timeout_s: float = Field(
        300.0,
        ge=0,
        description="A learner rank that answers no call from the launcher this long is hung (stopped, or "
        "stuck holding its interpreter): the group is restarted from its checkpoint as if it had died. A hang "
        "inside a collective is seen sooner by its peers (learner.collective_timeout_s). 0 = no watch.",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="The launcher's /metrics (restarts by service); 0 = a free port."
    )
    stop_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest wait for each service to stop (evaluator, samplers, reward, learner). The learner's "
        "wait is this or, where longer, the time its final checkpoint takes to write: the model's parameters "
        "× 12 B (ZeRO-3's fp32 master weights and AdamW moments; ~91 GB at 7B) at 200 MB/s, plus 60 s "
        "(deploy/launcher_stopping.py); the launcher prints the wait it uses. Raise it where the checkpoint "
        "volume writes slower than 200 MB/s. A learner killed mid-checkpoint resumes from the previous one.",
    )
    sequential_start: bool = Field(
        False,
        description="Start the learner, then the reward app, then the samplers, each once the one before is "
        "up (the start-up of old: slower, its failures one at a time). By default the three start side by "
        "side once the weight broker is up (benchmarks/startup.py compares the two).",
    )
    warm_start_steps: int = Field(
        0, ge=0, description="Supervised warm-start steps on sampler.dataset before RL (0 = none)."
    )
    warm_start_lr: float = Field(1e-3, gt=0, description="Learning rate of the supervised warm start.")
    warm_start_batch_size: int = Field(32, ge=1, description="Examples per warm-start step.")


SHARED_GPU_MARGIN = 0.05  # of a GPU a replica with a share of it leaves for its co-tenants' CUDA contexts


def check_sampler_gpus(s: SamplerConfig, learner_gpus_per_rank: float) -> None:
    """Sampler replicas hold the GPUs their engines use. With none reserved, Ray still lets each replica see
    the node's GPUs and its vLLM engine opens cuda:0, beside the learner ranks that hold it; and a tensor-
    parallel engine needs a whole GPU per shard."""
    if learner_gpus_per_rank > 0 and s.gpus_per_replica == 0:
        raise ValueError(
            f"sampler.gpus_per_replica = 0 while learner.gpus_per_rank = {learner_gpus_per_rank:g}: on GPUs "
            "each sampler replica must hold the GPUs its engine uses, or every replica opens cuda:0 beside "
            f"the learner; set sampler.gpus_per_replica = {s.tensor_parallel_size} (sampler.tensor_parallel_size)"
        )
    if s.tensor_parallel_size > 1 and 0 < s.gpus_per_replica < s.tensor_parallel_size:
        raise ValueError(
            f"sampler.gpus_per_replica = {s.gpus_per_replica:g} is less than sampler.tensor_parallel_size = "
            f"{s.tensor_parallel_size}: a tensor-parallel engine needs a GPU per shard"
        )
    most = round(s.gpus_per_replica - SHARED_GPU_MARGIN, 4)
    if 0 < s.gpus_per_replica < 1 and s.gpu_memory_utilization > most:
        raise ValueError(
            f"sampler.gpu_memory_utilization = {s.gpu_memory_utilization:g} with sampler.gpus_per_replica = "
            f"{s.gpus_per_replica:g}: a replica holding part of a GPU shares it (with the learner or other "
            "replicas), and vLLM takes gpu_memory_utilization of the whole GPU's memory at start-up, failing "
            f"where that much is not free; set it to at most {most:g} (the share, less {SHARED_GPU_MARGIN:g} "
            "of the GPU for the other tenants' CUDA contexts)"
        )


class SystemConfig(ServiceConfig):
    """A whole run file: shared sections and every service's section. Unknown sections are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    weight_broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    agents: AgentsConfig = Field(default_factory=AgentsConfig)

    @model_validator(mode="before")
    @classmethod
    def _sequence_length_from_sampler(cls, data: Any) -> Any:
        return resolve_max_sequence_tokens(data)

    @model_validator(mode="after")
    def _sections_agree(self) -> SystemConfig:
        if self.sampler.n > self.learner.max_group_size:
            raise ValueError(
                f"sampler.n = {self.sampler.n} exceeds learner.max_group_size = {self.learner.max_group_size}: "
                "the learner would reject every group"
            )
        check_groups_per_rank(self.run.groups_per_step, self.learner)
        check_scored_capacity(self.streams.scored_maxlen, self.learner, self.run.groups_per_step)
        ev, s = self.evaluation, self.sampler
        check_sampler_gpus(s, self.learner.gpus_per_rank)
        check_adapter_transport(self.learner.lora, self.weight_broker.transport)
        for spec in ev.sets:
            eval_set_environment(s, spec)
        if (
            ev.sets
            and ev.placement == "dedicated"
            and s.gpus_per_replica > 0
            and ev.gpus < s.tensor_parallel_size
        ):
            raise ValueError(
                f"evaluation.gpus = {ev.gpus:g} is less than sampler.tensor_parallel_size = "
                f"{s.tensor_parallel_size}: the dedicated evaluator's engine has the samplers' engine settings, "
                "so it needs as many GPUs as a sampler replica"
            )
        if ev.sets and ev.placement == "dedicated" and self.weight_broker.transport == "collective":
            raise ValueError(
                'evaluation.placement = "dedicated" with weight_broker.transport = "collective": the dedicated '
                "evaluator fetches its versions from the broker, which is not in the weight group and so holds "
                'only the versions published through it; use evaluation.placement = "shared" (the samplers '
                'evaluate) or weight_broker.transport = "tcp"'
            )
        self._scorers_exist()
        return self

    def _scorers_exist(self) -> None:
        """Every scorer the run names is registered (with reward.plugins, their scorers are known only where
        the reward service loads them: not checked here)."""
        if self.reward.plugins:
            return
        from services.reward.scorers import scorer_names

        known = set(scorer_names())
        named = [
            (f"sampler.scorer_by_source[{source!r}]", scorer)
            for source, scorer in self.sampler.scorer_by_source.items()
        ]
        named += [(f"evaluation.sets {spec.name!r} scorer", spec.scorer) for spec in self.evaluation.sets]
        named.append(("reward.default_scorer", self.reward.default_scorer))
        for where, scorer in named:
            if scorer and scorer not in known:
                raise ValueError(
                    f"{where} = {scorer!r} is not a registered scorer; registered: {', '.join(sorted(known))}"
                )

    def gpus(self) -> float:
        """GPUs the run holds while it trains (the GPU-hours of its evaluation records are these x hours)."""
        total = self.learner.num_ranks * self.learner.gpus_per_rank
        total += self.sampler.replicas * self.sampler.gpus_per_replica
        if self.evaluation.sets and self.evaluation.placement == "dedicated":
            total += self.evaluation.gpus
        return total


S = TypeVar("S", bound=BaseModel)


def section(cfg: SystemConfig, model: type[S]) -> S:
    """The part of the whole-run config a service reads (its own section and the shared ones)."""
    return model.model_validate(cfg.model_dump(include=set(model.model_fields)))
