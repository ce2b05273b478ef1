"""The sampler's Prometheus metrics (``vcpo_sampler_*``) and the live figures its Status reports."""

from __future__ import annotations

import time
from collections import deque

from services.common.observability import Metrics

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class TokenRate:
    """Tokens per second over a sliding window."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0  # tokens in the window: asked for every engine step, so kept, not summed

    def add(self, tokens: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, tokens))
        self._total += tokens

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return self._total / span


class SamplerMetrics:
    def __init__(self, metrics: Metrics, replica: str) -> None:
        self.metrics, self.replica = metrics, replica
        r = ["replica"]
        self.version = metrics.gauge("vcpo_sampler_policy_version", "Policy version the engine serves", r)
        self.newest = metrics.gauge(
            "vcpo_sampler_newest_policy_version", "Newest published version the sampler knows of", r
        )
        self.lag = metrics.histogram(
            "vcpo_sampler_group_lag", "Newest published version minus a produced group's policy_version_start",
            r, buckets=LAG_BUCKETS,
        )  # fmt: skip
        self.tokens = metrics.counter("vcpo_sampler_generated_tokens_total", "Tokens generated", r)
        self.tokens_per_second = metrics.gauge(
            "vcpo_sampler_tokens_per_second", "Tokens generated per second over the last 30 s", r
        )
        self.groups = metrics.counter("vcpo_sampler_groups_total", "Groups written to the rollouts stream", r)
        self.in_flight = metrics.gauge("vcpo_sampler_groups_in_flight", "Groups being generated", r)
        self.aborted = metrics.counter(
            "vcpo_sampler_groups_aborted_total", "Groups given up before they were written, by reason",
            ["replica", "reason"],
        )  # fmt: skip
        self.blocked = metrics.counter(
            "vcpo_sampler_admission_blocked_seconds_total",
            "Time the sampler had work but admission control refused it (lag bound reached)", r,
        )  # fmt: skip
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
        self.task_errors = metrics.counter(
            "vcpo_sampler_task_errors_total",
            "Tasks rejected before generation, by reason",
            ["replica", "reason"],
        )
        self.rate = TokenRate()

    def add_tokens(self, n: int) -> None:
        if n:
            self.tokens.labels(self.replica).inc(n)
            self.rate.add(n)

    def refresh(self) -> float:
        rate = self.rate.rate()
        self.tokens_per_second.labels(self.replica).set(rate)
        return rate
