"""An evaluator built from the run's config: its sets, schedule, scorers, recorder and agent loop.

The same build serves the three places evaluation runs: a sampler replica's engine (shared.py), the dedicated
evaluator (service.py) and, without schedule or recorder, the eval command (offline.py). In shared placement
it also checks, with the sets' real sizes and the engine's batch limit, that a round can finish inside its
hold (capacity.py), and refuses to start where it cannot.
"""

from __future__ import annotations

import logging

import redis

from services.common.observability import Metrics
from services.common.prompts import PromptEncoder
from services.evaluator.capacity import assumed_batch_limit, check_round, requests_in_flight
from services.evaluator.evaluator import Evaluator
from services.evaluator.metrics import EvalMetrics, EvalRecorder
from services.evaluator.schedule import EvalSchedule
from services.evaluator.sets import load_eval_sets
from services.evaluator.shards import ShardBoard
from services.reward.pool import ScoringPool
from services.sampler.agent import AgentLoop
from services.sampler.config import SamplerServiceConfig
from services.sampler.engine import GenerationEngine
from services.sampler.environments.registry import EnvironmentRegistry

log = logging.getLogger(__name__)

ENGINE_SEED_OFFSET = 999  # an evaluator's own engine seed is run.seed * 1000 + this (replicas use 0, 1, ...)


def make_evaluator(
    cfg: SamplerServiceConfig,
    engine: GenerationEngine,
    encoder: PromptEncoder,
    registry: Metrics,
    client: redis.Redis,
    owner: str,
    where: str,
    environments: EnvironmentRegistry | None = None,
) -> Evaluator:
    """The run's evaluator in ``engine``: its sets, schedule, scorers and recorder, and for sets that name an
    environment an agent loop of its own over ``environments`` (the caller's registry: the sampler's when it
    shares its engine). Closing it closes its scoring pool."""
    ev, run = cfg.evaluation, cfg.run
    sets = load_eval_sets(cfg, encoder)
    plan = check_round(cfg.sampler, ev, {s.name: len(s.tasks) for s in sets}, engine.batch_limit)
    if plan is not None:
        log.info("evaluation (%s): %s", where, plan.describe())
    shared = where == "shared"
    board = ShardBoard(client, run.run_id, owner, ev.shard_samples, ev.shard_lease_s) if shared else None
    agent = evaluation_agent(cfg, engine, encoder, environments)
    metrics = EvalMetrics(registry)
    pool = ScoringPool.from_config(cfg.reward, workers=1)  # the reward service's scorers and settings
    try:
        return Evaluator(
            engine,
            sets,
            pool.score_many,
            EvalRecorder(metrics, client, run.run_id, where, owner),
            EvalSchedule(
                {s.name: s.every or ev.every for s in ev.sets}, ev.at_start, client, run.run_id, owner
            ),
            encoder=encoder,
            max_in_flight=requests_in_flight(ev, engine.batch_limit or assumed_batch_limit(cfg.sampler, ev)),
            max_delay_s=ev.max_delay_s,
            metrics=metrics,
            agent=agent,
            on_close=pool.close,
            board=board,
        )
    except BaseException:
        pool.close()  # its worker processes
        raise


def evaluation_agent(
    cfg: SamplerServiceConfig,
    engine: GenerationEngine,
    encoder: PromptEncoder,
    environments: EnvironmentRegistry | None,
) -> AgentLoop | None:
    """The agent loop that runs the episodes of the evaluation sets naming an environment (the evaluator's own,
    over ``environments``); None when every set is single-turn."""
    if not any(s.environment for s in cfg.evaluation.sets):
        return None
    if environments is None:
        raise ValueError("evaluation sets with an environment need the run's environment registry")
    return AgentLoop(engine, environments, encoder, threads=cfg.sampler.env_threads)
