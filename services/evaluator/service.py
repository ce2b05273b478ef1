"""The dedicated evaluator (``[evaluation] placement = "dedicated"``): an engine of its own that follows the
published versions and evaluates the due ones, so evaluation takes nothing from the samplers.

    weight broker ─► WeightSync (fetches due versions only) ─► EvalRunner: load it, one round
                                                                └─► results: Redis, vcpo_eval_* on its /metrics

Run by the launcher as a Ray actor (``services/evaluator/ray_actor.py``, ``evaluation.gpus`` GPUs); its metrics
endpoint is ``<run_dir>/evaluator/evaluator.endpoints.json``. Its engine and environment registry have the
samplers' settings (services.sampler.build: make_engine, environment_registry).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from services.common.observability import Metrics, serve_metrics, write_endpoints
from services.common.prompts import PromptEncoder
from services.common.streams.consumer import StreamTail
from services.common.streams.metrics import StreamMetrics
from services.common.streams.specs import connect, stream_specs
from services.evaluator.build import ENGINE_SEED_OFFSET, make_evaluator
from services.evaluator.runner import EvalRunner
from services.sampler.build import environment_registry, make_engine
from services.sampler.config import SamplerServiceConfig
from services.sampler.engine import GenerationEngine
from services.sampler.weights import WeightSync
from services.weight_transport import transport_from_config

log = logging.getLogger(__name__)

NAME = "evaluator"


class EvaluatorService:
    def __init__(self, cfg: SamplerServiceConfig, engine: GenerationEngine | None = None) -> None:
        s, run = cfg.sampler, cfg.run
        if not cfg.evaluation.sets:
            raise ValueError("the evaluator has nothing to do: [evaluation] lists no sets")
        if not run.redis_url:
            raise ValueError("run.redis_url is empty: the evaluator needs the run's Redis")
        self.cfg = cfg
        self.registry = Metrics(NAME)
        client = connect(run.redis_url)
        self._owns_engine = engine is None
        self.engine = engine or make_engine(cfg, ENGINE_SEED_OFFSET)
        encoder = PromptEncoder(self.engine.tokenizer, s.max_model_len, s.max_tokens, s.system_prompt)
        self.environments = (  # for sets that run episodes of an environment
            environment_registry(cfg, client, NAME)
            if any(s.environment for s in cfg.evaluation.sets)
            else None
        )
        self.evaluator = make_evaluator(
            cfg, self.engine, encoder, self.registry, client, NAME, "dedicated", self.environments
        )
        self.transport = transport_from_config(cfg.weight_broker, run)
        specs = stream_specs(run, cfg.streams)
        tail = StreamTail(client, specs["weights"], metrics=StreamMetrics(self.registry))
        # only versions some set may be due at are fetched: between evaluations the broker sends it nothing
        schedule = self.evaluator.schedule
        assert schedule is not None
        self.sync = WeightSync(self.engine, self.transport, tail, s.weight_poll_interval_s, schedule.wants)
        self.runner = EvalRunner(self.engine, self.sync, self.evaluator)
        self.http = serve_metrics(self.registry, port=cfg.evaluation.metrics_port)
        write_endpoints(run.run_dir / NAME, NAME, 0, self.http.url)

    def serve(self, stop: threading.Event) -> dict[str, Any]:
        log.info(
            "evaluator: %d set(s), every %d versions; metrics on %s",
            len(self.evaluator.sets),
            self.cfg.evaluation.every,
            self.http.url,
        )
        self.runner.run(stop)
        return {"evaluated_versions": self.runner.evaluated, "rounds": dict(self.evaluator.rounds)}

    def close(self) -> None:
        self.http.close()
        self.evaluator.close()  # closed when the runner stopped, unless it never ran
        if self.environments is not None:
            self.environments.close()
        self.transport.close()
        if self._owns_engine:
            self.engine.close()
