"""Configuration of the reward service (the ``[reward]`` table of a run file)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.config import Section, ServiceConfig


class RewardConfig(Section):
    """Scorers, their limits and the reward service's scaling and endpoints."""

    default_scorer: str = Field("exact_match", min_length=1, description="Scorer for tasks that name none.")
    timeout_s: float = Field(10.0, gt=0, description="Longest one scoring call may take.")
    fallback_reward: float = Field(0.0, description="Reward recorded when a scorer fails or times out.")
    min_replicas: int = Field(1, ge=1, description="Fewest reward replicas (Ray Serve autoscaling).")
    max_replicas: int = Field(4, ge=1, description="Most reward replicas (Ray Serve autoscaling).")
    target_queue_depth: int = Field(
        16, ge=1, description="Unscored groups per replica that autoscaling aims for."
    )
    grpc_port: int = Field(50053, ge=0, le=65535, description="Score/ScoreBatch gRPC port; 0 = a free port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")

    @model_validator(mode="after")
    def _replica_bounds(self) -> RewardConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        return self


class RewardServiceConfig(ServiceConfig):
    """Everything the reward service reads: the shared sections and ``[reward]``."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
