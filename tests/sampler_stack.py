"""The sampler service on the session's vLLM engine with Redis, a weight broker and a learner stand-in."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import redis

from services.common.auth import bearer
from services.common.config import RunConfig, StreamsConfig
from services.common.streams.specs import stream_specs
from services.sampler.engine import GenerationEngine
from services.sampler.service import SamplerService
from tests.sampler_helpers import LearnerStandIn, announcing_broker, sampler_config
from vcpo.v1 import common_pb2, common_pb2_grpc, registry_pb2_grpc, rollout_pb2


def wait_until(check: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def rollouts(stack: Stack) -> list[rollout_pb2.TrajectoryGroup]:
    """Every trajectory group the stack's sampler has written to the rollouts stream."""
    return [
        rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"])
        for _, fields in stack.client.xrange(stack.specs["rollouts"].key)
    ]


def check_example_client(
    stack: Stack, submit: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """An example client (examples/submit_tasks.py, or the Node one), run as ``submit(token_file, *flags)``
    against the calculator environment: it registers the environment and submits 3 tasks, which run with the
    registration's scorer; with a wrong token the registration is refused."""
    client = submit(tmp_path / "api_token", "--tasks", "3", "--watch-s", "1")
    assert client.returncode == 0, client.stderr
    assert "environment 'calculator' registered" in client.stdout
    assert "submitted: 3 accepted, 0 rejected" in client.stdout and "healthy=True" in client.stdout
    stack.learner.publish(0)
    stack.start()
    groups = wait_until(lambda: len(g := rollouts(stack)) >= 3 and g, what="the client's 3 tasks")
    assert {g.task.task_id for g in groups} == {"calculator:0", "calculator:1", "calculator:2"}
    assert all(g.task.scorer == "math" and g.task.reference for g in groups)  # the registration's scorer
    (tmp_path / "wrong").write_text("not-the-token\n")
    wrong = submit(tmp_path / "wrong")
    assert wrong.returncode == 1 and "registration refused: UNAUTHENTICATED" in wrong.stderr


class Stack:
    """Redis + broker (announcing on the weights stream) + one sampler service on the session's engine."""

    def __init__(
        self,
        client: redis.Redis,
        url: str,
        model_dir: Path,
        run_dir: Path,
        engine: GenerationEngine,
        k: int,
        groups_per_step: int,
        evaluation: dict[str, Any] | None = None,
        agents: dict[str, Any] | None = None,
        **sampler: Any,
    ) -> None:
        self.run = RunConfig(
            run_id="t",
            k=k,
            groups_per_step=groups_per_step,
            model=str(model_dir),
            redis_url=url,
            run_dir=run_dir,
        )
        specs = stream_specs(self.run, StreamsConfig())
        self.broker = announcing_broker(client, self.run)
        n = sampler.get("n", 4)  # the requests of 4 whole groups in flight at most
        settings = {
            "n": 4,
            "max_tokens": 16,
            "max_model_len": 256,
            "max_requests_in_flight": 4 * n,
            **sampler,
        }
        self.cfg = sampler_config(self.run, self.broker, evaluation, agents, **settings)
        engine.loaded_version = None  # a starting sampler does not know what it holds: it fetches a version
        self.service = SamplerService(self.cfg, 0, engine)
        self.learner = LearnerStandIn(client, self.run, self.broker.client(), model_dir)
        self.client, self.model_dir, self.specs = client, model_dir, specs
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,), daemon=True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.server.port}")
        self.token = (run_dir / "api_token").read_text().strip()  # made by the service: no token configured
        self.auth = bearer(self.token)

    def registry(self) -> registry_pb2_grpc.EnvironmentRegistryStub:
        return registry_pb2_grpc.EnvironmentRegistryStub(self.channel)

    def start(self) -> None:
        self.thread.start()

    def status(self) -> common_pb2.ServiceStatus:
        return common_pb2_grpc.StatusStub(self.channel).GetStatus(common_pb2.StatusRequest(), timeout=5)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.channel.close()
        self.service.close()  # leaves the session's engine running
        self.broker.stop()
