"""protos/ is the one source of truth: generated code is current, not committed, and has what later work needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vcpo.v1 import (
    common_pb2,
    environment_pb2,
    registry_pb2,
    reward_pb2,
    rollout_pb2,
    weights_pb2,
)

ROOT = Path(__file__).parent.parent


def test_generated_code_is_current_and_not_committed() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/gen_protos.py"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "up to date" in out.stdout  # the stamp matches every .proto file as it is now
    tracked = subprocess.run(["git", "ls-files", "gen"], cwd=ROOT, capture_output=True, text=True)
    assert tracked.stdout == ""
    ignored = subprocess.run(["git", "check-ignore", "-q", "gen/vcpo/v1/rollout_pb2.py"], cwd=ROOT)
    assert ignored.returncode == 0


def _fields(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}


def test_trajectory_group_has_what_the_learner_needs() -> None:
    assert {
        "response_tokens",
        "behaviour_logprobs",
        "loss_mask",
        "policy_version_start",
        "policy_version_end",
        "version_segments",
        "reward",
        "finish_reason",
    } <= _fields(rollout_pb2.Trajectory)
    assert {
        "group_id",
        "run_id",
        "task",
        "prompt_tokens",
        "trajectories",
        "policy_version_start",
        "policy_version_end",
        "sampling",
    } <= _fields(rollout_pb2.TrajectoryGroup)
    assert {"task_id", "environment", "reference", "scorer", "split"} <= _fields(rollout_pb2.Task)
    assert {"value", "failed", "failure_reason", "scorer"} <= _fields(rollout_pb2.Reward)


def _method(service: str, module: object, name: str) -> object:
    return module.DESCRIPTOR.services_by_name[service].methods_by_name[name]


@pytest.mark.parametrize(
    ("module", "service", "method", "client_streaming", "server_streaming"),
    [
        (weights_pb2, "WeightBroker", "GetLatest", False, False),
        (weights_pb2, "WeightBroker", "ListVersions", False, False),
        (reward_pb2, "RewardService", "Score", False, False),
        (reward_pb2, "RewardService", "ScoreBatch", False, False),
        (environment_pb2, "Environment", "Reset", False, False),
        (environment_pb2, "Environment", "Step", False, False),
        (registry_pb2, "EnvironmentRegistry", "RegisterEnvironment", False, False),
        (registry_pb2, "EnvironmentRegistry", "SubmitTasks", True, False),
        (registry_pb2, "EnvironmentRegistry", "ListEnvironments", False, False),
        (registry_pb2, "EnvironmentRegistry", "EnvironmentStatus", False, False),
        (common_pb2, "Status", "GetStatus", False, False),
    ],
)
def test_services_have_their_methods(
    module: object, service: str, method: str, client_streaming: bool, server_streaming: bool
) -> None:
    m = _method(service, module, method)
    assert (m.client_streaming, m.server_streaming) == (client_streaming, server_streaming)  # type: ignore[attr-defined]


def test_the_broker_serves_only_its_control_calls_over_grpc() -> None:
    """Weight bytes travel on the broker's TCP data plane, as frames of their own."""
    methods = weights_pb2.DESCRIPTOR.services_by_name["WeightBroker"].methods_by_name
    assert set(methods) == {"GetLatest", "ListVersions"}


def test_environment_backends_are_a_oneof() -> None:
    spec = registry_pb2.EnvironmentSpec(name="calc", endpoint="127.0.0.1:9000")
    assert spec.WhichOneof("backend") == "endpoint"
