"""REINFORCE's advantage: the reward minus the mean over the step's valid trajectories; never divided by σ_g.

The baseline is the batch's, so the zero-signal rule looks at the batch (all valid rewards equal, or one
valid trajectory, gives ``Â = 0``); its groups are not zeroed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.learner.objectives import AdvantageInputs, Objective

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig


def advantages(inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
    return inputs.rewards - inputs.rewards.mean(), {}


OBJECTIVE = Objective("reinforce", advantages, zero_signal="batch")
