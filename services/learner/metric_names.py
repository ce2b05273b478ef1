"""The names of a learner step's metrics, apart from the loss so that reading them needs no torch.

A step's metrics dictionary holds the loss's keys (:data:`METRIC_KEYS`, the same for every objective), then
the keys the trainer adds after the optimizer step (:data:`TRAINER_KEYS`), then the objective's own keys
(its ``OBJECTIVE``'s ``metrics`` and ``summed_metrics``, services/learner/objectives/). The objectives'
registry checks a declared name against these, and the launcher's metrics log and the learner's Prometheus
gauge pick an objective's keys out of a step's dictionary with :func:`objective_metrics`; both run without
the loss module, which imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

METRIC_KEYS = (
    "ess",
    "ess_ratio",
    "lr_scale",
    "log_weight_max",
    "log_weight_min",
    "log_weight_p50",
    "log_weight_p90",
    "log_weight_p99",
    "frac_truncated",
    "baseline_shift_mean_abs",
    "baseline_fallbacks",
    "skipped_empty",
    "skipped_nonfinite",
    "singleton_groups",
    "step_skipped",
    "num_trajectories",
    "num_valid",
    "num_tokens",
    "advantage_abs_mean",
    "ppo_clip_fraction",
    "loss",
)
# the loss's keys an advantage rule may set without declaring them: every baseline has a shift and may fall
# back (each objective module says what these mean for it; 0 where a rule leaves them)
BASELINE_KEYS = ("baseline_shift_mean_abs", "baseline_fallbacks")
TRAINER_KEYS = ("grad_norm", "lr", "recompute")  # set by trainer.Trainer.train_step after the optimizer step
LEARNER_KEYS = frozenset((*METRIC_KEYS, *TRAINER_KEYS))


def objective_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The keys of a step's ``metrics`` that its objective declared (every key the loss and the trainer do
    not set), in the step's order."""
    return {key: value for key, value in metrics.items() if key not in LEARNER_KEYS}
