"""The launcher's loop while the run trains: a progress line every ``launcher.progress_interval_s``, and the
watch over the services that ends the run or restarts the learner.

Each round, in order: poll the metrics log (the latest held-out accuracy), ask the samplers for their
figures (5 s at most), sample and print the progress line (deploy/progress.py, also progress.jsonl),
rewrite the Prometheus targets (a restarted replica serves ``/metrics`` on another port), count restarts;
then look at the services. What it decides:

- the learner's run ending with an error (a rank died, or a hung collective timed out into it), or its
  RankWatch seeing a hung rank, restarts the group (deploy/launcher_restarts.py), unless the run is
  already stopping; the restart blocks this loop, not the samplers, which go on generating as far as the
  lag bound lets them; the learner's run ending cleanly stops the run (``max_steps``);
- a sampler's or the dedicated evaluator's run ending stops the run, raising what failed (a sampler's run
  fails only once Ray's restarts of it are spent);
- ``launcher.max_minutes`` since the launcher started stops the run; the loop ends at the first stop
  request (it waits on ``Stopping.event`` between rounds), and raises if the local Redis died for good.
"""

from __future__ import annotations

import time
from typing import Any

from deploy.launcher_restarts import Restarts
from deploy.launcher_services import Services
from deploy.progress import Progress, progress_line


def watch(services: Services, restarts: Restarts, progress: Progress, deadline: float | None) -> None:
    """Print progress until a stop condition; raises if the learner or a sampler fails for good."""
    import ray

    s = services
    la = s.cfg.launcher
    while not s.stopping.event.wait(la.progress_interval_s):
        evaluation = None
        if s.metrics_log is not None:
            s.metrics_log.poll()
            evaluation = s.metrics_log.latest()
        tokens_per_s, busy_s, abandoned = sampler_figures(s.samplers)
        record = progress.sample(tokens_per_s, busy_s, evaluation, abandoned)
        print(progress_line(record), flush=True)
        s.scrape_targets()  # a restarted replica serves /metrics on another port
        restarts.count()
        done, _ = ray.wait(s.learner.runs, timeout=0)
        if done:
            try:
                ray.get(done)
            except Exception as exc:  # a rank died or failed (a hung collective times out into this)
                if s.stopping.event.is_set():
                    raise
                restarts.restart_learner(exc)
                continue
            s.stopping.stop(f"max_steps ({la.max_steps})" if la.max_steps else "learner finished")
        hung = s.learner_watch.check() if s.learner_watch is not None else None
        if hung is not None and not s.stopping.event.is_set():
            restarts.restart_learner(RuntimeError(hung))
            continue
        done, _ = ray.wait(s.sampler_runs, timeout=0)
        if done:
            ray.get(done)  # a sampler out of restarts raises here
            s.stopping.stop("the samplers finished")
        if s.evaluator_run is not None:
            done, _ = ray.wait([s.evaluator_run], timeout=0)
            if done:
                ray.get(done)  # raises what failed
                s.stopping.stop("the evaluator finished")
        if deadline and time.monotonic() > deadline:
            s.stopping.stop(f"max_minutes ({la.max_minutes:g})")
    if s.redis_failure is not None:
        raise RuntimeError(s.redis_failure)


def sampler_figures(samplers: list[Any]) -> tuple[float | None, float | None, float | None]:
    """The replicas' tokens/s, busy seconds and evaluation rounds abandoned so far (None while one is being
    restarted; the last also None when they evaluate nothing)."""
    import ray

    try:
        statuses = ray.get([a.status.remote() for a in samplers], timeout=5)
    except Exception:
        return None, None, None
    figures = [s["figures"] for s in statuses]
    abandoned = [f["evaluation_rounds_abandoned"] for f in figures if "evaluation_rounds_abandoned" in f]
    return (
        float(sum(f.get("tokens_per_second", 0.0) for f in figures)),
        float(sum(f.get("busy_seconds", 0.0) for f in figures)),
        float(sum(abandoned)) if abandoned else None,
    )
