"""The reward service as a Ray Serve application: replicas that scale with the `rollouts` queue.

Each Serve replica is a whole :class:`RewardService` (its own scoring pool, stream consumer, gRPC and
``/metrics`` on free ports, listed in ``<run_dir>/reward/<name>.endpoints.json``); its reward loop runs in a
background thread from start to shutdown. Serve adds what a plain process lacks: replica placement and
restart, and autoscaling on queue depth (``autoscaling.py``). Clients that want scoring alone can call
the deployment's ``score_batch`` through a Serve handle, or any replica's gRPC port.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from services.common.observability import actor_logging
from services.common.starts import record_start_quietly, record_stop
from services.common.streams.specs import connect
from services.reward.autoscaling import QUEUE_DEPTH_METRIC, QueueDepthPolicy
from services.reward.config import RewardServiceConfig
from vcpo.v1 import reward_pb2

APP_NAME = "vcpo-reward"
log = logging.getLogger(__name__)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32, health_check_period_s=5)
class RewardDeployment:
    def __init__(self, cfg_json: str) -> None:
        from services.reward.service import RewardService

        cfg = RewardServiceConfig.model_validate_json(cfg_json)
        if cfg.reward.serve_ports == "free":
            # replicas may share nodes: fixed ports would collide, so each takes free ones (its endpoints file)
            cfg = cfg.model_copy(
                update={"reward": cfg.reward.model_copy(update={"grpc_port": 0, "metrics_port": 0})}
            )
        name = f"reward-serve-{serve.get_replica_context().replica_id.unique_id}"
        actor_logging(name, cfg.run.run_dir)
        self._name, self._run_cfg = name, cfg.run
        record_start_quietly(cfg.run.redis_url, cfg.run.run_id, "reward", name)
        self.service = RewardService(cfg, name)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reward-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.service.serve(self._stop)
        except BaseException as exc:  # reported by check_health, so Serve replaces the replica
            self._error = exc
            raise

    def score_batch(self, request: bytes) -> bytes:
        """A serialized ScoreBatchRequest in, a serialized ScoreBatchResponse out (ValueError: bad request)."""
        batch = reward_pb2.ScoreBatchRequest.FromString(request)
        return self.service.servicer.score_batch(batch).SerializeToString()

    def summary(self) -> dict[str, Any]:
        return self.service.summary()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {QUEUE_DEPTH_METRIC: float(self.service.loop.consumer.backlog())}

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"the reward loop stopped: {self._error!r}")

    def __del__(self) -> None:  # Serve's graceful shutdown: forward the groups in hand, then stop
        self._stop.set()
        self._thread.join(timeout=60)
        self.service.close()
        try:  # stopped on request (scaled down, or the run's end): not a death
            client = connect(self._run_cfg.redis_url)
            record_stop(client, self._run_cfg.run_id, "reward", self._name)
            client.close()
        except Exception:
            log.warning("could not record the stop of %s", self._name, exc_info=True)


def reward_app(
    cfg: RewardServiceConfig,
    upscale_delay_s: float = 10.0,
    downscale_delay_s: float = 120.0,
    metrics_push_interval_s: float = 5.0,
) -> Any:
    """The Serve application: ``reward.min_replicas`` .. ``reward.max_replicas`` replicas, scaled on the
    `rollouts` queue's depth; each replica reports it every ``metrics_push_interval_s``."""
    r = cfg.reward
    autoscaling = AutoscalingConfig(
        min_replicas=r.min_replicas,
        max_replicas=r.max_replicas,
        upscale_delay_s=upscale_delay_s,
        downscale_delay_s=downscale_delay_s,
        look_back_period_s=max(2 * metrics_push_interval_s, 2.0),
        metrics_interval_s=metrics_push_interval_s,
        policy=AutoscalingPolicy(
            policy_function=QueueDepthPolicy, policy_kwargs={"target_queue_depth": r.target_queue_depth}
        ),
    )
    push = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(metrics_push_interval_s)}
    return RewardDeployment.options(  # type: ignore[attr-defined]
        autoscaling_config=autoscaling,
        ray_actor_options={
            "num_cpus": 1,
            "resources": dict(r.ray_resources),
            "runtime_env": {"env_vars": push},
        },
    ).bind(cfg.model_dump_json())


def deploy_reward(cfg: RewardServiceConfig, **options: float) -> Any:
    """Run the application on the connected Ray cluster (no HTTP route); returns its handle.
    ``options`` go to :func:`reward_app`."""
    return serve.run(reward_app(cfg, **options), name=APP_NAME, route_prefix=None)
