"""A reward replica, wired: scoring pool, `rollouts` consumer, `scored` producer, metrics, gRPC.

Used by the plain entry point (``python -m services.reward``) and by the Ray Serve deployment alike.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from services.common.observability import Metrics, grpc_server, serve_metrics, write_endpoints
from services.common.sandbox import isolation
from services.common.streams.consumer import StreamConsumer
from services.common.streams.metrics import StreamMetrics
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import connect, stream_specs
from services.reward.config import RewardServiceConfig
from services.reward.loop import RewardLoop
from services.reward.metrics import RewardMetrics
from services.reward.pool import ScoringPool
from services.reward.servicer import RewardServicer
from vcpo.v1 import reward_pb2_grpc

log = logging.getLogger(__name__)


class RewardService:
    """One reward replica. ``name`` is its consumer name on `rollouts` (unique among live replicas; a
    replica restarted under the same name first redoes the groups it had left pending)."""

    def __init__(self, cfg: RewardServiceConfig, name: str = "reward-0", port_offset: int = 0) -> None:
        r, run = cfg.reward, cfg.run
        if not run.redis_url:
            raise ValueError("run.redis_url is empty: the reward service needs the run's Redis")
        self.cfg, self.name = cfg, name
        self.registry = Metrics("reward")
        self.metrics = RewardMetrics(self.registry, name)
        stream_metrics = StreamMetrics(self.registry)
        client = connect(run.redis_url)
        specs = stream_specs(run, cfg.streams)
        self.pool = ScoringPool.from_config(r)
        try:
            consumer = StreamConsumer(
                client,
                specs["rollouts"],
                name,
                stream_metrics,
                cfg.streams.reclaim_idle_ms,
                cfg.streams.max_deliveries,
            )
            producer = StreamProducer(
                client, specs["scored"], stream_metrics, cfg.streams.producer_wait_timeout_s
            )
            self.loop = RewardLoop(
                consumer,
                producer,
                self.pool,
                self.metrics,
                r.default_scorer,
                block_ms=cfg.streams.block_ms,
                batch_groups=max(1, r.workers // 2),
            )
            self.servicer = RewardServicer(self.pool, r.default_scorer, self.metrics.record_outcome)

            def add(server: grpc.Server) -> list[str]:
                reward_pb2_grpc.add_RewardServiceServicer_to_server(self.servicer, server)
                return ["vcpo.v1.RewardService"]

            self.server = grpc_server(add, port=r.grpc_port + port_offset if r.grpc_port else 0)
            self.http = serve_metrics(
                self.registry, port=r.metrics_port + port_offset if r.metrics_port else 0
            )
        except BaseException:
            self.pool.close()
            raise
        self.endpoints = write_endpoints(run.run_dir / "reward", self.name, self.server.port, self.http.url)
        log.info("%s: sandbox isolation %s", name, isolation())

    def serve(self, stop: threading.Event, max_groups: int = 0) -> dict[str, Any]:
        """Score groups from `rollouts` until ``stop`` (or ``max_groups``); the gRPC API serves meanwhile."""
        log.info("%s: gRPC on port %d, metrics on %s", self.name, self.server.port, self.http.url)
        self.loop.run(stop, max_groups)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {"replica": self.name, **self.loop.summary(), "workers_replaced": self.pool.replaced}

    def close(self) -> None:
        self.server.stop(grace=1)
        self.http.close()
        self.pool.close()
