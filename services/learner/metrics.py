"""The learner's Prometheus metrics (rank 0 serves them): what each step, publish and consumed group records.

The step's metrics dictionary (``StepResult.metrics``) becomes gauges (:data:`GAUGES`), the quantiles of
its log importance weights (:data:`QUANTILES`) and the objective's own metrics (one gauge, labelled by the
name its ``OBJECTIVE`` declares, so any objective's are served without a change here); every scored group
consumed is counted as trained, dropped by lag or rejected by reason, and its lag observed; each phase of the
loop (wait, gradient, optimizer, publish, checkpoint) is timed; each version is counted by the path it was
published on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.observability import Metrics
from services.learner.batching import REJECT_REASONS
from services.learner.metric_names import objective_metrics

if TYPE_CHECKING:
    from services.learner.feed import Offered
    from services.learner.trainer import StepResult

GAUGES = {  # step metric -> (gauge name, help)
    "ess": ("vcpo_learner_ess", "Effective sample size of the last step's importance weights"),
    "ess_ratio": (
        "vcpo_learner_ess_ratio",
        "ESS over the number of valid trajectories (rho) of the last step",
    ),
    "lr_scale": ("vcpo_learner_lr_scale", "Learning-rate scale s(rho) applied to the last step"),
    "lr": ("vcpo_learner_lr", "Learning rate of the last step"),
    "grad_norm": ("vcpo_learner_grad_norm", "Global gradient norm of the last step, before clipping"),
    "loss": ("vcpo_learner_loss", "Policy loss of the last step"),
    "baseline_shift_mean_abs": (
        "vcpo_learner_opob_shift",
        "Mean |OPOB baseline - group mean reward| of the last step",
    ),
    "frac_truncated": ("vcpo_learner_truncated_fraction", "Share of trajectories whose weight was truncated"),
    "advantage_abs_mean": ("vcpo_learner_advantage_abs_mean", "Mean |advantage| of the last step"),
    "recompute": (
        "vcpo_learner_recompute",
        "1 when the last step ran the recompute memory path (a second forward per micro-batch), 0 saved",
    ),
}
QUANTILES = {
    "log_weight_min": "0",
    "log_weight_p50": "0.5",
    "log_weight_p90": "0.9",
    "log_weight_p99": "0.99",
    "log_weight_max": "1",
}


class LearnerMetrics:
    """The learner's Prometheus metrics (rank 0 serves them)."""

    def __init__(self, metrics: Metrics, k: int) -> None:
        self.version = metrics.gauge("vcpo_learner_policy_version", "Policy version of the current weights")
        self.steps = metrics.counter("vcpo_learner_steps_total", "Optimizer steps taken by this process")
        self.skipped = metrics.counter("vcpo_learner_steps_skipped_total", "Steps skipped by the VCPO guard")
        self.gauges = {key: metrics.gauge(name, doc) for key, (name, doc) in GAUGES.items()}
        self.log_weight = metrics.gauge(
            "vcpo_learner_log_weight",
            "Quantiles of the last step's sequence log importance weights",
            ["quantile"],
        )
        self.objective = metrics.gauge(
            "vcpo_learner_objective_metric",
            "The objective's own metrics of the last step, by the name its OBJECTIVE declares",
            ["metric"],
        )
        self.staleness = metrics.histogram(
            "vcpo_learner_staleness_versions",
            "Lag t - policy_version_start of every scored group consumed (trained or dropped)",
            buckets=[float(b) for b in range(max(k, 1) + 2)] + [float(k + 4), float(k + 8)],
        )
        self.trained = metrics.counter("vcpo_learner_groups_trained_total", "Scored groups trained on")
        self.dropped = metrics.counter(
            "vcpo_learner_groups_dropped_total", "Scored groups never trained on, by cause", ["cause"]
        )
        for cause in ("lag", *REJECT_REASONS):
            self.dropped.labels(cause)
        self.phase = metrics.histogram(
            "vcpo_learner_phase_seconds",
            "Time of each phase of the learner's loop: wait (reading scored groups), gradient, optimizer, "
            "publish, checkpoint",
            ["phase"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.tokens = metrics.counter("vcpo_learner_tokens_total", "Tokens (prompt + response) trained on")
        self.tokens_per_second = metrics.gauge("vcpo_learner_tokens_per_second", "Tokens/s of the last step")
        self.reward_mean = metrics.gauge(
            "vcpo_learner_reward_mean", "Mean reward of the trajectories the last step trained on"
        )
        self.published = metrics.counter(
            "vcpo_learner_versions_published_total",
            "Publishes, by path: collective (broadcast into the weight group) or broker (a version whose "
            "broadcast failed and was republished through the broker counts under both)",
            ["path"],
        )
        self.group_events = metrics.counter(
            "vcpo_weight_group_events_total",
            "The collective transport's weight group: formed, form_failed, broadcast_failed",
            ["event"],
        )
        for event in ("formed", "form_failed", "broadcast_failed"):
            self.group_events.labels(event)
        self.group_epoch = metrics.gauge("vcpo_weight_group_epoch", "Epoch of the weight group (0: none)")

    def offered(self, items: list[Offered]) -> None:
        for o in items:
            if o.outcome == "rejected":
                self.dropped.labels(o.reason).inc()
                continue
            self.staleness.observe(o.lag)
            if o.outcome == "dropped":
                self.dropped.labels("lag").inc()
            else:
                self.trained.inc()

    def step(self, result: StepResult, publish_s: float) -> None:
        m = result.metrics
        self.version.set(result.version)
        self.steps.inc()
        if m["step_skipped"]:
            self.skipped.inc()
        for key, gauge in self.gauges.items():
            gauge.set(m[key])
        for key, q in QUANTILES.items():
            self.log_weight.labels(q).set(m[key])
        for key, value in objective_metrics(m).items():
            self.objective.labels(key).set(value)
        for phase in ("gradient", "optimizer"):
            self.phase.labels(phase).observe(result.timings[f"{phase}_s"])
        self.phase.labels("publish").observe(publish_s)
        self.tokens.inc(result.timings["tokens_all_ranks"])
        self.tokens_per_second.set(result.timings["tokens_all_ranks"] / max(result.timings["step_s"], 1e-9))
