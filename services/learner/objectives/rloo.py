"""RLOO's advantage: the reward minus the mean of the other members of its group (leave one out); never
divided by σ_g; a group whose rewards are all equal (or that has one member) gets ``Â = 0``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.learner.objectives import AdvantageInputs, Objective

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig


def advantages(inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
    import torch  # here, not at the top: validating a config imports this module and needs no torch

    from services.learner.ops import seg_sum

    r, inv, count = inputs.rewards, inputs.groups, inputs.count
    return r - (seg_sum(r, inv, inputs.n_groups)[inv] - r) / torch.clamp(count[inv] - 1, min=1), {}


OBJECTIVE = Objective("rloo", advantages)
