"""The dedicated evaluator as a Ray actor: :class:`~services.evaluator.service.EvaluatorService` in a process
of its own, with ``evaluation.gpus`` GPUs and ``evaluation.ray_resources``. Ray only places and restarts it."""

from __future__ import annotations

import threading
from typing import Any

import ray

from services.common.observability import actor_logging
from services.sampler.config import SamplerServiceConfig


@ray.remote(max_concurrency=2)  # run() holds one thread; stop() uses the other
class EvaluatorActor:
    """The dedicated evaluator (``[evaluation] placement = "dedicated"``) in its own process."""

    def __init__(self, cfg_json: str) -> None:
        self.cfg = SamplerServiceConfig.model_validate_json(cfg_json)
        self.stop_event = threading.Event()
        self.service: Any = None

    def run(self) -> dict[str, Any]:
        from services.evaluator.service import NAME, EvaluatorService

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
