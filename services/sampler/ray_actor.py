"""The sampler as Ray actors: one per replica, each owning its engine (and, on GPUs, its tensor-parallel GPUs).

Ray only places and restarts the processes; the replicas talk through Redis, gRPC and the weight broker as
the plain entry point (``python -m services.sampler``) does, so both run the same :class:`SamplerService`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
from pydantic import SecretStr

from services.common.observability import actor_logging
from services.common.starts import record_start_quietly
from services.sampler.config import SamplerServiceConfig


@ray.remote(max_concurrency=2)  # run() holds one thread; status() and stop() use the other
class SamplerActor:
    def __init__(self, cfg_json: str, replica: int, api_token: str = "") -> None:
        cfg = SamplerServiceConfig.model_validate_json(cfg_json)
        # the JSON has the secret masked ("**********"): it travels beside it
        sampler = cfg.sampler.model_copy(update={"api_token": SecretStr(api_token)})
        self.cfg = cfg.model_copy(update={"sampler": sampler})
        self.replica = replica
        self.stop_event = threading.Event()
        self.service: Any = None

    def run(self, max_groups: int = 0) -> dict[str, Any]:
        """Serve until :meth:`stop` (or ``max_groups`` groups); returns the replica's summary."""
        from services.sampler.service import SamplerService

        actor_logging(f"sampler-{self.replica}", self.cfg.run.run_dir)
        record_start_quietly(
            self.cfg.run.redis_url, self.cfg.run.run_id, "sampler", f"sampler-{self.replica}"
        )
        self.service = SamplerService(self.cfg, self.replica)
        try:
            return self.service.serve(self.stop_event, max_groups)
        finally:
            self.service.close()

    def status(self) -> dict[str, Any]:
        """The replica's live status (what its gRPC Status reports)."""
        if self.service is None:
            return {"state": "STARTING", "detail": "building the engine", "policy_version": 0, "figures": {}}
        s = self.service.sampler.status
        from vcpo.v1 import common_pb2

        return {
            "state": common_pb2.ServiceStatus.State.Name(s.state),
            "detail": s.detail,
            "policy_version": s.policy_version,
            "figures": dict(s.figures),
        }

    def stop(self) -> None:
        self.stop_event.set()

    def pid(self) -> int:
        """The replica's process id (fault-injection tests kill it)."""
        return os.getpid()


def start_samplers(
    cfg: SamplerServiceConfig, max_groups: int = 0, max_restarts: int = 0
) -> tuple[list[Any], list[Any]]:
    """``sampler.replicas`` actors, each asking Ray for ``sampler.gpus_per_replica`` GPUs; returns the actors
    and their ``run`` refs. With ``max_restarts``, Ray restarts a replica whose process dies (up to that many
    times) and runs ``run`` again on it: the new process gives back the admission slots the dead one held,
    takes back its pending tasks and carries on under the same replica id."""
    from services.common.tiny_model import run_model

    run_model(cfg.run)  # build the tiny model once, before the replicas load it
    s = cfg.sampler
    payload = cfg.model_dump_json()
    actors = [
        SamplerActor.options(  # type: ignore[attr-defined]
            num_cpus=1,
            num_gpus=s.gpus_per_replica,
            resources=dict(s.ray_resources),
            name=f"vcpo-sampler-{cfg.run.run_id}-{i}",
            max_restarts=max_restarts,
            max_task_retries=max_restarts,
        ).remote(payload, i, s.api_token.get_secret_value())
        for i in range(s.replicas)
    ]
    return actors, [a.run.remote(max_groups) for a in actors]
