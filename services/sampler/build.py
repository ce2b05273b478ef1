"""A sampler's engine and environment registry, built from its config.

Public: the dedicated evaluator and the eval command (services/evaluator/) build theirs here, so they sample
with the same engine settings and reach the same environments as the training replicas.
"""

from __future__ import annotations

import functools
import logging

import redis

from services.common.tiny_model import run_model
from services.sampler.config import EnvironmentConfig, SamplerServiceConfig
from services.sampler.engine import GenerationEngine, VllmEngine, VllmSettings
from services.sampler.environments.registry import CircuitBreaker, EnvironmentRegistry, make_environment
from vcpo.v1 import registry_pb2

log = logging.getLogger(__name__)


def make_engine(cfg: SamplerServiceConfig, replica: int, model: str = "") -> GenerationEngine:
    """vLLM with the sampler's engine settings, on ``model`` (default: the run's policy, whose versions are
    LoRA adapters with ``[learner.lora] publish = "adapter"``; a ``model`` given serves its own weights)."""
    s, run = cfg.sampler, cfg.run
    adapter = cfg.learner.lora if cfg.learner.lora.adapter_versions and not model else None
    return VllmEngine(
        VllmSettings(
            model=model or run_model(run),
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes,
            enforce_eager=s.enforce_eager,
            seed=run.seed * 1000 + replica,
            collective_weights=cfg.weight_broker.transport == "collective",
            adapter=adapter,
        )
    )


def known_scorers(plugins: list[str]) -> frozenset[str] | None:
    """The scorer names the reward service knows: its built-ins and those its ``reward.plugins`` register.
    None (names go unchecked) when a plugin cannot be imported in this process (the reward service's image may
    hold what the sampler's lacks); a warning says so."""
    from services.reward.scorers import load_plugins, scorer_names

    try:
        load_plugins(plugins)
    except ImportError as exc:
        log.warning("scorer names are not checked at registration: %s", exc)
        return None
    return frozenset(scorer_names())


def environment_registry(cfg: SamplerServiceConfig, client: redis.Redis, owner: str) -> EnvironmentRegistry:
    """The run's environment registry as ``owner`` runs it, with the run file's environments registered
    (idempotent: every replica registers the same)."""
    s = cfg.sampler
    registry = EnvironmentRegistry(
        client,
        cfg.run.run_id,
        owner,
        s.n,
        max_message_bytes=s.env_max_message_bytes,
        breaker=lambda: CircuitBreaker(s.env_failures_to_open, s.env_cooldown_s),
        scorers=known_scorers(cfg.reward.plugins),
        make_env=functools.partial(make_environment, tls=s.env_tls),
    )
    for env in s.environments:
        registry.register(environment_spec(env))
    return registry


def environment_spec(env: EnvironmentConfig) -> registry_pb2.EnvironmentSpec:
    """The registration a run file's environment makes, with its token read now (from the file or variable
    the entry names: the run file holds no secret)."""
    fields = env.model_dump(exclude_defaults=True, exclude={"auth_token_file", "auth_token_env"})
    return registry_pb2.EnvironmentSpec(**fields, auth_token=env.auth_token())


def request_cap(engine: GenerationEngine, configured: int, n: int) -> int:
    """The cap on requests in flight: ``configured`` (``sampler.max_requests_in_flight``), or with 0 the
    engine's batch limit; a ValueError naming the key if no group of ``n`` could ever start."""
    limit = engine.batch_limit
    cap = configured or limit
    if not cap:
        raise ValueError(
            f"{type(engine).__name__} states no batch limit: set sampler.max_requests_in_flight (requests, "
            "i.e. groups in flight x sampler.n)"
        )
    if cap < n:
        source = "sampler.max_requests_in_flight" if configured else "the engine's batch limit"
        raise ValueError(
            f"{source} is {cap}, below sampler.n = {n}: no group could ever start; set "
            f"sampler.max_requests_in_flight to at least {n}"
        )
    if limit and cap > limit:
        log.warning(
            "sampler.max_requests_in_flight = %d exceeds the engine's batch limit %d (vLLM's max_num_seqs): "
            "the rest wait in its queue",
            cap,
            limit,
        )
    return cap
