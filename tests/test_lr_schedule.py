"""learner.lr_decay: the base rate of each step (services/learner/lr_schedule.py) and its config checks."""

from __future__ import annotations

import itertools
import math

import pytest
from pydantic import ValidationError

from services.learner.config import LearnerConfig
from services.learner.lr_schedule import lr_factor


def test_constant_keeps_the_base_rate_whatever_the_step() -> None:
    assert [lr_factor(t, "constant", 0, 0.0) for t in (0, 1, 10**6)] == [1.0, 1.0, 1.0]


def test_linear_falls_evenly_to_the_floor_and_stays_there() -> None:
    got = [lr_factor(t, "linear", 4, 0.2) for t in range(7)]
    assert got == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2])


def test_cosine_starts_flat_halves_at_the_middle_and_ends_on_the_floor() -> None:
    assert lr_factor(0, "cosine", 100, 0.0) == 1.0
    assert lr_factor(50, "cosine", 100, 0.0) == pytest.approx(0.5)
    assert lr_factor(25, "cosine", 100, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(100, "cosine", 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(500, "cosine", 100, 0.1) == pytest.approx(0.1)
    falls = [lr_factor(t, "cosine", 100, 0.1) for t in range(101)]
    assert all(a >= b for a, b in itertools.pairwise(falls))


def test_bad_arguments_name_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="lr_decay must be one of"):
        lr_factor(0, "step", 10, 0.0)
    with pytest.raises(ValueError, match="needs lr_decay_steps >= 1"):
        lr_factor(0, "linear", 0, 0.0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_factor(-1, "linear", 10, 0.0)
    with pytest.raises(ValueError, match="lr_min_ratio must be in"):
        lr_factor(0, "linear", 10, 1.5)


def test_the_config_rejects_a_decay_without_steps_and_a_floor_out_of_range() -> None:
    with pytest.raises(ValidationError, match="lr_decay = 'cosine' needs lr_decay_steps >= 1"):
        LearnerConfig(lr_decay="cosine")
    with pytest.raises(ValidationError, match="lr_min_ratio"):
        LearnerConfig(lr_decay="linear", lr_decay_steps=10, lr_min_ratio=-0.1)
    with pytest.raises(ValidationError, match="lr_decay"):
        LearnerConfig(lr_decay="exponential", lr_decay_steps=10)
    assert LearnerConfig().lr_decay == "constant"  # no decay unless a run asks for one
