"""One evaluation round on a saved model, outside a run: the eval command's (``deploy/eval.py``) entry point.

    model ─► an engine of its own (the samplers' settings) ─► Evaluator.run: every set once, no schedule
          ─► the records (``kind: eval``, ``where: command``), each with its tasks' fractions correct

Sets with an environment register the run file's environments in a Redis of the command's own (the run's may
be gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.common.prompts import PromptEncoder
from services.common.redis_server import LocalRedis
from services.evaluator.build import ENGINE_SEED_OFFSET, evaluation_agent
from services.evaluator.capacity import requests_in_flight
from services.evaluator.evaluator import Evaluator
from services.evaluator.sets import load_eval_sets
from services.reward.pool import ScoringPool
from services.sampler.build import environment_registry, make_engine
from services.sampler.config import SamplerServiceConfig
from services.sampler.environments.registry import EnvironmentRegistry


def evaluate_model(
    cfg: SamplerServiceConfig,
    model: str,
    version: int | None,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[dict[str, Any]]:
    """One round of every set in ``cfg.evaluation`` on ``model`` (a hub id or directory), recorded under
    ``version`` (None: not a policy version); ``progress(done, total, seconds)``: responses generated so far,
    every 10 s of generation."""
    s = cfg.sampler
    engine = make_engine(cfg, ENGINE_SEED_OFFSET, model=model)
    pool = ScoringPool.from_config(cfg.reward)
    redis_server: LocalRedis | None = None
    environments: EnvironmentRegistry | None = None
    evaluator = None
    try:
        encoder = PromptEncoder(engine.tokenizer, s.max_model_len, s.max_tokens, s.system_prompt)
        eval_sets = load_eval_sets(cfg, encoder)
        if any(e.environment for e in eval_sets):
            redis_server = LocalRedis()
            environments = environment_registry(cfg, redis_server.client(), "eval")
        label = 0 if version is None else version
        engine.loaded_version = label  # the engine serves the weights it was built from
        evaluator = Evaluator(  # no recorder: the records below, with the version and per-task figures
            engine,
            eval_sets,
            pool.score_many,
            encoder=encoder,
            # the command owns its engine: as many requests as it batches (at least 256)
            max_in_flight=max(requests_in_flight(cfg.evaluation, engine.batch_limit or 256), 256),
            agent=evaluation_agent(cfg, engine, encoder, environments),
        )
        t0 = time.monotonic()

        def generated(done: int, total: int) -> None:
            if progress is not None:
                progress(done, total, time.monotonic() - t0)

        results = evaluator.run(label, progress=generated)
        records = []
        for r, es in zip(results, eval_sets, strict=True):
            rec = r.record("command", "eval", None, None)
            rec["version"] = version
            rec["per_task"] = {  # each task's fraction of correct samples: where two models differ
                task.task_id: sum(x >= es.correct_at for x in rewards) / len(rewards)
                for task, rewards in zip(es.tasks, r.per_task, strict=True)
            }
            records.append(rec)
        return records
    finally:
        if evaluator is not None:
            evaluator.close()  # and its agent loop
        pool.close()
        engine.close()
        if environments is not None:
            environments.close()
        if redis_server is not None:
            redis_server.stop()
