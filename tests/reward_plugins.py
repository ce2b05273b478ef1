"""Scorers for the reward service's tests, registered as a plugin (config ``reward.plugins``).

They misbehave on purpose: sleep past their time limit, kill their worker, raise, return NaN.
"""

from __future__ import annotations

import os
import time

from services.reward.scorers import Score, ScoreInput, register


@register("test_sleepy")
def sleepy(item: ScoreInput) -> Score:
    """Sleeps ``metadata["sleep_s"]`` seconds, then gives reward 1."""
    time.sleep(float(item.metadata.get("sleep_s", "0")))
    return Score(1.0, {"slept": 1.0})


@register("test_crash")
def crash(item: ScoreInput) -> Score:
    os._exit(3)


@register("test_raise")
def explode(item: ScoreInput) -> Score:
    raise RuntimeError(f"scorer bug on task {item.task_id}")


@register("test_nan")
def not_a_number(item: ScoreInput) -> Score:
    return Score(float("nan"))


@register("test_length")
def length(item: ScoreInput) -> Score:
    return Score(float(len(item.response)))
