"""The weight broker as a Ray actor (what the Ray launcher places); the same :class:`BrokerService` as the
plain entry point. Samplers and the learner reach it through its gRPC and data-plane ports, never through
Ray object refs."""

from __future__ import annotations

from typing import Any

import ray

from services.common.observability import actor_logging
from services.weight_broker.config import WeightBrokerServiceConfig


@ray.remote(num_cpus=0.5)
class WeightBrokerActor:
    def __init__(self, cfg_json: str) -> None:
        from services.weight_broker.service import BrokerService

        cfg = WeightBrokerServiceConfig.model_validate_json(cfg_json)
        actor_logging("weight_broker", cfg.run.run_dir)
        self.broker = BrokerService(cfg)

    def endpoints(self) -> dict[str, Any]:
        """The bound ports (free ones when the config asked for 0) and this node's address."""
        return {"host": ray.util.get_node_ip_address(), **self.broker.endpoints()}

    def stop(self) -> None:
        self.broker.close()


def start_broker(cfg: WeightBrokerServiceConfig) -> tuple[Any, dict[str, Any]]:
    """Start the broker actor and wait until it serves; returns the actor and its endpoints."""
    actor = WeightBrokerActor.options(  # type: ignore[attr-defined]
        name=f"vcpo-weight-broker-{cfg.run.run_id}", resources=dict(cfg.weight_broker.ray_resources)
    ).remote(cfg.model_dump_json())
    return actor, ray.get(actor.endpoints.remote(), timeout=120)
