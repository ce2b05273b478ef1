"""The learner service: every rank's loop from scored groups to published, checkpointed policy versions.

    start (all ranks):  Trainer (ZeRO-3 engine) ─ load the latest checkpoint ─ publish the current version
                        rank 0 also: ScoredFeed.resume, /metrics, gRPC Status + health
    loop:
      rank 0:     feed.poll(version) ─► ("step", groups) | ("idle",) | ("stop",)  ─┐ broadcast to all ranks
                  idle, every 10 s: does the broker still hold the current version? ─► ("republish",)
                  idle: did the current version's broadcast into the weight group fail? ─► ("republish",)
                  idle, every 2 s: a receiver it did not reach (joined since), and the broker lacks it? ─►
                  ("republish",)
      all ranks:  ◄──────────────────────────────────────────────────────────────┘
                  step: place whole groups on ranks ─ train_step ─ publish v+1 (bucketed gathers)
                  every M steps: checkpoint (weights, optimizer, feed state), then rank 0 acknowledges
                  the entries the checkpoint covers
    stop (SIGTERM, --max-steps): a last checkpoint, so nothing consumed is lost

Rank 0 is the only Redis client; "idle" keeps the other ranks answering while the stream is empty, so no
collective ever waits past ``read_block_ms``. The audit log ``<run_dir>/learner/steps.jsonl`` has one line
per step (a step redone after a restart appears again; the last line for a step is the one that counts): its
version, the group ids trained with each one's lag and the version its sampling started from (from which the
lag can be recomputed), the mean reward, the groups consumed but not trained on
since the previous step (dropped by lag or rejected, with why), the step's metrics and phase times. The
launcher's progress line, run report and ledger are built from it.

The pieces it drives: ``trainer.py`` (the ZeRO-3 engine and its step), ``feed.py`` (the scored stream),
``publish.py`` (a version to the broker or into the weight group), ``metrics.py`` (rank 0's Prometheus
metrics), ``servicer.py`` (rank 0's Status call); ``supervisor.py`` and ``ray_group.py`` run the ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from services.common.admission import AdmissionCounter
from services.common.clock import RunClock
from services.common.config import RunConfig
from services.common.observability import GrpcServer, Metrics, MetricsServer, grpc_server, serve_metrics
from services.common.streams.metrics import StreamMetrics
from services.common.streams.specs import connect, stream_specs
from services.common.tiny_model import run_model
from services.learner.batching import place_groups, to_tensors
from services.learner.config import LearnerConfig, LearnerServiceConfig
from services.learner.feed import FeedState, Offered, ScoredFeed
from services.learner.metrics import LearnerMetrics
from services.learner.publish import VersionNotSent, publish_collective, publish_version, rank0_code
from services.learner.servicer import LearnerState, StatusServicer
from services.learner.trainer import Trainer
from services.weight_transport import (
    CollectivePublisher,
    GroupCoordinator,
    TransferFailed,
    WeightTransport,
    coordinator_from_config,
    survive_weight_group_failures,
    transport_from_config,
)
from vcpo.v1 import common_pb2, common_pb2_grpc, rollout_pb2

log = logging.getLogger(__name__)


def checkpoint_dir(learner: LearnerConfig, run: RunConfig) -> Path:
    return Path(learner.checkpoint_dir) if learner.checkpoint_dir else run.run_dir / "learner" / "checkpoints"


def _broadcast(obj: Any) -> Any:
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class LearnerRank:
    """One rank's service loop; rank 0 also owns the feed, the transport, metrics and the status server."""

    def __init__(self, cfg: LearnerServiceConfig, stop: threading.Event | None = None) -> None:
        self.cfg, self.learner, self.run = cfg, cfg.learner, cfg.run
        self.stop = stop or threading.Event()
        collective = cfg.weight_broker.transport == "collective"
        if collective:  # before the trainer makes the process's first NCCL group (DeepSpeed's)
            survive_weight_group_failures()
        self.trainer = Trainer(
            self.learner,
            run_model(self.run),
            seed=self.run.seed,
            broadcast_bucket_bytes=cfg.weight_broker.group_bucket_mb << 20 if collective else 0,
        )
        self.rank, self.world = self.trainer.rank, self.trainer.world_size
        self.ckpt_dir = checkpoint_dir(self.learner, self.run)
        self.status = LearnerState()
        self.feed: ScoredFeed | None = None
        self.transport: WeightTransport | None = None
        self.coordinator: GroupCoordinator | None = None  # rank 0, collective transport: the weight group
        self.collective = collective
        self.metrics: LearnerMetrics | None = None
        self.http: MetricsServer | None = None
        self.server: GrpcServer | None = None
        self.clock: RunClock | None = None  # rank 0: when each version was published (accuracy-vs-time axis)
        self.last_checkpoint_step = 0
        self.audit: Path = self.run.run_dir / "learner" / "steps.jsonl"
        self._offered: list[Offered] = []  # consumed by rank 0 since the last step's audit line
        self._broker_checked = time.monotonic()  # when rank 0 last asked the broker for its latest version
        self._superseded = -1  # versions up to this one are on the broker already (see start)
        # the newest version published through the broker's own path (the broker is not in the weight group,
        # so it holds only these: never a sign it lost the group's newer ones)
        self._given_broker = -1
        # rank 0: the weight group's members when the current version went into it (they hold it, unless its
        # broadcast failed), and when receivers that joined since were last looked for (_joiner_behind)
        self._carried_to: frozenset[str] = frozenset()
        self._joiners_checked = 0.0

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        state = self.trainer.load_checkpoint(self.ckpt_dir)
        self.last_checkpoint_step = self.trainer.step
        if self.rank == 0:
            self._start_rank0(FeedState.from_json(state["feed"]) if state else None)
        if state:
            log.info(
                "rank %d resumed from step %d (version %d)",
                self.rank,
                self.trainer.step,
                self.trainer.version,
            )
        latest = self._broker_latest() if self.rank == 0 else None
        self._superseded = int(_broadcast(-1 if latest is None else latest))
        self._given_broker = self._superseded  # a learner of an earlier start gave it these
        if self._superseded > self.trainer.version:
            log.info(
                "the broker holds versions up to %d, which a failed learner group published after this "
                "checkpoint: the steps up to it are redone without publishing again",
                self._superseded,
            )
        seconds, path = (
            self._publish()
        )  # the current version: v0 at the start, the checkpoint's after a restart
        if self.rank == 0:
            assert self.transport is not None
            where = "the weight group" if path == "collective" else self.transport.where
            if path == "superseded":
                log.info("version %d is on the broker already (%s)", self.trainer.version, where)
            else:
                log.info("version %d published to %s in %.2fs", self.trainer.version, where, seconds)
        self.status.state = common_pb2.ServiceStatus.READY
        self.status.detail = "training"

    def _start_rank0(self, feed_state: FeedState | None) -> None:
        metrics = Metrics("learner")
        self.metrics = LearnerMetrics(metrics, self.run.k)
        self.metrics.version.set(self.trainer.version)
        spec = stream_specs(self.run, self.cfg.streams)["scored"]
        vocab = int(self.trainer.module.config.vocab_size)
        client = connect(self.run.redis_url)
        self.clock = RunClock(client, self.run.run_id)
        admission = AdmissionCounter(client, self.run.run_id, self.run.k, self.run.groups_per_step)
        self.feed = ScoredFeed(
            client,
            spec,
            self.run.k,
            self.run.groups_per_step,
            self.learner.max_group_size,
            vocab,
            StreamMetrics(metrics),
            admission=admission,
        )
        replay = self.feed.resume(feed_state)
        if replay:
            self.status.detail = f"replaying {replay} scored entries consumed after the last checkpoint"
        self.transport = transport_from_config(self.cfg.weight_broker, self.run)
        if self.collective:
            self.coordinator = coordinator_from_config(
                self.cfg.weight_broker,
                self.run.redis_url,
                self.run.run_id,
                client,
                self.trainer.device,
                on_event=self._group_event,
                # what rank 0 may wait for a broadcast while the other ranks wait for it in a collective
                wait_budget_s=self.learner.collective_timeout_s / 3,
            )
        self.http = serve_metrics(metrics, port=self.learner.metrics_port)
        servicer = StatusServicer(self.status, self.run.run_id)

        def add(server: grpc.Server) -> list[str]:
            common_pb2_grpc.add_StatusServicer_to_server(servicer, server)
            return ["vcpo.v1.Status"]

        self.server = grpc_server(add, port=self.learner.grpc_port)
        self.audit.parent.mkdir(parents=True, exist_ok=True)
        endpoints = {"metrics_url": self.http.url, "grpc_port": self.server.port, "pid": os.getpid()}
        tmp = self.audit.parent / "endpoints.json.tmp"
        tmp.write_text(json.dumps(endpoints) + "\n")
        tmp.replace(self.audit.parent / "endpoints.json")  # where the launcher and tests find rank 0
        log.info("learner rank 0: metrics on %s, status on gRPC port %d", self.http.url, self.server.port)

    # ------------------------------------------------------------------ the loop
    def serve(self, max_steps: int = 0, crash_after_step: int = 0) -> dict[str, Any]:
        """Train until stopped or ``max_steps`` steps in all (counting those before a restart)."""
        while True:
            message: tuple[Any, ...] = ("idle",)
            if self.rank == 0:
                message = self._next_message(max_steps)
            message = _broadcast(message)
            if message[0] == "stop":
                break
            if message[0] == "idle":
                continue
            if message[0] == "republish":  # the broker lost its versions, or the weight group this one
                self._superseded = -1  # whatever it held before, it does not hold now
                self._publish(via_broker=True)  # the group's members hold it already, or none does
                continue
            groups = [rollout_pb2.TrajectoryGroup.FromString(b) for b in message[1]]
            self._step(groups)
            if crash_after_step and self.trainer.step == crash_after_step:
                log.error(
                    "--crash-after-step %d: exiting without a checkpoint (fault injection)", crash_after_step
                )
                os._exit(17)
            if self.trainer.step % self.learner.checkpoint_every == 0:
                self.checkpoint()
        if self.trainer.step > self.last_checkpoint_step:
            self.checkpoint()
        return self.summary()

    def _next_message(self, max_steps: int) -> tuple[Any, ...]:
        assert self.feed is not None and self.metrics is not None
        if self.stop.is_set() or (max_steps and self.trainer.step >= max_steps):
            return ("stop",)
        t0 = time.perf_counter()
        groups, offered = self.feed.poll(self.trainer.version, self.learner.read_block_ms)
        self.metrics.phase.labels("wait").observe(
            time.perf_counter() - t0
        )  # reading (and waiting for) groups
        self.metrics.offered(offered)
        self._offered.extend(offered)
        if groups is None:
            if self._broadcast_lost() or self._broker_lost_version() or self._joiner_behind():
                return ("republish",)
            self.status.state = common_pb2.ServiceStatus.WAITING
            self.status.detail = (
                f"waiting for scored groups ({len(self.feed.assembler.groups)} of "
                f"{self.run.groups_per_step} for the step from version {self.trainer.version})"
            )
            return ("idle",)
        return ("step", [g.SerializeToString() for g in groups])

    def _step(self, groups: list[rollout_pb2.TrajectoryGroup]) -> None:
        mine = [groups[i] for i in place_groups(groups, self.world)[self.rank]]
        result = self.trainer.train_step(to_tensors(mine))
        publish_s, path = self._publish()
        if self.rank != 0:
            return
        assert self.metrics is not None
        self.metrics.step(result, publish_s)
        self.status.state = common_pb2.ServiceStatus.READY
        self.status.detail = "training"
        self.status.version, self.status.step = result.version, result.step
        self.status.figures = dict(result.metrics)
        lags = {o.group_id: o.lag for o in self._offered if o.outcome == "kept"}
        rewards = [t.reward.value for g in groups for t in g.trajectories]
        line = {
            "step": result.step,
            "version": result.version,
            "time": time.time(),
            "groups": [g.group_id for g in groups],
            "lags": [lags.get(g.group_id, result.version - 1 - int(g.policy_version_start)) for g in groups],
            "version_starts": [int(g.policy_version_start) for g in groups],
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "dropped": [
                {"group_id": o.group_id, "lag": o.lag, "reason": o.reason}
                for o in self._offered
                if o.outcome != "kept"
            ],
            "metrics": result.metrics,
            "timings": dict(result.timings, publish_s=publish_s),
            "publish_path": path,
        }
        self._offered = []
        if rewards:
            self.metrics.reward_mean.set(sum(rewards) / len(rewards))
        with self.audit.open("a") as f:
            f.write(json.dumps(line) + "\n")
        m = result.metrics
        log.info(
            "step %d -> version %d: loss %.4f ess_ratio %.3f lr_scale %.3f grad_norm %.3f (%.2fs + publish %.2fs)",
            result.step,
            result.version,
            m["loss"],
            m["ess_ratio"],
            m["lr_scale"],
            m["grad_norm"],
            result.timings["step_s"],
            publish_s,
        )

    def _publish(self, via_broker: bool = False) -> tuple[float, str]:
        """Publish the current version (every rank: the gathers are collectives); returns the seconds this
        rank was blocked and the path: ``collective`` (staged, then broadcast into the weight group while the
        next step runs) or ``broker`` (the broker's path: no transport configured as collective, no group
        formed yet, the group's last broadcast failed, which is counted and forms a new group, or
        ``via_broker``), or ``superseded`` (a step redone after a restart whose version the broker already
        holds: not sent again)."""
        t0 = time.perf_counter()
        version, path = self.trainer.version, "broker"
        if version <= self._superseded:  # a redone step: the broker holds this version already
            return 0.0, "superseded"
        if self.collective and not via_broker:
            publisher = self._group_publisher(ready=True)
            if rank0_code(int(publisher is not None)):
                try:
                    publish_collective(
                        self.trainer.module,
                        publisher,
                        version,
                        self.rank,
                        self.learner.publish_bucket_mb << 20,
                        background=True,
                    )
                    path = "collective"
                    if self.coordinator is not None:
                        self._carried_to = self.coordinator.members
                except TransferFailed as exc:  # the previous version's broadcast: nothing of this one left
                    # (or rank 0 could not stage this one: nothing was announced, the group stays as it is)
                    if self.coordinator is not None and not isinstance(exc, VersionNotSent):
                        self.coordinator.failed(exc)
                    log.warning("version %d goes through the broker: %s", version, exc)
        if path == "broker":
            publish_version(
                self.trainer.module,
                self.transport,
                version,
                self.rank,
                self.learner.publish_bucket_mb << 20,
                retry_s=self.cfg.weight_broker.publish_retry_s,
            )
            self._given_broker = version
        if self.clock is not None:
            self.clock.published(version)
        if self.metrics is not None:
            self.metrics.published.labels(path).inc()
        return time.perf_counter() - t0, path

    def _group_publisher(self, ready: bool = False) -> CollectivePublisher | None:
        """Rank 0: the weight group's publisher (:meth:`GroupCoordinator.publisher`; ``ready``: its broadcast in
        flight ended); None where there is none, or where its state could not be asked (Redis out of reach: the
        broker's path, asked again at the next publish or idle poll). Never raises, since every rank waits for
        rank 0's word on the path."""
        try:
            return self.coordinator.publisher(ready) if self.coordinator is not None else None
        except Exception:
            log.warning("could not ask the weight group's state: the broker's path", exc_info=True)
            return None

    def _broadcast_lost(self) -> bool:
        """Rank 0, while it waits for groups: whether the current version, sent only into the weight group,
        did not arrive (its background broadcast failed since: counted, the group dropped). The samplers stay
        on the version before it, and only the next step would publish again, which with ``k = 0`` needs groups
        sampled from this version: the run would wait for good. The version goes through the broker now."""
        if self.coordinator is None or self._given_broker >= self.trainer.version:
            return False
        failures = self.coordinator.failures
        self._group_publisher()  # notices a background broadcast that ended in failure
        if self.coordinator.failures == failures:
            return False
        log.warning("version %d did not reach the weight group: republishing it", self.trainer.version)
        return True

    def _joiner_behind(self, every_s: float = 2.0) -> bool:
        """Rank 0, while it waits for groups (at most every ``every_s``): whether a receiver that did not get
        the current version from the weight group (a sampler that started or restarted since it went out, or
        one the group left out) needs it while the broker does not hold it. The broker is not in the group and
        holds only what went through its own path: such a sampler catches up to an
        older version, whose groups the feed drops as too old, and where no other sampler serves the current
        version (one sampler, or every one restarted) no step comes to publish a newer one, so the run would
        wait for good. The current version then goes through the broker, once."""
        now = time.monotonic()
        if self.coordinator is None or self._given_broker >= self.trainer.version:
            return False
        if now - self._joiners_checked < every_s:
            return False
        self._joiners_checked = now
        try:
            joined = self.coordinator.receivers() - self._carried_to
        except Exception as exc:  # Redis out of reach: asked again later
            log.info("could not read the weight group's members: %s", exc)
            return False
        if not joined:
            return False
        latest = self._broker_latest()
        if latest == -1 or (latest is not None and latest >= self.trainer.version):
            return False  # the broker holds it, or cannot say now
        log.warning(
            "%s joined after version %d went into the weight group, which the broker does not hold (it "
            "holds %s): republishing it through the broker",
            ", ".join(sorted(joined)),
            self.trainer.version,
            latest,
        )
        return True

    def _broker_lost_version(self, every_s: float = 10.0) -> bool:
        """Rank 0, while it waits for groups (at most every ``every_s``): whether the broker lost versions the
        learner gave it, as after a restart with memory storage: it holds none, or none as new as the last one
        published through its path. Samplers that start then could get no weights until the next step; the
        learner republishes the current version through the broker at once instead. Versions the weight group
        carried are not asked for: the broker, outside the group, never had them. A
        broker that does not answer is not asked again until ``every_s`` has passed (its clients retry on
        their own)."""
        now = time.monotonic()
        if self.transport is None or now - self._broker_checked < every_s:
            return False
        self._broker_checked = now
        latest = self._broker_latest()
        if latest == -1:
            return False
        if latest is None or latest < self._given_broker:
            log.warning(
                "the broker holds version %s, not version %d the learner published through it (restarted?): "
                "republishing the current version %d",
                latest,
                self._given_broker,
                self.trainer.version,
            )
            return True
        return False

    def _broker_latest(self) -> int | None:
        """Rank 0: the broker's latest version (None: it has none), -1 when it did not answer."""
        if self.transport is None:
            return -1
        try:
            return self.transport.latest()
        except Exception as exc:
            log.info("the broker did not say its latest version: %s", exc)
            return -1

    def _group_event(self, event: str) -> None:
        if self.metrics is not None and self.coordinator is not None:
            self.metrics.group_events.labels(event).inc()
            self.metrics.group_epoch.set(self.coordinator.epoch if event == "formed" else 0)

    def checkpoint(self) -> None:
        """Checkpoint weights, optimizer and the feed state (a collective), then acknowledge what it covers."""
        t0 = time.perf_counter()
        feed_state = self.feed.checkpointed().to_json() if self.feed is not None else None
        feed_state = _broadcast(feed_state)
        self.trainer.save_checkpoint(self.ckpt_dir, {"feed": feed_state}, self.learner.keep_checkpoints)
        self.last_checkpoint_step = self.trainer.step
        if self.metrics is not None:
            self.metrics.phase.labels("checkpoint").observe(time.perf_counter() - t0)
        if self.feed is not None:
            acked = self.feed.acknowledge(FeedState.from_json(feed_state))
            log.info("checkpoint at step %d; acknowledged %d scored entries", self.trainer.step, acked)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "step": self.trainer.step, "version": self.trainer.version}
        if self.feed is not None:
            out["feed"] = self.feed.checkpointed().to_json()
        return out

    def leave(self) -> None:
        """After a normal finish: leave the process group together (a gloo group torn down by interpreter
        exit can abort the process)."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()  # waits for the last broadcast
        if self.server is not None:
            self.server.stop(grace=1)
        if self.http is not None:
            self.http.close()
