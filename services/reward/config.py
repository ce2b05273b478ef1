"""Configuration of the reward service (the ``[reward]`` table of a run file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, field_validator, model_validator

from services.common.config import Section, ServiceConfig


class SandboxConfig(Section):
    """Limits of the sandbox that runs response code against tests (the ``code`` scorer)."""

    wall_seconds: float = Field(10.0, gt=0, description="Wall-clock limit of one sandboxed run.")
    cpu_seconds: int = Field(5, ge=1, description="CPU-time limit of one sandboxed run (RLIMIT_CPU).")
    memory_bytes: int = Field(
        512 << 20, ge=32 << 20, description="Address-space limit of one sandboxed run (RLIMIT_AS)."
    )
    output_bytes: int = Field(
        64 << 10, ge=1024, description="Most stdout+stderr bytes kept; a run writing more is stopped."
    )
    file_bytes: int = Field(
        16 << 20, ge=0, description="Largest file a run may write in its scratch directory (RLIMIT_FSIZE)."
    )
    max_open_files: int = Field(64, ge=16, description="Open file descriptors per run (RLIMIT_NOFILE).")
    user: str = Field(
        "nobody",
        description="When the service runs as root, sandboxed code runs as this user instead; "
        "'' keeps root's uid (not recommended).",
    )


class RewardConfig(Section):
    """Scorers, their limits and the reward service's scaling and endpoints."""

    default_scorer: str = Field("exact_match", min_length=1, description="Scorer for tasks that name none.")
    timeout_s: float = Field(10.0, gt=0, description="Longest one scoring call may take.")
    timeouts: dict[str, float] = Field(
        default_factory=lambda: {"code": 60.0},
        description="Per-scorer time limits in seconds, overriding timeout_s (e.g. {code = 60}).",
    )
    fallback_reward: float = Field(0.0, description="Reward recorded when a scorer fails or times out.")
    workers: int = Field(
        2, ge=1, description="Scoring worker processes per reward replica (responses scored in parallel)."
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="Python modules imported in every scoring worker to register extra scorers by name.",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    min_replicas: int = Field(1, ge=1, description="Fewest reward replicas (Ray Serve autoscaling).")
    max_replicas: int = Field(4, ge=1, description="Most reward replicas (Ray Serve autoscaling).")
    target_queue_depth: int = Field(
        16, ge=1, description="Unscored groups per replica that autoscaling aims for."
    )
    grpc_port: int = Field(50053, ge=0, le=65535, description="Score/ScoreBatch gRPC port; 0 = a free port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")
    serve_ports: Literal["free", "configured"] = Field(
        "free",
        description="Ports of each Ray Serve replica: free ones (replicas may share a node; see their "
        "endpoints files), or grpc_port and metrics_port as given (one replica per pod, as the Helm chart "
        "places them with ray_resources, so Prometheus scrapes a fixed port).",
    )
    ray_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources each Ray Serve replica asks for besides its CPU, e.g. "
        "{vcpo_reward = 1}: replicas run only on the nodes that offer them (the Helm chart's reward pods).",
    )

    @field_validator("timeouts")
    @classmethod
    def _positive_timeouts(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {name: t for name, t in value.items() if not t > 0}
        if bad:
            raise ValueError(f"scorer timeouts must be > 0 seconds, got {bad}")
        return value

    @model_validator(mode="after")
    def _replica_bounds(self) -> RewardConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        return self

    def timeout_for(self, scorer: str) -> float:
        """The time limit of one call of ``scorer``."""
        return self.timeouts.get(scorer, self.timeout_s)


class RewardServiceConfig(ServiceConfig):
    """Everything the reward service reads: the shared sections and ``[reward]``."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
