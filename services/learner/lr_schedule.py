"""The base learning rate of each learner step: η₀ (``learner.lr``), decayed over ``learner.lr_decay_steps``.

    factor(t) = 1                                           lr_decay = "constant"
              = m + (1 − m) · (1 − min(t, T) / T)           lr_decay = "linear"
              = m + (1 − m) · ½ (1 + cos(π · min(t, T) / T)) lr_decay = "cosine"

where ``t`` is the number of optimizer steps already taken (the first step trains at η₀), ``T`` is
``lr_decay_steps`` and ``m`` is ``lr_min_ratio``: after ``T`` steps the rate stays at ``m · η₀``. The ESS rule
(``ess.lr_scale``) then scales this base rate for the one step it is applied to, so VCPO's damping is relative
to the schedule, not to η₀.

Why a decay at all: with a constant rate AdamW's steps keep their size while the gradient's signal shrinks, so
late in a run the policy wanders around what it learnt. On the local preset's task, replayed in one process at
lag 4 (``python experiments/lr_decay.py``: four seeds, 700 steps), the preset's linear decay to a tenth over
1400 steps ended above the constant rate on every seed: held-out mean@4 0.455 on average against 0.423
(docs/benchmarks.md, "Why the local preset decays its learning rate").

The step count is the learner's own (checkpointed with it), so a resumed or restarted learner continues the
schedule where it stopped.
"""

from __future__ import annotations

import math
from typing import Literal

LrDecay = Literal["constant", "linear", "cosine"]
LR_DECAYS: tuple[LrDecay, ...] = ("constant", "linear", "cosine")


def lr_factor(step: int, decay: str, decay_steps: int, min_ratio: float) -> float:
    """The fraction of η₀ the optimizer step after ``step`` steps trains at (module docstring)."""
    if decay not in LR_DECAYS:
        raise ValueError(f"lr_decay must be one of {list(LR_DECAYS)}, got {decay!r}")
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0, got {step}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"lr_min_ratio must be in [0, 1], got {min_ratio!r}")
    if decay == "constant":
        return 1.0
    if decay_steps < 1:
        raise ValueError(f"lr_decay {decay!r} needs lr_decay_steps >= 1, got {decay_steps}")
    done = min(step, decay_steps) / decay_steps
    left = 1.0 - done if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return min_ratio + (1.0 - min_ratio) * left
