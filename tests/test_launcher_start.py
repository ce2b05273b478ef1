"""The launcher's start-up pieces that do not need the services: a blocking start on a thread of its own, and
when the samplers may start beside the learner. (The whole start-up runs in tests/test_e2e*.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deploy.config import SystemConfig
from deploy.launcher_services import Services, _fractional_gpus
from deploy.launcher_starting import Starting
from deploy.launcher_stopping import Stopping


def _services(tmp_path: Path) -> Services:
    cfg = SystemConfig.model_validate({"run": {"run_dir": str(tmp_path)}})
    return Services(cfg, Stopping(), {}, time.monotonic())


def test_a_start_on_its_own_thread_runs_while_the_caller_goes_on_and_hands_back_its_error() -> None:
    release = threading.Event()
    ran: list[str] = []

    def start() -> None:
        release.wait(10)
        ran.append(threading.current_thread().name)
        raise RuntimeError("the deployment failed: no replica became healthy")

    starting = Starting("reward", start)
    assert not starting.done(0.05)  # still deploying: the caller was not held
    release.set()
    assert starting.done(10) and ran == ["start-reward"]
    with pytest.raises(RuntimeError, match="no replica became healthy"):
        starting.result()


def test_a_start_that_succeeds_returns_from_result() -> None:
    starting = Starting("reward", lambda: time.sleep(0.01))
    starting.result()
    assert starting.done(0)


@pytest.mark.parametrize(
    ("sampler_gpus", "learner_gpus", "shared"),
    [(0, 0, False), (1, 1, False), (2, 1, False), (0.5, 1, True), (1, 0.5, True), (0.25, 0.25, True)],
)
def test_samplers_wait_for_the_learner_only_when_either_asks_for_part_of_a_gpu(
    tmp_path: Path, sampler_gpus: float, learner_gpus: float, shared: bool
) -> None:
    cfg = SystemConfig.model_validate(
        {
            "run": {"run_dir": str(tmp_path)},
            "sampler": {"gpus_per_replica": sampler_gpus},
            "learner": {"gpus_per_rank": learner_gpus},
        }
    )
    assert _fractional_gpus(cfg) is shared


def test_a_start_up_wait_returns_the_first_answer_even_a_falsy_one(tmp_path: Path) -> None:
    answers = iter([None, None, 0])  # version 0 is an answer; None is "not yet"
    assert _services(tmp_path)._await(lambda: next(answers), 10, "late") == 0


def test_a_start_up_wait_stops_on_a_stop_request_and_times_out_with_its_message(tmp_path: Path) -> None:
    services = _services(tmp_path)
    with pytest.raises(TimeoutError, match="the reward app was not ready"):
        services._await(lambda: None, 0.6, "the reward app was not ready after 0s")
    services.stopping.event.set()
    with pytest.raises(KeyboardInterrupt):
        services._await(lambda: None, 10, "late")


def test_waiting_for_the_reward_app_raises_what_its_deploy_raised(tmp_path: Path) -> None:
    services = _services(tmp_path)

    def deploy() -> None:
        time.sleep(0.3)
        raise RuntimeError("Deploying app 'vcpo-reward' failed")

    services.reward_start = Starting("reward", deploy)
    with pytest.raises(RuntimeError, match="Deploying app 'vcpo-reward' failed"):
        services.wait_reward(timeout_s=10)
