"""The whole system on Ray, from one config: up, training with a live progress line, down cleanly, a report.

    up     Ray (run.launcher.ray_address, or a local one sized to the run)
           Redis (run.redis_url, or a local redis-server on a free port, append-only file in <run_dir>/redis)
             └─ the run's streams and consumer groups; admission slots a dead sampler still held are given back
           policy model (run.model, or the tiny model built into <run_dir>/model, + an optional supervised warm
             start into <run_dir>/model-warm) ─► <run_dir>/config.resolved.json, what every actor reads
           weight broker actor ─► learner: num_ranks actors in one placement group (resumes from its latest
             checkpoint, publishes the current version) ─► reward: a Ray Serve app (replicas restarted and scaled
             by Serve) ─► sampler actors (restarted by Ray up to launcher.max_restarts times)
    run    every launcher.progress_interval_s: a progress line + progress.jsonl (deploy/progress.py); stops at
           launcher.max_steps, launcher.max_minutes, Ctrl-C / SIGTERM, or when a service fails for good
    down   samplers (their in-flight groups give their slots back) ─► reward (groups in hand are forwarded)
           ─► learner (stops at the next poll and checkpoints: weights, optimizer and the stream positions)
           ─► ledger.json (deploy/ledger.py) ─► broker, Serve, Ray, Redis ─► report/ (deploy/report.py)
    scrape <run_dir>/prometheus/targets.json, file_sd for deploy/prometheus/prometheus.yml: every live
           replica's /metrics, rewritten when a replica comes back on another port, emptied at the end

Who does what (this module only orders them: up, run, down with every stage even after one failed, report):

    launcher_setup.py      Ray, the broker's ports and the model, before any service starts
    launcher_services.py   each service's start, in the order above, what it waits for, and its stop
    launcher_watch.py      the run's loop: the progress line, the stop conditions
    launcher_restarts.py   restarts by service, and the learner group's restart from its checkpoint
    launcher_stopping.py   Ctrl-C / SIGTERM and the other stop requests
    launcher_summary.py    ledger.json, summary.json and the report

What blocks what: each start-up step waits until its service is ready (a stop request meanwhile skips to
down); the progress loop waits on the stop request between rounds, and a learner restart holds the loop
(not the samplers, which go on generating as far as the lag bound lets them) until the new group has
published its version. Down runs every stage even when one fails, so Ray and Redis never outlive the
launcher; the report is written whatever happened, and a failure is raised after it.

Nothing in the data path goes through Ray: the services talk over Redis streams and gRPC as their plain entry
points do. Ray places the processes and restarts the ones that die. Running the same command on the same run
directory resumes: Redis reloads its append-only file, the learner its checkpoint and the stream positions
in it, so the run neither loses nor double-counts a group.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deploy.config import SystemConfig
from deploy.launcher_restarts import Restarts
from deploy.launcher_services import Services
from deploy.launcher_stopping import Stopping, failure_reason
from deploy.launcher_summary import write_ledger, write_summary_and_report
from deploy.launcher_watch import watch
from deploy.progress import Progress

log = logging.getLogger("vcpo.launch")


class RayLauncher:
    """One run: :meth:`run` brings it up, trains until a stop condition, brings it down and reports."""

    def __init__(self, cfg: SystemConfig) -> None:
        self.stopping = Stopping()
        self.t0 = time.monotonic()
        self.summary: dict[str, Any] = {}  # summary.json: the stops, the restarts and the ledger add to it
        self.services = Services(cfg, self.stopping, self.summary, self.t0)
        self.restarts = Restarts(self.services)
        self.progress: Progress | None = None  # the training loop's, once it began

    @property
    def cfg(self) -> SystemConfig:
        """The config as resolved so far (up() fills in ports, the model and the broker's address)."""
        return self.services.cfg

    def up(self) -> None:
        self.services.up()

    def train(self) -> None:
        """Print progress until a stop condition; raises if the learner or a sampler fails for good."""
        s, la = self.services, self.cfg.launcher
        self.progress = Progress(s.run_dir, s.client, s.queue_keys())
        deadline = self.t0 + la.max_minutes * 60 if la.max_minutes else None
        watch(s, self.restarts, self.progress, deadline)

    def down(self) -> None:
        """Stop every service in order; a stage that fails is logged and the later ones still run, so Ray and
        Redis never outlive the launcher."""
        s = self.services
        stages = [
            ("restarts", self.restarts.count),
            ("evaluator", s.stop_evaluator),
            ("samplers", s.stop_samplers),
            ("reward", s.stop_reward),
            ("learner", s.stop_learner),
            ("ledger", lambda: write_ledger(s, self.progress)),
            ("metrics log", s.poll_metrics_log),
            ("broker", s.stop_broker),
            ("ray", s.stop_ray),
            ("redis", s.stop_redis),
            ("prometheus targets", lambda: s.scrape_targets(stopped=True)),
            ("launcher metrics", s.close_metrics),
        ]
        for name, stage in stages:
            try:
                stage()
            except Exception:
                log.exception("stopping %s failed; going on with the rest", name)
                self.summary.setdefault("stop_errors", []).append(name)

    def run(self) -> int:
        self.stopping.install()
        failed: BaseException | None = None
        try:
            self.up()
            self.train()
        except KeyboardInterrupt:
            self.stopping.stop("interrupted during start-up")
        except BaseException as exc:  # stop everything and still report, then fail
            failed = exc
            self.stopping.stop(f"failed: {failure_reason(exc)}")
            log.exception("the run failed; stopping every service")
        print(f"stopping ({self.stopping.reason or 'done'}) ...", flush=True)
        try:
            self.down()
        finally:
            self.stopping.restore()
        write_summary_and_report(self.services, self.stopping, self.restarts.stalls, self.t0)
        if failed is not None:
            raise failed
        ledger = self.summary.get("ledger")
        return 0 if ledger is None or ledger["balanced"] else 3
