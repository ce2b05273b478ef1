"""What a sampler replica shares its engine with: a co-tenant whose requests ride in the same engine steps as
the training groups but never become groups. Held-out evaluation is the one there is (``[evaluation]
placement = "shared"``, services/evaluator/shared.py).

    Sampler.tick                                            the co-tenant
      1. weights   a newer version is ready ─► holds()?    True: a round is generating at the loaded
                                                            version; the replica keeps serving it
                   a version applied ──────► offer(v)       may start requests at v (ids it owns)
      3. generate  engine.step() ─► delta ─► owns(id)? ─► absorb(delta)
         then      pump()                                   keep its requests flowing, score, record
      status       figures() / summary()                    merged into the replica's
      shutdown     close()                                  (again when the service closes: a no-op)

The replica decides from its config whether a co-tenant runs on its engine (:func:`cotenant_for`) and lends
it an :class:`EngineShare`; the co-tenant's package builds itself from that. The replica names that package
rather than importing it: the evaluator builds on the sampler (its engine, agent loop and weight sync), and
an import the other way would close a cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from services.common.observability import Metrics
from services.common.prompts import PromptEncoder
from services.sampler.config import SamplerServiceConfig
from services.sampler.engine import GenerationEngine, TokenDelta
from services.sampler.environments.registry import EnvironmentRegistry

SHARED_EVALUATION = "services.evaluator.shared"
"""The module whose ``cotenant(share)`` builds the evaluator a replica runs with ``placement = "shared"``."""


class Cotenant(Protocol):
    """The hooks the sampler loop calls; each runs on the loop's thread, between engine steps."""

    def owns(self, request_id: str) -> bool:
        """Whether a request in the engine is the co-tenant's (its deltas go to :meth:`absorb`)."""
        ...

    def absorb(self, delta: TokenDelta) -> None: ...

    def offer(self, version: int) -> bool:
        """The engine now serves ``version``; True if the co-tenant started work at it."""
        ...

    def holds(self) -> bool:
        """Whether a newer version that is ready must wait before it is loaded (the co-tenant bounds how long)."""
        ...

    def pump(self) -> object:
        """Once per tick, after the engine step."""
        ...

    def figures(self) -> dict[str, float]:
        """Added to the replica's status figures."""
        ...

    def summary(self) -> dict[str, Any]:
        """Added to the replica's summary."""
        ...

    def close(self) -> None:
        """Stop using the engine and release what it holds; a second call does nothing."""
        ...


@dataclass(frozen=True)
class EngineShare:
    """What a replica lends its co-tenant: the engine and what a tenant of it needs beside it."""

    cfg: SamplerServiceConfig  # the run's config as the replica read it ([evaluation] and [reward] included)
    engine: GenerationEngine
    encoder: PromptEncoder  # the replica's chat template and token budgets
    metrics: Metrics  # the replica's registry: the co-tenant's metrics are served on its /metrics
    client: redis.Redis  # the run's Redis
    owner: str  # the replica's id
    environments: EnvironmentRegistry  # the replica's: episodes draw on the same sessions as training's


CotenantFactory = Callable[[EngineShare], Cotenant]


def cotenant_for(share: EngineShare) -> Cotenant | None:
    """The co-tenant the config puts on this replica's engine: the evaluator when ``[evaluation]`` lists sets
    and places them on the samplers (``placement = "shared"``); None otherwise."""
    ev = share.cfg.evaluation
    if not ev.sets or ev.placement != "shared":
        return None
    factory: CotenantFactory = importlib.import_module(SHARED_EVALUATION).cotenant
    return factory(share)
