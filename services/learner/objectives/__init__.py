"""The learner's objectives, one module each, behind a registry keyed by ``learner.objective``.

An objective decides what the loss (``services/learner/vcpo.py``) cannot know alone, and declares it in one
:class:`Objective` named ``OBJECTIVE`` in its module:

- its advantage rule: ``Â`` of every valid trajectory from the rewards grouped by prompt (the baseline);
- whether it needs every trajectory's squared score-gradient norm ``‖∇θ log π(τ_i)‖²`` (then the step runs
  the norm pass of ``grad_norms.py``, and a batch without the norms is refused);
- whether ``std_normalize`` applies (divide by the group's reward std σ_g);
- where its zero-signal rule looks: each group, or the whole batch when the baseline is the batch's;
- its own settings, if any: a pydantic model whose fields (each with a default) are the run file's
  ``[learner.objective_settings]`` table, validated with the config and handed to the rule as
  ``config.settings``;
- its own metrics, if any: names its rule returns beside the loss's, logged and served like them.

Everything else (validity, importance weights, ESS and the step size, aggregation, PPO clipping, the skip
rules) is the loss's and the same for every objective. docs/research/adding-an-objective.md is the guide.

Adding an objective is adding one module here: its file name is its config name (``^[a-z][a-z0-9_]*$``).
The names are read from the package's files without importing them, so validating a config needs no torch;
a module is imported the first time its objective is asked for (:func:`get`), and by the config's validation
only when the run file gives the objective settings to check.

The same file may also stay outside the repository: every directory named in the environment variable
``VCPO_OBJECTIVES_PATH`` (``os.pathsep``-separated) is added to this package's ``__path__``, so its ``.py``
files are objectives exactly as if they were copied here (same names, same imports), and a name that
clashes with another directory's is refused. That is the mechanism Python itself uses for a package spread
over directories, so there is nothing to register: entry points (``importlib.metadata``) were not used
because they need a packaged distribution for what is one file. It lets a user of an installed copy or an
image add an objective without editing it (the variable must then be set for every process that validates
the config or runs a learner rank), and lets the tests prove the drop-in without writing into the package.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ValidationError

from services.learner.metric_names import BASELINE_KEYS, LEARNER_KEYS

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig

NAME_PATTERN = r"^[a-z][a-z0-9_]*$"  # an objective's (and an objective metric's) name; the Helm schema's too
PATH_ENV = "VCPO_OBJECTIVES_PATH"


def _objective_dirs() -> list[str]:
    """This package's directory, then each directory of ``VCPO_OBJECTIVES_PATH``."""
    extra = [d for d in os.environ.get(PATH_ENV, "").split(os.pathsep) if d]
    missing = [d for d in extra if not Path(d).is_dir()]
    if missing:
        raise ValueError(f"{PATH_ENV} names {missing}, which are not directories")
    return [*__path__, *(str(Path(d).resolve()) for d in extra)]


def _names(dirs: list[str]) -> tuple[str, ...]:
    """Every public module of ``dirs`` (``_name`` modules are helpers); refuses bad and duplicate names."""
    seen: dict[str, str] = {}
    for directory in dirs:
        for module in pkgutil.iter_modules([directory]):
            if module.name.startswith("_"):
                continue
            where = os.path.join(directory, module.name)
            if not re.match(NAME_PATTERN, module.name):
                raise ValueError(f"objective module {where}: its name must match {NAME_PATTERN}")
            if module.name in seen:
                raise ValueError(
                    f"objective {module.name!r} is defined twice: in {seen[module.name]} and {where}"
                )
            seen[module.name] = where
    return tuple(sorted(seen))


