"""The sampler's Prometheus metrics (``vcpo_sampler_*``) and the live figures its Status reports."""

from __future__ import annotations

from services.common.observability import Metrics, WindowRate

ABORT_REASONS = (
    "lag",
    "environment",
    "shutdown",
    "weights_lost",
    "agent_abandoned",
    "agent_expired",
    "agent_invalid",
)
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class SamplerMetrics:
    def __init__(self, metrics: Metrics, replica: str) -> None:
        self.metrics, self.replica = metrics, replica
        r = ["replica"]
        self.version = metrics.gauge("vcpo_sampler_policy_version", "Policy version the engine serves", r)
        self.newest = metrics.gauge(
            "vcpo_sampler_newest_policy_version", "Newest published version the sampler knows of", r
        )
        self.lag = metrics.histogram(
            "vcpo_sampler_group_lag",
            "Newest published version minus a produced group's policy_version_start",
            r,
            buckets=LAG_BUCKETS,
        )
        self.tokens = metrics.counter("vcpo_sampler_generated_tokens_total", "Tokens generated", r)
        self.tokens_per_second = metrics.gauge(
            "vcpo_sampler_tokens_per_second", "Tokens generated per second over the last 30 s", r
        )
        self.groups = metrics.counter("vcpo_sampler_groups_total", "Groups written to the rollouts stream", r)
        self.in_flight = metrics.gauge("vcpo_sampler_groups_in_flight", "Groups being generated", r)
        self.aborted = metrics.counter(
            "vcpo_sampler_groups_aborted_total",
            "Groups given up before they were written, by reason",
            ["replica", "reason"],
        )
        for reason in ABORT_REASONS:  # present from the start, so a rate over them never lacks a series
            self.aborted.labels(replica, reason)
        self.blocked = metrics.counter(
            "vcpo_sampler_admission_blocked_seconds_total",
            "Time the sampler had work but admission control refused it (lag bound reached)",
            r,
        )
        self.refusals = metrics.counter(
            "vcpo_sampler_admission_refusals_total", "Admission requests refused by the lag bound", r
        )
        self.weight_fetch = metrics.histogram(
            "vcpo_sampler_weight_fetch_seconds", "Time to fetch and stage a version (in the background)", r
        )
        self.weight_load = metrics.histogram(
            "vcpo_sampler_weight_load_seconds", "Time generation stopped to load a staged version", r
        )
        self.weight_errors = metrics.counter(
            "vcpo_sampler_weight_load_errors_total", "Versions that could not be loaded", r
        )
        self.weight_versions = metrics.counter(
            "vcpo_sampler_weight_versions_total",
            "Versions loaded, by path: collective (the learner's broadcast) or broker",
            ["replica", "path"],
        )
        self.broadcast_failures = metrics.counter(
            "vcpo_sampler_weight_broadcast_failures_total",
            "Weight-group broadcasts or joins that failed here (the engine kept its version)",
            r,
        )
        for path in ("collective", "broker"):
            self.weight_versions.labels(replica, path)
        self.broadcast_failures.labels(replica)
        self.task_errors = metrics.counter(
            "vcpo_sampler_task_errors_total",
            "Tasks rejected before generation, by reason",
            ["replica", "reason"],
        )
        self.unauthenticated = metrics.counter(
            "vcpo_sampler_unauthenticated_total", "Client calls refused for a missing or wrong API token", r
        )
        e = ["replica", "environment"]
        self.env_episodes = metrics.counter(
            "vcpo_sampler_env_episodes_total", "Multi-turn episodes completed, by environment", e
        )
        self.env_turns = metrics.histogram(
            "vcpo_sampler_env_episode_turns",
            "Model turns per completed episode",
            e,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        )
        self.env_failures = metrics.counter(
            "vcpo_sampler_env_failed_groups_total",
            "Groups an environment failed, by environment and reason",
            ["replica", "environment", "reason"],
        )
        self.env_call = metrics.histogram(
            "vcpo_sampler_env_call_seconds",
            "Environment call latency (reset, step)",
            ["replica", "environment", "call"],
        )
        self.env_paused = metrics.gauge(
            "vcpo_sampler_env_paused", "1 while an environment's circuit breaker holds its tasks back", e
        )
        self.agent_breaks = metrics.counter(
            "vcpo_agent_prefix_breaks_total",
            "Agent turns whose prompt did not extend the episode's ids (a new segment starts), by reason",
            ["replica", "reason"],
        )
        self.agent_episodes = metrics.counter(
            "vcpo_agent_episodes_total", "Agent episodes claimed and finished", ["replica", "event"]
        )
        self.agent_turn = metrics.histogram(
            "vcpo_agent_turn_seconds", "Agent API chat completions: request to answer", r
        )
        self.agent_errors = metrics.counter(
            "vcpo_agent_errors_total", "Agent API requests refused, by error code", ["replica", "code"]
        )
        self.rate = WindowRate()

    def add_tokens(self, n: int) -> None:
        if n:
            self.tokens.labels(self.replica).inc(n)
            self.rate.add(n)

    def refresh(self) -> float:
        rate = self.rate.rate()
        self.tokens_per_second.labels(self.replica).set(rate)
        return rate
