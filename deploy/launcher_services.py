"""The services of one run: the order they start in, what each start waits for, and how each one stops.

Start-up order (:meth:`Services.up`):

    Redis ─► Ray ─► the run fits the cluster, its nodes' run_dir and /dev/shm (deploy/preflight*.py) ─► model
    + config.resolved.json ─► streams and consumer groups (slots of dead samplers given back) ─►

             weight broker ─┬► learner (rank 0 has published its version) ─┬► dedicated evaluator, if any
                            ├► reward (Serve app)                           │  (holds version 0) ─► samplers
                            └► samplers, unless they wait for the evaluator ┴► every sampler replica past
                                                                               STARTING ─► Prometheus targets

The learner, the reward app and the samplers start side by side once the broker is up (each takes seconds
to minutes: DeepSpeed and the model on the ranks, vLLM's engine on the replicas): a replica whose engine is
ready before the learner has published waits for that first version, as it waits for any. The samplers wait
for the learner instead when a dedicated evaluator must hold version 0 before training moves past it, or when
a sampler or a learner rank asks for a fraction of a GPU (they may share one, whose free memory vLLM sizes
its cache from as it starts). ``launcher.sequential_start`` starts each only once the one before is up.

Before anything is downloaded or loaded, a run that cannot fit the Ray cluster (GPUs, CPUs, per node) is
refused, as is a multi-node run whose run_dir a node does not share, or nodes whose /dev/shm cannot stage a
weight version. Each wait polls every 0.5 s up to ``launcher.start_timeout_s`` and names what Ray has not
placed (deploy/launcher_waits.py); a stop request (Ctrl-C) meanwhile goes straight to stopping. The
stops are one method per service (``stop_*``), in the order the launcher calls them: evaluator, samplers,
reward, learner (which checkpoints), broker, Ray, Redis. A stop that waits on the service's run gives it
``launcher.stop_timeout_s`` and logs, rather than raises, a failure: the run is stopping anyway.

Nothing here sits in the data path: the services talk over Redis streams and gRPC; these are their handles.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from deploy.config import SystemConfig, section
from deploy.launcher_restarts import LauncherMetrics
from deploy.launcher_setup import init_ray, prepare_model, with_ports_and_redis
from deploy.launcher_starting import Starting
from deploy.launcher_stopping import Stopping, learner_checkpoint_bytes, learner_stop_wait
from deploy.launcher_waits import Waits
from deploy.metrics_log import MetricsLog
from deploy.preflight import preflight_cluster
from deploy.preflight_nodes import NodeChecks
from deploy.targets import prometheus_targets, write_prometheus_targets
from services.common.admission import AdmissionCounter
from services.common.clock import RunClock
from services.common.config import write_resolved
from services.common.redis_server import LocalRedis
from services.common.starts import clear as clear_starts
from services.common.streams.consumer import StreamConsumer
from services.common.streams.specs import StreamSpec, connect, stream_specs
from services.learner.checkpoints import committed_step

log = logging.getLogger("vcpo.launch")


class Services(Waits):
    """Handles to the run's services (actors, their runs, the Serve app, the local Redis) and the state the
    launcher keeps about them: the config as resolved at start-up, the launcher's own restarts, and
    ``summary``, the run's summary.json, to which each stop adds its service's last figures."""

    client: redis.Redis  # set by up(), with the streams' specs
    specs: dict[str, StreamSpec[Any]]

    def __init__(self, cfg: SystemConfig, stopping: Stopping, summary: dict[str, Any], t0: float) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run.run_dir
        self.stopping = stopping
        self.summary = summary
        self.t0 = t0  # when the launcher started (the clock of the start-up lines)
        self.local_redis: LocalRedis | None = None
        self.broker: Any = None
        self.learner: Any = None
        self.learner_watch: Any = None  # a RankWatch (services.learner.ray_group): is a rank hung?
        self.reward_up = False
        self.reward_start: Starting | None = None  # the reward app's deployment, on a thread of its own
        self.samplers: list[Any] = []
        self.sampler_runs: list[Any] = []
        self.evaluator: Any = None  # the dedicated evaluator's actor, when there is one
        self.evaluator_run: Any = None
        self.metrics: LauncherMetrics | None = None
        self.metrics_log: MetricsLog | None = None
        self.redis_failure: str | None = None  # the local redis-server died for good (its restarts spent)
        self.broker_metrics_url = ""
        self.restarts: Counter[str] = Counter()  # restarts the launcher made (learner, redis)

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

    def say(self, name: str, detail: str) -> None:
        print(f"  [ok] {name:<14} {detail}  ({time.monotonic() - self.t0:.1f}s)", flush=True)

    # ------------------------------------------------------------------ up
    def up(self) -> None:
        """Start every service, in the order the module docstring draws; each start waits for the last."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resuming = self.checkpoint_version() > 0
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
        self.say("redis", where)
        self.say("ray", init_ray(self.cfg))
        self.stopping.install()  # again: ray.init puts its own SIGTERM handler in place of ours
        # before any model is downloaded or loaded: a run the cluster cannot hold is refused in seconds
        self.say("cluster", preflight_cluster(cfg))
        nodes = NodeChecks(cfg)
        for name, line in (("nodes", nodes.run()), ("staging", nodes.check_staging(cfg.run.model))):
            if line:
                self.say(name, line)

        cfg, what = prepare_model(with_ports_and_redis(cfg, url))
        self.cfg = cfg
        self.say("model", what)
        if line := nodes.check_staging(cfg.run.model):  # a model sized only once it is here
            self.say("staging", line)
        self.say("config", str(write_resolved(cfg, self.run_dir)))

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
        self.say(
            "streams",
            ", ".join(s.key for s in self.specs.values())
            + (f"; {returned} admission slot(s) of stopped samplers given back" if returned else ""),
        )

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
        self.say(
            "weight_broker",
            f"gRPC {ends['advertise_host']}:{ends.get('grpc_port')} ({cfg.weight_broker.transport}; node "
            f"{ends.get('host')})",
        )

        sequential = cfg.launcher.sequential_start
        ev = cfg.evaluation
        dedicated = bool(ev.sets) and ev.placement == "dedicated"
        self.begin_learner()
        if sequential:
            self.learner_up()
        self.reward_up = True  # from here on, stopping deletes the app
        self.reward_start = Starting("reward", lambda: deploy_reward(section(cfg, RewardServiceConfig)))
        if not sequential:
            if not dedicated and not _fractional_gpus(cfg):
                self.samplers, self.sampler_runs = start_samplers(
                    section(cfg, SamplerServiceConfig), max_restarts=cfg.launcher.max_restarts
                )
            self.learner_up()
        self.reward_ready()

        if ev.sets:  # before the samplers: a dedicated evaluator holds version 0 before training moves on
            where = "on the sampler replicas' engines (shared)"
            if ev.placement == "dedicated":
                from services.evaluator.ray_actor import start_evaluator

                self.evaluator, self.evaluator_run = start_evaluator(section(cfg, SamplerServiceConfig))
                self.wait_evaluator()
                where = f"by a dedicated evaluator ({ev.gpus:g} GPU)"
            names = ", ".join(f"{s.name} ({s.dataset}, n={s.n})" for s in ev.sets)
            self.say(
                "evaluation",
                f"{names}: every {ev.every} versions {where}; results in {self.run_dir / 'metrics.jsonl'}",
            )

        if not self.samplers:
            self.samplers, self.sampler_runs = start_samplers(
                section(cfg, SamplerServiceConfig), max_restarts=cfg.launcher.max_restarts
            )
        self.wait_samplers()
        self.say(
            "samplers",
            f"{len(self.samplers)} replica(s) generating ({cfg.sampler.dataset or 'tasks stream'})",
        )
        self.say("client api", self.client_api())
        if cfg.agents.enabled:
            self.say("agents", self.agents_file())
        self.scrape_targets()
        self.say("prometheus", f"scrape targets in {self.run_dir / 'prometheus' / 'targets.json'}")

    def start_learner(self, generation: int = 0) -> int:
        """Start the learner group (``generation`` counts its restarts) and wait until rank 0 has published;
        returns the version it published (0, or its checkpoint's after a restart)."""
        self.begin_learner(generation)
        version = self.wait_learner()
        self.watch_learner()
        return version

    def begin_learner(self, generation: int = 0) -> None:
        """Place the learner group's ranks and start them; :meth:`wait_learner` waits for their version."""
        from services.learner.config import LearnerServiceConfig
        from services.learner.ray_group import LearnerGroup

        self.learner_room()  # LearnerGroup waits for its placement group silently: see launcher_waits.py
        self.learner = LearnerGroup(section(self.cfg, LearnerServiceConfig), generation=generation)
        self.learner.start(self.cfg.launcher.max_steps)

    def learner_up(self) -> None:
        version = self.wait_learner()
        self.watch_learner()
        self.say("learner", f"{self.cfg.learner.num_ranks} ZeRO-3 rank(s), version {version} published")

    def reward_ready(self) -> None:
        self.wait_reward()
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # replicas log to <run_dir>/logs
        r = self.cfg.reward
        self.say(
            "reward",
            f"Ray Serve app, {r.min_replicas}..{r.max_replicas} replica(s), default scorer {r.default_scorer!r}",
        )

    def scrape_targets(self, stopped: bool = False) -> None:
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

    def _sampler_endpoints(self) -> list[dict[str, Any]]:
        """What each sampler replica that serves says of itself (its ``*.endpoints.json``)."""
        found = []
        for i in range(self.cfg.sampler.replicas):
            path = self.run_dir / "sampler" / f"sampler-{i}.endpoints.json"
            if path.exists():
                found.append(json.loads(path.read_text()))
        return found

    def _token_source(self) -> str:
        """Where the client API's token is: the run file's setting, or the file holding it."""
        s = self.cfg.sampler
        if s.api_token.get_secret_value():
            return "sampler.api_token"
        return s.api_token_file or str(self.run_dir / "api_token")

    def client_api(self) -> str:
        """Where clients register environments and submit tasks, and which token they need."""
        ports = [str(e["grpc_port"]) for e in self._sampler_endpoints()]
        return (
            f"EnvironmentRegistry on port(s) {', '.join(ports) or '?'}; bearer token: {self._token_source()}"
        )

    def agents_file(self) -> str:
        """Write ``<run_dir>/agents.json`` (where agents claim episodes, and the token they send); returns the
        ``agents`` line."""
        urls = [e["agents_url"] for e in self._sampler_endpoints() if e.get("agents_url")]
        where = self._token_source()
        if where != "sampler.api_token":
            where = str(Path(where).resolve())
        token = {"token_setting": where} if where == "sampler.api_token" else {"token_file": where}
        body = {"base_url": urls[0] if urls else "", "base_urls": urls, **token}
        path = self.run_dir / "agents.json"
        path.write_text(json.dumps(body, indent=2) + "\n")
        return (
            f"OpenAI-compatible API at {', '.join(urls) or '?'} (POST /v1/episodes); token: {where}; {path}"
        )

    def watch_learner(self) -> None:
        timeout = self.cfg.launcher.learner_hang_timeout_s
        self.learner_watch = self.learner.watch(timeout) if timeout and self.learner is not None else None

    def queue_keys(self) -> dict[str, str]:
        """The Redis keys of the two queues the progress line and the ledger count."""
        return {n: self.specs[n].key for n in ("rollouts", "scored")}

    def checkpoints(self) -> Path:
        lr = self.cfg.learner
        return Path(lr.checkpoint_dir) if lr.checkpoint_dir else self.run_dir / "learner" / "checkpoints"

    def checkpoint_version(self) -> int:
        """The step of the checkpoint the learner resumes from (= its version), 0 without one."""
        return committed_step(self.checkpoints())

    # ------------------------------------------------------------------ down
    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def stop_evaluator(self) -> None:
        if self.evaluator is not None:
            self.evaluator.stop.remote()
            self.summary["evaluator"] = _get(
                [self.evaluator_run], self.cfg.launcher.stop_timeout_s, "evaluator"
            )
            self.say("evaluator", "stopped")

    def poll_metrics_log(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.poll()  # the last steps and evaluations (Redis is still up)

    def stop_samplers(self) -> None:
        if self.samplers:
            for a in self.samplers:
                a.stop.remote()
            self.summary["samplers"] = _get(self.sampler_runs, self.cfg.launcher.stop_timeout_s, "samplers")
            self.say("samplers", "stopped; in-flight groups gave their admission slots back")

    def stop_reward(self) -> None:
        if not self.reward_up:
            return
        from ray import serve

        if self.reward_start is not None and not self.reward_start.done(60.0):
            log.warning("the reward app was still deploying after 60 s; deleting it")

        from services.reward.serve_app import APP_NAME

        handle = None
        try:  # one replica's figures (the local run has one); the ledger does not depend on them
            handle = serve.get_app_handle(APP_NAME)
            self.summary["reward"] = handle.summary.remote().result(timeout_s=30)
        except Exception:
            log.warning("no summary from the reward app", exc_info=True)
        finally:
            # the handle's router pushes metrics from a thread of its own; left running past ray.shutdown,
            # its next push started a second local Ray instance (Ray's auto-init) as the launcher exited
            if handle is not None:
                try:
                    handle.shutdown()
                except Exception:  # the app is deleted below all the same
                    log.warning("could not shut the reward app's handle down", exc_info=True)
        serve.delete(APP_NAME)
        self.say("reward", "stopped; groups in hand forwarded")

    def stop_learner(self) -> None:
        if self.learner is None:
            return
        self.learner.stop()
        checkpoint = learner_checkpoint_bytes(self.cfg.run.model, self.checkpoints(), self.cfg.learner.lora)
        wait = learner_stop_wait(self.cfg.launcher.stop_timeout_s, checkpoint)
        print(f"  [..] learner        stopping; waiting up to {wait.detail}", flush=True)
        summaries = _get(self.learner.runs, wait.seconds, "learner") or []
        rank0 = next((s for s in summaries if s.get("rank") == 0), None)
        self.summary["learner"] = rank0
        self.learner.shutdown()
        if rank0:
            self.say("learner", f"checkpoint at step {rank0['step']} (version {rank0['version']})")

    def stop_broker(self) -> None:
        import ray

        if self.broker is not None:
            ray.get(self.broker.stop.remote(), timeout=30)
            ray.kill(self.broker)

    def stop_ray(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # a local Ray stops; a cluster is only disconnected from

    def stop_redis(self) -> None:
        if self.local_redis is not None:
            self.local_redis.stop()


def _fractional_gpus(cfg: SystemConfig) -> bool:
    """A sampler replica or a learner rank asks for part of a GPU: they may share one."""
    return 0 < cfg.sampler.gpus_per_replica < 1 or 0 < cfg.learner.gpus_per_rank < 1


def _get(refs: list[Any], timeout_s: float, what: str) -> list[Any] | None:
    """Results of ``refs``; a failure is logged (the run is stopping anyway), not raised."""
    import ray

    try:
        return list(ray.get(refs, timeout=timeout_s))
    except Exception:
        log.exception("%s did not stop cleanly in %.0fs", what, timeout_s)
        return None
