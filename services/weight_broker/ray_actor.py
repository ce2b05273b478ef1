"""The weight broker as a Ray actor, the same :class:`BrokerService` as the plain entry point. Samplers and the
learner reach it through its gRPC and data-plane ports, never through Ray object refs."""

from __future__ import annotations

from typing import Any

import ray

from services.common.observability import actor_logging
from services.common.starts import record_start_quietly
from services.weight_broker.config import WeightBrokerServiceConfig
from services.weight_transport.config import WeightBrokerConfig, broker_host


def advertised_host(wb: WeightBrokerConfig, local_ray: bool, node_ip: str) -> str:
    """Where samplers and the learner reach the broker: the configured host; else, on a Ray cluster, the broker
    node's IP (127.0.0.1 would send every other node to itself); with a local Ray, :func:`broker_host`'s."""
    if wb.advertise_host or local_ray:
        return broker_host(wb)
    return node_ip


@ray.remote(num_cpus=0.5)
class WeightBrokerActor:
    def __init__(self, cfg_json: str, local_ray: bool) -> None:
        from services.weight_broker.service import BrokerService

        cfg = WeightBrokerServiceConfig.model_validate_json(cfg_json)
        actor_logging("weight_broker", cfg.run.run_dir)
        record_start_quietly(cfg.run.redis_url, cfg.run.run_id, "weight_broker", "weight_broker")
        host = advertised_host(cfg.weight_broker, local_ray, ray.util.get_node_ip_address())
        wb = cfg.weight_broker.model_copy(update={"advertise_host": host})
        self.broker = BrokerService(cfg.model_copy(update={"weight_broker": wb}))

    def endpoints(self) -> dict[str, Any]:
        """The bound ports (free ones where the config says 0), this node's address and ``advertise_host``
        (what the learner and the samplers must be given)."""
        return {"host": ray.util.get_node_ip_address(), **self.broker.endpoints()}

    def stop(self) -> None:
        self.broker.close()


def start_broker(
    cfg: WeightBrokerServiceConfig, local_ray: bool = True, max_restarts: int = 0
) -> tuple[Any, dict[str, Any]]:
    """Start the broker actor and wait until it serves. ``local_ray``: the Ray cluster is this machine alone.
    With ``max_restarts``, Ray restarts a broker whose process dies, on the same ports (give the config concrete
    ones): its clients retry across the restart; versions survive it with disk storage, else the learner
    publishes its current one again."""
    actor = WeightBrokerActor.options(  # type: ignore[attr-defined]
        name=f"vcpo-weight-broker-{cfg.run.run_id}",
        resources=dict(cfg.weight_broker.ray_resources),
        max_restarts=max_restarts,
        max_task_retries=max_restarts,
    ).remote(cfg.model_dump_json(), local_ray)
    return actor, ray.get(actor.endpoints.remote(), timeout=120)
