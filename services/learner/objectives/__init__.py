"""The learner's objectives, one module each, behind a registry keyed by ``learner.objective``.

An objective decides what the loss (``services/learner/vcpo.py``) cannot know alone, and declares it in one
:class:`Objective` named ``OBJECTIVE`` in its module:

- its advantage rule: ``Â`` of every valid trajectory from the rewards grouped by prompt (the baseline);
- whether it needs every trajectory's squared score-gradient norm ``‖∇θ log π(τ_i)‖²`` (then the step runs
  the norm pass of ``grad_norms.py``, and a batch without the norms is refused);
- whether ``std_normalize`` applies (divide by the group's reward std σ_g);
- where its zero-signal rule looks: each group, or the whole batch when the baseline is the batch's.

Everything else (validity, importance weights, ESS and the step size, aggregation, PPO clipping, the skip
rules) is the loss's and the same for every objective.

Adding an objective is adding one module here: its file name is its config name. The names are read from
the package's files without importing them, so validating a config needs no torch; a module is imported the
first time its objective is asked for (:func:`get`).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig

# every public module of this package is an objective; ``_name`` modules are helpers
NAMES: tuple[str, ...] = tuple(
    sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
)


@dataclass(frozen=True)
class AdvantageInputs:
    """A step's valid trajectories as an advantage rule sees them: float64, ``[V]`` per trajectory."""

    rewards: Tensor  # [V]
    groups: Tensor  # [V] dense group index in [0, n_groups)
    n_groups: int
    count: Tensor  # [G] valid members per group
    mean: Tensor  # [G] mean reward per group
    log_weights: Tensor  # [V] ℓ, the sequence log importance weight
    lengths: Tensor  # [V] loss tokens per trajectory
    sq_grad_norms: Tensor | None  # [V] ‖∇θ log π(τ_i)‖², when the objective needs them


class AdvantageRule(Protocol):
    def __call__(self, inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
        """``Â`` (float64 ``[V]``, before std-normalisation and the zero-signal rule) and the metrics the rule
        sets (of ``vcpo.METRIC_KEYS``)."""
        ...


@dataclass(frozen=True)
class Objective:
    """What one objective declares; the loss asks it instead of comparing names."""

    name: str  # its module's name, the value of ``learner.objective``
    advantages: AdvantageRule
    needs_sq_grad_norms: bool = False  # its baseline weighs trajectories by their squared gradient norms
    std_normalize: bool = False  # ``std_normalize`` divides its advantages by σ_g
    zero_signal: Literal["group", "batch"] = "group"  # equal rewards (or one member) there give Â = 0


@cache
def get(name: str) -> Objective:
    """The registered objective called ``name``; ``ValueError`` naming the choices for any other name."""
    if name not in NAMES:
        raise ValueError(f"unknown objective {name!r}; choices: {list(NAMES)}")
    objective: Objective = importlib.import_module(f"{__name__}.{name}").OBJECTIVE
    if objective.name != name:
        raise ValueError(f"objectives/{name}.py declares an objective named {objective.name!r}")
    return objective
