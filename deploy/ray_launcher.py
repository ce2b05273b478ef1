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

Nothing in the data path goes through Ray: the services talk over Redis streams and gRPC as their plain entry
points do. Ray places the processes and restarts the ones that die. Running the same command on the same run
directory resumes: Redis reloads its append-only file, the learner its checkpoint and the stream positions
in it, so the run neither loses nor double-counts a group.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deploy.config import SystemConfig, section
from deploy.ledger import take_ledger
from deploy.metrics_log import MetricsLog
from deploy.progress import Progress, progress_line
from deploy.targets import prometheus_targets, write_prometheus_targets
from services.common.admission import AdmissionCounter
from services.common.clock import RunClock
from services.common.config import write_resolved
from services.common.memory import ALLOCATOR_ENV
from services.common.observability import Metrics, MetricsServer, serve_metrics
from services.common.redis_server import LocalRedis, free_port
from services.common.starts import clear as clear_starts
from services.common.starts import restarts as restarts_by_service
from services.common.streams.consumer import StreamConsumer
from services.common.streams.specs import connect, stream_specs

log = logging.getLogger("vcpo.launch")


def needed_cpus(cfg: SystemConfig) -> int:
    """Logical CPUs the run asks Ray for: a bundle per learner rank, one per sampler and reward replica, and
    one for the broker and Serve's controller, one for a dedicated evaluator."""
    ev = cfg.evaluation
    evaluator = 1 if ev.sets and ev.placement == "dedicated" else 0
    return cfg.learner.num_ranks + cfg.sampler.replicas + cfg.reward.max_replicas + 1 + evaluator


def with_ports_and_redis(cfg: SystemConfig, redis_url: str) -> SystemConfig:
    """Concrete ports instead of 0 for the services that run once (the replicas take free ones themselves),
    and the Redis actually used. The learner's rendezvous port stays as configured: 0 lets rank 0 take a free
    one on its own node, each time the group starts."""
    wb, lr = cfg.weight_broker, cfg.learner
    return cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"redis_url": redis_url}),
            "learner": lr.model_copy(
                update={p: getattr(lr, p) or free_port() for p in ("grpc_port", "metrics_port")}
            ),
            "weight_broker": wb.model_copy(
                update={p: getattr(wb, p) or free_port() for p in ("grpc_port", "data_port", "metrics_port")}
            ),
        }
    )


def prepare_model(cfg: SystemConfig) -> tuple[SystemConfig, str]:
    """The policy every service loads: ``run.model`` (hub id or path), or the tiny model built into the run
    directory; then, with ``launcher.warm_start_steps``, a supervised warm start on the sampler's dataset
    (built once; a resumed run reuses it). Returns the config pointing at it and a description."""
    from services.common.tiny_model import count_parameters, run_model

    base = run_model(cfg.run)
    what = base if cfg.run.model else f"{base} (tiny Qwen2, {count_parameters(base):,} parameters)"
    la = cfg.launcher
    if la.warm_start_steps:
        from services.learner.warm_start import warm_start

        s = cfg.sampler
        out = warm_start(
            base,
            cfg.run.run_dir / "model-warm",
            s.dataset,
            steps=la.warm_start_steps,
            lr=la.warm_start_lr,
            batch_size=la.warm_start_batch_size,
            seed=cfg.run.seed,
            system_prompt=s.system_prompt,
            max_model_len=s.max_model_len,
            prompt_field=s.prompt_field,
            answer_field=s.answer_field,
        )
        what += f", warm-started {la.warm_start_steps} steps on {s.dataset} -> {out}"
        base = str(out)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"model": base})}), what


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


