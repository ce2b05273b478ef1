"""The interface every environment implements, in process or behind gRPC, and the errors it raises.

One episode is ``reset`` then ``step`` until done, then ``close``, all under one ``session_id`` chosen by the
sampler. Every call has a deadline (``timeout_s``); an implementation that cannot answer in time raises
:class:`EnvironmentFailure` with reason ``timeout``. A failure is about the environment (it crashed, hung,
answered nonsense), never about the model's action: an action the environment cannot use is answered with an
observation saying so, so the model can learn from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from vcpo.v1 import environment_pb2, rollout_pb2

FAILURE_REASONS = ("timeout", "unavailable", "error", "bad_reply")
"""The ``reason`` labels of :class:`EnvironmentFailure` (bounded: they label a metric)."""


class EnvironmentFailure(RuntimeError):
    """An environment call failed; ``reason`` is one of :data:`FAILURE_REASONS`."""

    def __init__(self, environment: str, reason: str, message: str) -> None:
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown environment failure reason {reason!r}; one of {FAILURE_REASONS}")
        super().__init__(f"environment {environment!r}: {reason}: {message}")
        self.environment, self.reason, self.message = environment, reason, message

    def __reduce__(self) -> tuple[type[EnvironmentFailure], tuple[str, str, str]]:
        return (type(self), (self.environment, self.reason, self.message))


class Environment(ABC):
    """A tool-use environment: the protocol's three calls plus a health check. Thread-safe: the sampler calls
    it from a pool of threads, many sessions at once."""

    name: str

    @abstractmethod
    def reset(
        self, session_id: str, task: rollout_pb2.Task, timeout_s: float
    ) -> environment_pb2.ResetResponse:
        """Start an episode of ``task``: the initial observation (may be empty) and the tools on offer."""

    @abstractmethod
    def step(
        self, session_id: str, action: environment_pb2.Action, timeout_s: float
    ) -> environment_pb2.StepResponse:
        """Apply the model's action: the observation, a reward, and whether the episode is over."""

    @abstractmethod
    def close(self, session_id: str, timeout_s: float) -> None:
        """End the episode and free what it holds (called once per session, also after a failure)."""

    def healthy(self, timeout_s: float) -> bool:
        """Whether it answers health checks (a built-in in this process always does)."""
        return True

    def health_problem(self, timeout_s: float) -> str | None:
        """None when :meth:`healthy`, else what came back instead, worded for the person who registered it; ""
        when nothing more than "not healthy" is known."""
        return None if self.healthy(timeout_s) else ""

    def shutdown(self) -> None:  # noqa: B027 (optional: most environments hold nothing to release)
        """Release connections and processes (the registry calls it when the environment is replaced)."""
