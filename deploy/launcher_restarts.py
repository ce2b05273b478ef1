"""Restarts: how many each service has had, and the one the launcher makes itself, the learner group's.

Ray restarts the samplers and the broker, Serve replaces reward replicas, the local redis-server is
restarted by its supervisor (services/common/redis_server.py); each records its starts in Redis
(services/common/starts.py). The launcher's own restarts (learner, redis) are counted in
``Services.restarts``. What this module decides:

- the restarts by service in the run's summary and in ``vcpo_service_restarts_total`` on the launcher's own
  ``/metrics`` never go down (a count read while a replica is being replaced can be lower than the last);
  each new one Ray or Serve made gets a ``[!!]`` line;
- a failed (or hung) learner group is torn down and started again from its last checkpoint after a backoff
  of ``launcher.restart_backoff_s`` doubled for each failure of the last 10 minutes (at most 60 s); a group
  that fails again, also while it starts, is restarted again, up to ``launcher.max_restarts`` restarts in
  all, then the run fails; the seconds it stood still go to ``vcpo_learner_stalled_seconds_total`` and the
  summary's ``learner_restarts``.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from services.common.observability import Metrics, MetricsServer, serve_metrics
from services.common.starts import restarts as restarts_by_service

if TYPE_CHECKING:
    from deploy.launcher_services import Services

log = logging.getLogger("vcpo.launch")

SERVICES = ("learner", "sampler", "reward", "weight_broker", "redis", "evaluator")


class LauncherMetrics:
    """What only the launcher sees, on its own ``/metrics`` (a scrape target like the services'): restarts by
    service, and the seconds the learner stood still while its group was restarted."""

    def __init__(self, port: int = 0) -> None:
        metrics = Metrics("launcher")
        self.restarts = metrics.counter(
            "vcpo_service_restarts_total",
            "Restarts of a service's processes after they died: learner (the whole group, from its checkpoint), "
            "sampler and weight_broker (by Ray), reward (replaced by Serve), redis (the local redis-server)",
            ["service"],
        )
        for service in SERVICES:
            self.restarts.labels(service)
        self.stalled = metrics.counter(
            "vcpo_learner_stalled_seconds_total",
            "Seconds the learner stood still between a failure the launcher saw and its restarted group's "
            "first published version",
        )
        self.server: MetricsServer = serve_metrics(metrics, port=port)

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.close()


class Restarts:
    """Counts the services' restarts and restarts the learner group; ``stalls`` records each learner restart
    (why, from which step, how long the learner stood still) for the summary."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.stalls: list[dict[str, Any]] = []  # each learner restart: why, from when, how long it stood
        self._learner_failures: list[float] = []  # when the learner failed, for the last 10 minutes' backoff

    def restart_learner(self, failure: BaseException) -> None:
        """Tear the learner group down and start it again from its last checkpoint (with the stream positions
        in it: the new group re-forms the steps the old one took since, from the same groups), after a
        backoff (``launcher.restart_backoff_s`` doubled for each failure of the last 10 minutes); a group
        that fails again, also while it starts, is restarted again, up to ``launcher.max_restarts`` times in
        all, then the run fails. The samplers go on generating meanwhile, as far as the lag bound lets
        them."""
        s = self.services
        la = s.cfg.launcher
        since = time.monotonic()
        while True:
            s.restarts["learner"] += 1
            n = s.restarts["learner"]
            reason = first_line(failure)
            if n > la.max_restarts:
                raise RuntimeError(
                    f"the learner failed again after {la.max_restarts} restarts "
                    f"(launcher.max_restarts): {reason}"
                ) from failure
            step = s.checkpoint_version()
            print(
                f"  [!!] learner        {reason}; restarting the group from its checkpoint at step {step} "
                f"(restart {n} of {la.max_restarts})",
                flush=True,
            )
            if s.learner is not None:
                s.learner.shutdown()
                s.learner = None
                s.learner_watch = None
            now = time.monotonic()
            self._learner_failures = [t for t in self._learner_failures if now - t < 600] + [now]
            backoff = min(la.restart_backoff_s * 2 ** (len(self._learner_failures) - 1), 60.0)
            if s.stopping.event.wait(backoff):
                return  # stopping meanwhile: nothing left to stop (the ledger says it has no feed state)
            try:
                version = s.start_learner(generation=n)
                break
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # the new group failed while it started
                failure = exc
        stood = time.monotonic() - since
        self.stalls.append({"restart": n, "reason": reason, "from_step": step, "seconds": round(stood, 2)})
        if s.metrics is not None:
            s.metrics.stalled.inc(stood)
        s.say(
            "learner",
            f"restarted from its checkpoint at step {step} (version {version}), training "
            f"again {stood:.1f}s after the failure was seen",
        )

    def count(self) -> None:
        """Restarts so far, by service (the launcher's own, and those Ray and Serve made: services.common.starts)
        into the metrics, the summary, and a line for each new one."""
        s = self.services
        try:
            counted = restarts_by_service(s.client, s.cfg.run.run_id, {"reward": self.reward_running()})
        except Exception:
            log.warning("could not count the services' restarts", exc_info=True)
            return
        counted.update(s.restarts)
        before = Counter(s.summary.get("restarts", {}))
        for service, n in counted.items():
            if n > before[service] and service not in s.restarts:
                print(f"  [!!] {service:<14} restarted (restart {n} of this launch)", flush=True)
            if s.metrics is not None and n > before[service]:
                s.metrics.restarts.labels(service).inc(n - before[service])
        s.summary["restarts"] = {svc: max(n, before[svc]) for svc, n in (before | counted).items()}

    def reward_running(self) -> int:
        """Reward replicas Serve reports running or starting (what its restarts are counted against)."""
        from ray import serve

        from services.reward.serve_app import APP_NAME

        if not self.services.reward_up:
            return 0
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return 0
        states = [d.replica_states for d in app.deployments.values()]
        return sum(
            n
            for s in states
            for state, n in s.items()
            if str(state) in ("RUNNING", "STARTING") or getattr(state, "value", "") in ("RUNNING", "STARTING")
        )


def first_line(exc: BaseException) -> str:
    """What failed, in one line: the exception's type and its message's first line; for an error raised in
    a Ray task, the remote exception itself (Ray's wrapper starts with the task's name and carries the remote
    traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
