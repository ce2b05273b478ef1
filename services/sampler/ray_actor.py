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


@ray.remote(max_concurrency=2)  # run() holds one thread; stop() uses the other
class EvaluatorActor:
    """The dedicated evaluator (``[evaluation] placement = "dedicated"``) in its own process."""

    def __init__(self, cfg_json: str) -> None:
        self.cfg = SamplerServiceConfig.model_validate_json(cfg_json)
        self.stop_event = threading.Event()
        self.service: Any = None

    def run(self) -> dict[str, Any]:
        from services.sampler.evaluator_service import NAME, EvaluatorService

        actor_logging(NAME, self.cfg.run.run_dir)
        self.service = EvaluatorService(self.cfg)
        try:
            return dict(self.service.serve(self.stop_event))
        finally:
            self.service.close()

    def first_version(self) -> int | None:
        """The first version the evaluator had in hand (None while its engine starts or it fetches it)."""
        return None if self.service is None else self.service.runner.first_version

    def stop(self) -> None:
        self.stop_event.set()


def start_evaluator(cfg: SamplerServiceConfig) -> tuple[Any, Any]:
    """The dedicated evaluator actor (``evaluation.gpus`` GPUs) and its ``run`` ref."""
    ev = cfg.evaluation
    actor = EvaluatorActor.options(  # type: ignore[attr-defined]
        num_cpus=1,
        num_gpus=ev.gpus,
        resources=dict(ev.ray_resources),
        name=f"vcpo-evaluator-{cfg.run.run_id}",
    ).remote(cfg.model_dump_json())
    return actor, actor.run.remote()
