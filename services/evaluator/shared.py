"""Evaluation as a sampler replica's co-tenant (``[evaluation] placement = "shared"``).

Every replica that loads a due version takes shards of its round (shards.py) into its own engine beside its
training groups (its requests share the engine's batches). It holds newer versions back until its part is
generated, so every response comes from the version named, but at most ``max_delay_s``: past that its part is
abandoned (counted), its shards go back for a replica still serving the version, and the newer version is
loaded, so evaluation never delays training beyond that budget. Scoring
runs on a thread and holds nothing back. The replica finds this module by name
(services/sampler/cotenant.py) and calls :func:`cotenant` with what it lends.
"""

from __future__ import annotations

from services.evaluator.build import make_evaluator
from services.evaluator.evaluator import Evaluator
from services.sampler.cotenant import CotenantFactory, EngineShare


def cotenant(share: EngineShare) -> Evaluator:
    """The run's evaluator in the replica's engine: claims and records under the replica's id, metrics on its
    registry, episodes in its environment registry (the same session budget as training)."""
    return make_evaluator(
        share.cfg,
        share.engine,
        share.encoder,
        share.metrics,
        share.client,
        share.owner,
        "shared",
        share.environments,
    )


_conforms: CotenantFactory = cotenant  # mypy checks here that the evaluator has every hook the loop calls
