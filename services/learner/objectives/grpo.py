"""GRPO's advantage: the reward minus its group's mean, over the group's reward std σ_g with
``std_normalize``; a group whose rewards are all equal (or that has one member) gets ``Â = 0``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.learner.objectives import AdvantageInputs, Objective

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig


def advantages(inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
    return inputs.rewards - inputs.mean[inputs.groups], {}


OBJECTIVE = Objective("grpo", advantages, std_normalize=True)