class Stopping:
    """SIGINT/SIGTERM ask the run to stop (once: a second Ctrl-C while stopping is ignored, with a note,
    because cutting the learner's checkpoint short would lose what it consumed)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            print("  (already stopping: waiting for the learner's checkpoint)", flush=True)
            return
        self.stop(signal.Signals(signum).name)

    def stop(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()


class RayLauncher:
    """One run: :meth:`run` brings it up, trains until a stop condition, brings it down and reports."""

    def __init__(self, cfg: SystemConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run.run_dir
        self.stopping = Stopping()
        self.t0 = time.monotonic()
        self.local_redis: LocalRedis | None = None
        self.broker: Any = None
        self.learner: Any = None
        self.reward_up = False
        self.samplers: list[Any] = []
        self.sampler_runs: list[Any] = []
        self.evaluator: Any = None  # the dedicated evaluator's actor, when there is one
        self.evaluator_run: Any = None
        self.metrics_log: MetricsLog | None = None
        self.summary: dict[str, Any] = {}
        self.redis_failure: str | None = None  # the local redis-server died for good (its restarts spent)
        self.broker_metrics_url = ""
        self.restarts: Counter[str] = Counter()  # restarts the launcher made (learner, redis)
        self._learner_failures: list[float] = []  # when the learner failed, for the last 10 minutes' backoff
        self._learner_watch: Any = None  # a RankWatch (services.learner.ray_group): is a rank hung?
        self.stalls: list[dict[str, Any]] = []  # each learner restart: why, from when, how long it stood
        self.metrics: LauncherMetrics | None = None

    # ------------------------------------------------------------------ helpers
    def _redis_restarted(self, code: int, restart: int) -> None:
        self.restarts["redis"] = restart
        assert self.local_redis is not None
        print(
            f"  [!!] redis          redis-server exited ({code}); restarted from its append-only file, pid "
            f"{self.local_redis.process.pid} (restart {restart} of {self.cfg.launcher.max_restarts})",
            flush=True,
        )

    def _redis_lost(self, code: int) -> None:
        self.redis_failure = (
            f"the local redis-server exited ({code}) and its {self.cfg.launcher.max_restarts} "
            "restarts (launcher.max_restarts) are spent"
        )
        self.stopping.stop(self.redis_failure)

    def _say(self, name: str, detail: str) -> None:
        print(f"  [ok] {name:<14} {detail}  ({time.monotonic() - self.t0:.1f}s)", flush=True)

    def _ray(self) -> str:
        import ray

        env = {k: v for k, v in ALLOCATOR_ENV.items() if k not in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        address = self.cfg.launcher.ray_address
        if address:
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
            return f"connected to {address}"
        cpus = max(os.cpu_count() or 1, needed_cpus(self.cfg))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        return f"local Ray, {cpus} logical CPUs (the run needs {needed_cpus(self.cfg)})"

    # ------------------------------------------------------------------ up
    def up(self) -> None:

        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resuming = self._checkpoint_version() > 0
        print(
            f"run {cfg.run.run_id!r}: k={cfg.run.k}, groups_per_step={cfg.run.groups_per_step}, "
            f"run_dir={self.run_dir}" + (" (resuming from its last checkpoint)" if resuming else ""),
            flush=True,
        )
        if cfg.run.redis_url:
            url, where = cfg.run.redis_url, cfg.run.redis_url
        else:
            self.local_redis = LocalRedis(data_dir=self.run_dir / "redis", persistent=True)
            self.local_redis.supervise(cfg.launcher.max_restarts, self._redis_restarted, self._redis_lost)
            url = self.local_redis.url
            where = (
                f"{url} (local redis-server, pid {self.local_redis.process.pid}; append-only file, "
                "fsynced every second; restarted from it if it dies)"
            )
        self.client = connect(url)
        self._say("redis", where)
        self._say("ray", self._ray())
        self.stopping.install()  # again: ray.init puts its own SIGTERM handler in place of ours

        cfg, what = prepare_model(with_ports_and_redis(cfg, url))
        self.cfg = cfg
        self._say("model", what)
        self._say("config", str(write_resolved(cfg, self.run_dir)))

        self.specs = stream_specs(cfg.run, cfg.streams)
        for spec in self.specs.values():
            if spec.mode == "queue":
                StreamConsumer(self.client, spec, "launcher")  # creates the stream and its consumer group
        RunClock(self.client, cfg.run.run_id).set_gpus(cfg.gpus())  # for the GPU-hours of the metrics log
        clear_starts(self.client, cfg.run.run_id)  # this launch counts its own restarts
        self.metrics = LauncherMetrics(cfg.launcher.metrics_port)
        self.metrics_log = MetricsLog(self.run_dir, self.client, cfg.run.run_id)
        admission = AdmissionCounter(self.client, cfg.run.run_id, cfg.run.k, cfg.run.groups_per_step)
        returned = admission.reclaim()  # no sampler runs yet: whatever is still held was held by dead ones
        self._say(
            "streams",
            ", ".join(s.key for s in self.specs.values())
            + (f"; {returned} admission slot(s) of stopped samplers given back" if returned else ""),
        )

        from services.learner.config import LearnerServiceConfig
        from services.learner.ray_group import LearnerGroup
        from services.reward.config import RewardServiceConfig
        from services.reward.serve_app import deploy_reward
        from services.sampler.config import SamplerServiceConfig
        from services.sampler.ray_actor import start_samplers
        from services.weight_broker.config import WeightBrokerServiceConfig
        from services.weight_broker.ray_actor import start_broker

        local_ray = not cfg.launcher.ray_address
        self.broker, ends = start_broker(
            section(cfg, WeightBrokerServiceConfig), local_ray, max_restarts=cfg.launcher.max_restarts
        )
        self.broker_metrics_url = str(ends.get("metrics_url", ""))
        # the learner and the samplers reach the broker where it advertises itself (on clusters: its node IP)
        wb = cfg.weight_broker.model_copy(update={"advertise_host": ends["advertise_host"]})
        cfg = self.cfg = cfg.model_copy(update={"weight_broker": wb})
        write_resolved(cfg, self.run_dir)
        self._say(
            "weight_broker",
            f"gRPC {ends['advertise_host']}:{ends.get('grpc_port')} ({cfg.weight_broker.transport}; node "
            f"{ends.get('host')})",
        )

        self.learner = LearnerGroup(section(cfg, LearnerServiceConfig))
        self.learner.start(self.cfg.launcher.max_steps)
        version = self._wait_learner()
        self._watch_learner()
        self._say("learner", f"{cfg.learner.num_ranks} ZeRO-3 rank(s), version {version} published")

        deploy_reward(section(cfg, RewardServiceConfig))
        self.reward_up = True
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # replicas log to <run_dir>/logs
        self._say(
            "reward",
            f"Ray Serve app, {cfg.reward.min_replicas}..{cfg.reward.max_replicas} replica(s), "
            f"default scorer {cfg.reward.default_scorer!r}",
        )

        ev = cfg.evaluation
        if ev.sets:  # before the samplers: a dedicated evaluator holds version 0 before training moves on
            where = "on the sampler replicas' engines (shared)"
            if ev.placement == "dedicated":
                from services.sampler.ray_actor import start_evaluator

                self.evaluator, self.evaluator_run = start_evaluator(section(cfg, SamplerServiceConfig))
                self._wait_evaluator()
                where = f"by a dedicated evaluator ({ev.gpus:g} GPU)"
            names = ", ".join(f"{s.name} ({s.dataset}, n={s.n})" for s in ev.sets)
            self._say(
                "evaluation",
                f"{names}: every {ev.every} versions {where}; results in {self.run_dir / 'metrics.jsonl'}",
            )

        self.samplers, self.sampler_runs = start_samplers(
            section(cfg, SamplerServiceConfig), max_restarts=cfg.launcher.max_restarts
        )
        self._wait_samplers()
        self._say(
            "samplers",
            f"{len(self.samplers)} replica(s) generating ({cfg.sampler.dataset or 'tasks stream'})",
        )
        self._say("client api", self._client_api())
        self._scrape_targets()
        self._say("prometheus", f"scrape targets in {self.run_dir / 'prometheus' / 'targets.json'}")

    def _scrape_targets(self, stopped: bool = False) -> None:
        groups = (
            []
            if stopped
            else prometheus_targets(
                self.run_dir,
                self.cfg.run.run_id,
                self.broker_metrics_url,
                self.metrics.url if self.metrics is not None else "",
            )
        )
        write_prometheus_targets(self.run_dir, groups)

    def _client_api(self) -> str:
        """Where clients register environments and submit tasks, and which token they need."""
        s = self.cfg.sampler
        ports = []
        for i in range(s.replicas):
            path = self.run_dir / "sampler" / f"sampler-{i}.endpoints.json"
            if path.exists():
                ports.append(str(json.loads(path.read_text())["grpc_port"]))
        token = (
            "sampler.api_token"
            if s.api_token.get_secret_value()
            else s.api_token_file or str(self.run_dir / "api_token")
        )
        return f"EnvironmentRegistry on port(s) {', '.join(ports) or '?'}; bearer token: {token}"

    def _wait_samplers(self, timeout_s: float = 600.0) -> None:
        """Until every sampler replica has its engine and weights (its status is past STARTING)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done, _ = ray.wait(self.sampler_runs, timeout=0)
            if done:
                ray.get(done)
                raise RuntimeError("a sampler finished before it generated")
            statuses = ray.get([a.status.remote() for a in self.samplers], timeout=60)
            if all(s["state"] != "STARTING" for s in statuses):
                return
            if self.stopping.event.is_set():
                raise KeyboardInterrupt
            time.sleep(0.5)
        raise TimeoutError(
            f"the samplers were not generating after {timeout_s:.0f}s; see {self.run_dir / 'logs'}"
        )

    def _wait_evaluator(self, timeout_s: float = 600.0) -> None:
        """Until the dedicated evaluator has its engine and the version the learner published at start."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done, _ = ray.wait([self.evaluator_run], timeout=0)
            if done:
                ray.get(done)
                raise RuntimeError("the evaluator finished before it evaluated")
            if ray.get(self.evaluator.first_version.remote(), timeout=60) is not None:
                return
            if self.stopping.event.is_set():
                raise KeyboardInterrupt
            time.sleep(0.5)
        raise TimeoutError(
            f"the evaluator was not following the versions after {timeout_s:.0f}s; see "
            f"{self.run_dir / 'logs' / 'evaluator.log'}"
        )

    def _wait_learner(self, timeout_s: float = 600.0) -> int:
        """Until learner rank 0 has published its version at start (0, or its checkpoint's after a restart);
        returns it."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done, _ = ray.wait(self.learner.runs, timeout=0)
            if done:
                ray.get(done)  # a rank that failed at start raises here
                raise RuntimeError("the learner finished before it published a version")
            version = self.learner.started()
            if version is not None:
                return int(version)
            if self.stopping.event.is_set():
                raise KeyboardInterrupt
            time.sleep(0.5)
        raise TimeoutError(
            f"the learner published no version in {timeout_s:.0f}s; see {self.run_dir / 'logs'}"
        )

    def _watch_learner(self) -> None:
        timeout = self.cfg.launcher.learner_hang_timeout_s
        self._learner_watch = self.learner.watch(timeout) if timeout and self.learner is not None else None

    def _queue_keys(self) -> dict[str, str]:
        """The Redis keys of the two queues the progress line and the ledger count."""
        return {n: self.specs[n].key for n in ("rollouts", "scored")}

    def _checkpoints(self) -> Path:
        lr = self.cfg.learner
        return Path(lr.checkpoint_dir) if lr.checkpoint_dir else self.run_dir / "learner" / "checkpoints"

    def _checkpoint_version(self) -> int:
        """The newest checkpoint's step (= the version the learner resumes with), 0 without one."""
        steps = self._checkpoints()
        found = sorted(steps.glob("step*")) if steps.is_dir() else []
        return int(found[-1].name.removeprefix("step")) if found else 0

    # ------------------------------------------------------------------ run
    def train(self) -> None:
        """Print progress until a stop condition; raises if the learner or a sampler fails for good."""
        import ray

        la = self.cfg.launcher
        self.progress = Progress(self.run_dir, self.client, self._queue_keys())
        deadline = self.t0 + la.max_minutes * 60 if la.max_minutes else None
        while not self.stopping.event.wait(la.progress_interval_s):
            evaluation = None
            if self.metrics_log is not None:
                self.metrics_log.poll()
                evaluation = self.metrics_log.latest()
            tokens_per_s, busy_s, abandoned = self._sampler_figures()
            record = self.progress.sample(tokens_per_s, busy_s, evaluation, abandoned)
            print(progress_line(record), flush=True)
            self._scrape_targets()  # a restarted replica serves /metrics on another port
            self._count_restarts()
            done, _ = ray.wait(self.learner.runs, timeout=0)
            if done:
                try:
                    ray.get(done)
                except Exception as exc:  # a rank died or failed (a hung collective times out into this)
                    if self.stopping.event.is_set():
                        raise
                    self._restart_learner(exc)
                    continue
                self.stopping.stop(f"max_steps ({la.max_steps})" if la.max_steps else "learner finished")
            hung = self._learner_watch.check() if self._learner_watch is not None else None
            if hung is not None and not self.stopping.event.is_set():
                self._restart_learner(RuntimeError(hung))
                continue
            done, _ = ray.wait(self.sampler_runs, timeout=0)
            if done:
                ray.get(done)  # a sampler out of restarts raises here
                self.stopping.stop("the samplers finished")
            if self.evaluator_run is not None:
                done, _ = ray.wait([self.evaluator_run], timeout=0)
                if done:
                    ray.get(done)  # raises what failed
                    self.stopping.stop("the evaluator finished")
            if deadline and time.monotonic() > deadline:
                self.stopping.stop(f"max_minutes ({la.max_minutes:g})")
        if self.redis_failure is not None:
            raise RuntimeError(self.redis_failure)

    def _restart_learner(self, failure: BaseException) -> None:
        """Tear the learner group down and start it again from its last checkpoint (with the stream positions
        in it: the new group re-forms the steps the old one took since, from the same groups), after a
        backoff (``launcher.restart_backoff_s`` doubled for each failure of the last 10 minutes); a group that fails again, also while it starts, is restarted again, up to
        ``launcher.max_restarts`` times in all, then the run fails. The samplers go on generating meanwhile,
        as far as the lag bound lets them."""
        from services.learner.config import LearnerServiceConfig
        from services.learner.ray_group import LearnerGroup

        la = self.cfg.launcher
        since = time.monotonic()
        while True:
            self.restarts["learner"] += 1
            n = self.restarts["learner"]
            reason = _first_line(failure)
            if n > la.max_restarts:
                raise RuntimeError(
                    f"the learner failed again after {la.max_restarts} restarts "
                    f"(launcher.max_restarts): {reason}"
                ) from failure
            step = self._checkpoint_version()
            print(
                f"  [!!] learner        {reason}; restarting the group from its checkpoint at step {step} "
                f"(restart {n} of {la.max_restarts})",
                flush=True,
            )
            if self.learner is not None:
                self.learner.shutdown()
                self.learner = None
                self._learner_watch = None
            now = time.monotonic()
            self._learner_failures = [t for t in self._learner_failures if now - t < 600] + [now]
            backoff = min(la.restart_backoff_s * 2 ** (len(self._learner_failures) - 1), 60.0)
            if self.stopping.event.wait(backoff):
                return  # stopping meanwhile: nothing left to stop (the ledger says it has no feed state)
            try:
                self.learner = LearnerGroup(section(self.cfg, LearnerServiceConfig), generation=n)
                self.learner.start(la.max_steps)
                version = self._wait_learner()
                self._watch_learner()
                break
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # the new group failed while it started
                failure = exc
        stood = time.monotonic() - since
        self.stalls.append({"restart": n, "reason": reason, "from_step": step, "seconds": round(stood, 2)})
        if self.metrics is not None:
            self.metrics.stalled.inc(stood)
        self._say(
            "learner",
            f"restarted from its checkpoint at step {step} (version {version}), training "
            f"again {stood:.1f}s after the failure was seen",
        )

    def _count_restarts(self) -> None:
        """Restarts so far, by service (the launcher's own, and those Ray and Serve made: services.common.starts)
        into the metrics, the summary, and a line for each new one."""
        try:
            counted = restarts_by_service(
                self.client, self.cfg.run.run_id, {"reward": self._reward_running()}
            )
        except Exception:
            log.warning("could not count the services' restarts", exc_info=True)
            return
        counted.update(self.restarts)
        before = Counter(self.summary.get("restarts", {}))
        for service, n in counted.items():
            if n > before[service] and service not in self.restarts:
                print(f"  [!!] {service:<14} restarted (restart {n} of this launch)", flush=True)
            if self.metrics is not None and n > before[service]:
                self.metrics.restarts.labels(service).inc(n - before[service])
        self.summary["restarts"] = {s: max(n, before[s]) for s, n in (before | counted).items()}

    def _reward_running(self) -> int:
        """Reward replicas Serve reports running or starting (what its restarts are counted against)."""
        from ray import serve

        from services.reward.serve_app import APP_NAME

        if not self.reward_up:
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

    def _sampler_figures(self) -> tuple[float | None, float | None, float | None]:
        """The replicas' tokens/s, busy seconds and evaluation rounds abandoned so far (None while one is being
        restarted; the last also None when they evaluate nothing)."""
        import ray

        try:
            statuses = ray.get([a.status.remote() for a in self.samplers], timeout=5)
        except Exception:
            return None, None, None
        figures = [s["figures"] for s in statuses]
        abandoned = [f["evaluation_rounds_abandoned"] for f in figures if "evaluation_rounds_abandoned" in f]
        return (
            float(sum(f.get("tokens_per_second", 0.0) for f in figures)),
            float(sum(f.get("busy_seconds", 0.0) for f in figures)),
            float(sum(abandoned)) if abandoned else None,
        )

    # ------------------------------------------------------------------ down
    def down(self) -> None:
        """Stop every service in order; a stage that fails is logged and the later ones still run, so Ray and
        Redis never outlive the launcher."""
        stages = [
            ("restarts", self._count_restarts),
            ("evaluator", self._stop_evaluator),
            ("samplers", self._stop_samplers),
            ("reward", self._stop_reward),
            ("learner", self._stop_learner),
            ("ledger", self._ledger),
            ("metrics log", self._metrics_log),
            ("broker", self._stop_broker),
            ("ray", self._stop_ray),
            ("redis", self._stop_redis),
            ("prometheus targets", lambda: self._scrape_targets(stopped=True)),
            ("launcher metrics", self._close_metrics),
        ]
        for name, stage in stages:
            try:
                stage()
            except Exception:
                log.exception("stopping %s failed; going on with the rest", name)
                self.summary.setdefault("stop_errors", []).append(name)

    def _close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def _stop_evaluator(self) -> None:
        if self.evaluator is not None:
            self.evaluator.stop.remote()
            self.summary["evaluator"] = _get(
                [self.evaluator_run], self.cfg.launcher.stop_timeout_s, "evaluator"
            )
            self._say("evaluator", "stopped")

    def _metrics_log(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.poll()  # the last steps and evaluations (Redis is still up)

    def _stop_samplers(self) -> None:
        if self.samplers:
            for a in self.samplers:
                a.stop.remote()
            self.summary["samplers"] = _get(self.sampler_runs, self.cfg.launcher.stop_timeout_s, "samplers")
            self._say("samplers", "stopped; in-flight groups gave their admission slots back")

    def _stop_reward(self) -> None:
        if not self.reward_up:
            return
        from ray import serve

        from services.reward.serve_app import APP_NAME

        try:  # one replica's figures (the local run has one); the ledger does not depend on them
            handle = serve.get_app_handle(APP_NAME)
            self.summary["reward"] = handle.summary.remote().result(timeout_s=30)
        except Exception:
            log.warning("no summary from the reward app", exc_info=True)
        serve.delete(APP_NAME)
        self._say("reward", "stopped; groups in hand forwarded")

    def _stop_learner(self) -> None:
        if self.learner is None:
            return
        self.learner.stop()
        summaries = _get(self.learner.runs, self.cfg.launcher.stop_timeout_s, "learner") or []
        rank0 = next((s for s in summaries if s.get("rank") == 0), None)
        self.summary["learner"] = rank0
        self.learner.shutdown()
        if rank0:
            self._say("learner", f"checkpoint at step {rank0['step']} (version {rank0['version']})")

    def _stop_broker(self) -> None:
        import ray

        if self.broker is not None:
            ray.get(self.broker.stop.remote(), timeout=30)
            ray.kill(self.broker)

    def _stop_ray(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # a local Ray stops; a cluster is only disconnected from

    def _stop_redis(self) -> None:
        if self.local_redis is not None:
            self.local_redis.stop()

    def _ledger(self) -> None:
        if self.learner is None or not hasattr(self, "specs"):
            return
        if not hasattr(self, "progress"):  # stopped before training began: nothing to account for yet
            self.progress = Progress(self.run_dir, self.client, self._queue_keys())
        self.progress.log.poll()
        feed = (self.summary.get("learner") or {}).get("feed")
        dead = {n: self.specs[n].dead_letter_key for n in ("rollouts", "scored")}
        ledger = take_ledger(
            self.client, self._queue_keys(), dead, feed, self.progress.log.steps, self.cfg.run.k
        )
        self.summary["ledger"] = ledger
        (self.run_dir / "ledger.json").write_text(json.dumps(ledger, indent=2) + "\n")
        verdict = "balanced" if ledger["balanced"] else "NOT balanced: " + "; ".join(ledger["problems"])
        foreign = ledger["rollouts_foreign"] + ledger["scored_foreign"]
        apart = f", {foreign} foreign entries in the queues (counted apart)" if foreign else ""
        self._say(
            "ledger",
            f"{ledger['rollouts_produced']} groups sampled, {ledger.get('trained', 0)} trained, "
            f"max lag {ledger['max_trained_lag']} (k={self.cfg.run.k}){apart}: {verdict}",
        )

    # ------------------------------------------------------------------ all of it
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
            self.stopping.stop(f"failed: {exc}")
            log.exception("the run failed; stopping every service")
        print(f"stopping ({self.stopping.reason or 'done'}) ...", flush=True)
        try:
            self.down()
        finally:
            self.stopping.restore()
        self._report()
        if failed is not None:
            raise failed
        ledger = self.summary.get("ledger")
        return 0 if ledger is None or ledger["balanced"] else 3

    def _report(self) -> None:
        from deploy.report import write_report

        self.summary.update(
            run_id=self.cfg.run.run_id,
            k=self.cfg.run.k,
            groups_per_step=self.cfg.run.groups_per_step,
            wall_s=time.monotonic() - self.t0,
            stopped_by=self.stopping.reason,
            learner_restarts=self.stalls,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        written = write_report(self.run_dir, self.summary)
        print(f"report: {written.markdown} (plots and report.json beside it)", flush=True)


def _get(refs: list[Any], timeout_s: float, what: str) -> list[Any] | None:
    """Results of ``refs``; a failure is logged (the run is stopping anyway), not raised."""
    import ray

    try:
        return list(ray.get(refs, timeout=timeout_s))
    except Exception:
        log.exception("%s did not stop cleanly in %.0fs", what, timeout_s)
        return None


def _first_line(exc: BaseException) -> str:
    """What failed, in one line: the exception's type and its message's first line; for an error raised in
    a Ray task, the remote exception itself (Ray's wrapper starts with the task's name and carries the remote
    traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