__path__ = _objective_dirs()
NAMES: tuple[str, ...] = _names(__path__)


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
        sets: its objective's declared ``metrics`` and ``summed_metrics``, and of the loss's keys only
        ``baseline_shift_mean_abs`` and ``baseline_fallbacks``."""
        ...


def _metric_names(owner: str, field: str, names: object) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, tuple | list):
        raise ValueError(f"{owner}: {field} must be a tuple of names, got {names!r}")
    for name in names:
        if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
            raise ValueError(f"{owner}: metric name {name!r} in {field} must match {NAME_PATTERN}")
        if name in LEARNER_KEYS:
            raise ValueError(f"{owner}: metric {name!r} in {field} is one of the learner's own metrics")
    return tuple(names)


@dataclass(frozen=True)
class Objective:
    """What one objective declares; the loss asks it instead of comparing names."""

    name: str  # its module's name, the value of ``learner.objective``
    advantages: AdvantageRule
    needs_sq_grad_norms: bool = False  # its baseline weighs trajectories by their squared gradient norms
    std_normalize: bool = False  # ``std_normalize`` divides its advantages by σ_g
    zero_signal: Literal["group", "batch"] = "group"  # equal rewards (or one member) there give Â = 0
    # its settings: a pydantic model whose fields, each with a default, are ``[learner.objective_settings]``
    settings: type[BaseModel] | None = None
    # metrics its rule returns: averaged over ranks weighted by their valid trajectories (a mean per
    # trajectory), and counts, added up over ranks
    metrics: tuple[str, ...] = ()
    summed_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        owner = f"objective {self.name!r}"
        metrics = _metric_names(owner, "metrics", self.metrics)
        summed = _metric_names(owner, "summed_metrics", self.summed_metrics)
        both = sorted(set(metrics) & set(summed))
        if both or len(set(metrics)) < len(metrics) or len(set(summed)) < len(summed):
            raise ValueError(
                f"{owner}: a metric is declared twice in metrics {metrics} and summed_metrics {summed}"
            )
        object.__setattr__(self, "metrics", metrics)
        object.__setattr__(self, "summed_metrics", summed)
        model = self.settings
        if model is None:
            return
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ValueError(f"{owner}: settings must be a pydantic model class, got {model!r}")
        required = sorted(k for k, f in model.model_fields.items() if f.is_required())
        if (
            required
        ):  # an empty [learner.objective_settings] is never checked at config time: it must be valid
            raise ValueError(f"{owner}: every setting needs a default, and {required} have none")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric name the rule may set: its own, then the baseline keys of the loss's."""
        return (*self.metrics, *self.summed_metrics, *BASELINE_KEYS)


@cache
def get(name: str) -> Objective:
    """The registered objective called ``name``; ``ValueError`` naming the choices for any other name."""
    if name not in NAMES:
        raise ValueError(f"unknown objective {name!r}; choices: {list(NAMES)}")
    objective = getattr(importlib.import_module(f"{__name__}.{name}"), "OBJECTIVE", None)
    if not isinstance(objective, Objective):
        raise ValueError(f"the module of objective {name!r} must define OBJECTIVE = Objective(...)")
    if objective.name != name:
        raise ValueError(f"objectives/{name}.py declares an objective named {objective.name!r}")
    return objective


def settings_of(name: str, table: Mapping[str, Any], key: str = "learner.objective_settings") -> Any:
    """``table`` validated against objective ``name``'s settings model (an instance of it), or None for an
    objective that declares none; ``ValueError`` naming ``key.<setting>`` and the objective otherwise.

    An objective without settings refuses a non-empty table, and unknown keys are refused whatever the
    model's own ``extra`` setting says."""
    model = get(name).settings
    if model is None:
        if table:
            raise ValueError(
                f"{key}: objective {name!r} has no settings (its OBJECTIVE declares no settings model), "
                f"got {sorted(table)}"
            )
        return None
    unknown = sorted(k for k in table if k not in model.model_fields)
    if unknown:
        raise ValueError(
            f"{key}.{unknown[0]} is not a setting of objective {name!r}; its settings: {sorted(model.model_fields)}"
        )
    try:
        return model.model_validate(dict(table))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, (key, *err['loc'])))} = {err.get('input')!r}: {err['msg']}"
            for err in e.errors()
        )
        raise ValueError(f"objective {name!r}: {problems}") from None
