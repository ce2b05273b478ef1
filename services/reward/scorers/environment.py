"""The ``environment`` scorer: the reward a tool-use environment returned for the episode.

Multi-turn episodes end with the environment's own verdict (its last ``Step`` reward); the sampler records it
on the trajectory and this scorer passes it on. A trajectory without one cannot be judged here.
"""

from __future__ import annotations

import math

from services.reward.scorers.base import Score, ScoreInput, ScorerError, register


@register("environment")
def environment_reward(item: ScoreInput) -> Score:
    if item.environment_reward is None:
        raise ScorerError(
            "no_environment_reward",
            f"task {item.task_id!r}: the environment returned no reward for this trajectory",
        )
    value = float(item.environment_reward)
    if not math.isfinite(value):
        raise ScorerError("nonfinite_reward", f"task {item.task_id!r}: environment reward {value}")
    return Score(value)
