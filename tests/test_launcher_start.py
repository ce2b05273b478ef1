"""The launcher's start-up pieces that do not need the services: a blocking start on a thread of its own, when
the samplers may start beside the learner, which ports are fixed before any service starts, and what a failed
start-up says. (The whole start-up runs in tests/test_e2e*.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.config import SystemConfig
from deploy.launcher_services import Services, _fractional_gpus
from deploy.launcher_setup import with_ports_and_redis
from deploy.launcher_starting import Starting
from deploy.launcher_stopping import Stopping, failure_reason


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
            # vLLM takes gpu_memory_utilization of the whole GPU: at most the replica's share, less a margin
            "sampler": {
                "gpus_per_replica": sampler_gpus,
                "gpu_memory_utilization": sampler_gpus - 0.05 if 0 < sampler_gpus < 1 else 0.9,
            },
            "learner": {"gpus_per_rank": learner_gpus},
        }
    )
    assert _fractional_gpus(cfg) is shared


def test_a_start_up_wait_returns_the_first_answer_even_a_falsy_one(tmp_path: Path) -> None:
    answers = iter([None, None, 0])  # version 0 is an answer; None is "not yet"
    assert _services(tmp_path)._await(lambda: next(answers), 10, "late") == 0


def test_a_start_up_wait_takes_an_actor_that_did_not_answer_in_time_as_not_ready(tmp_path: Path) -> None:
    """A replica not placed yet (its GPUs still held, its node not joined) does not answer a status call
    within the call's timeout: Ray's GetTimeoutError, which used to end the whole start at once."""
    from ray.exceptions import GetTimeoutError

    def answers() -> Any:
        yield GetTimeoutError("Get timed out: some object(s) not ready.")
        yield None
        yield 3

    pending = answers()

    def ready() -> int | None:
        answer = next(pending)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert _services(tmp_path)._await(ready, 10, "late") == 3


def test_start_up_waits_take_the_launchers_start_timeout(tmp_path: Path) -> None:
    cfg = SystemConfig.model_validate(
        {"run": {"run_dir": str(tmp_path)}, "launcher": {"start_timeout_s": 1.5}}
    )
    services = Services(cfg, Stopping(), {}, time.monotonic())
    release = threading.Event()
    services.reward_start = Starting("reward", lambda: release.wait(30))  # a deploy that does not finish
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the reward app was not ready after 2s"):
        services.wait_reward()
    assert 1.4 < time.monotonic() - t0 < 5
    release.set()


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


def test_only_the_broker_gets_its_ports_before_the_services_start(tmp_path: Path) -> None:
    """The broker is reached at its configured address (and comes back on it after a restart), so its free
    ports are fixed up front; the learner's stay 0 and rank 0 binds free ones when it serves (a port picked
    before its long start-up could be taken meanwhile by an engine or a Ray worker), reporting them in its
    endpoints file. Ports a user set are kept, and the Redis actually used replaces the configured one."""
    zeros = {"grpc_port": 0, "metrics_port": 0}  # as the local preset has them: 0, a free port
    cfg = SystemConfig.model_validate(
        {"run": {"run_dir": str(tmp_path)}, "learner": zeros, "weight_broker": {**zeros, "data_port": 0}}
    )
    out = with_ports_and_redis(cfg, "redis://127.0.0.1:7777/0")
    wb = out.weight_broker
    assert all(p > 0 for p in (wb.grpc_port, wb.data_port, wb.metrics_port))
    assert (out.learner.grpc_port, out.learner.metrics_port, out.learner.master_port) == (0, 0, 0)
    assert out.run.redis_url == "redis://127.0.0.1:7777/0"
    fixed = SystemConfig.model_validate(
        {
            "run": {"run_dir": str(tmp_path)},
            "learner": {"grpc_port": 50100, "metrics_port": 9100},
            "weight_broker": {"grpc_port": 50200},
        }
    )
    out = with_ports_and_redis(fixed, "redis://x:1/0")
    assert (out.learner.grpc_port, out.learner.metrics_port, out.weight_broker.grpc_port) == (
        50100,
        9100,
        50200,
    )


def test_a_failure_inside_a_ray_actor_is_reported_as_what_it_raised_and_where() -> None:
    """``stopping (failed: ...)`` names the remote error (Ray's own message names only the actor and pid), and
    through an actor that called another; any other error reads as itself."""
    from ray.exceptions import RayTaskError

    bind = OSError(98, "Address already in use")
    inner = RayTaskError("GrpcServer.start", "Traceback ...", bind, proctitle="w", pid=2, ip="10.0.0.1")
    outer = RayTaskError("LearnerRankActor.run", "Traceback ...", inner, proctitle="w", pid=1, ip="10.0.0.1")
    assert "Address already in use" not in str(outer)  # what the launcher printed before
    assert failure_reason(outer) == (
        "LearnerRankActor.run → GrpcServer.start raised OSError: [Errno 98] Address already in use"
    )
    # ray.get raises it as an instance of the cause's class as well, which keeps only Ray's message
    assert failure_reason(outer.as_instanceof_cause()) == failure_reason(outer)
    raised = RayTaskError(
        "LearnerRankActor.run", "Traceback ...", bind, proctitle="ray::LearnerRankActor.run", pid=1, ip="x"
    ).as_instanceof_cause()
    assert isinstance(raised, OSError) and "function_name" not in vars(raised)
    assert failure_reason(raised) == "LearnerRankActor.run raised OSError: [Errno 98] Address already in use"
    assert failure_reason(RuntimeError("redis at redis://x:1/0 is unreachable")) == (
        "redis at redis://x:1/0 is unreachable"
    )


class _Method:
    def __init__(self, calls: list[tuple[str, int]], name: str, rank: int, result: object = None) -> None:
        self.calls, self.name, self.rank, self.result = calls, name, rank, result

    def remote(self, *args: object) -> object:
        self.calls.append((self.name, self.rank))
        return self.result


class _Rank:
    def __init__(self, calls: list[tuple[str, int]], rank: int) -> None:
        self.prepare = _Method(calls, "prepare", rank)
        self.address = _Method(calls, "address", rank, ("10.0.0.1", 29500))
        self.run = _Method(calls, "run", rank)


def test_every_learner_rank_imports_its_modules_before_rank_0_opens_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rendezvous waits for the ranks only the collective timeout (30 s in a chaos run): a rank that
    imported DeepSpeed and transformers only once run() had started missed it on a loaded machine."""
    import ray

    from services.learner.ray_group import LearnerGroup

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(ray, "get", lambda refs, **_: refs)
    group = object.__new__(LearnerGroup)
    group.actors = [_Rank(calls, i) for i in range(3)]
    group.start()
    assert calls == [
        ("prepare", 0),
        ("prepare", 1),
        ("prepare", 2),
        ("address", 0),
        ("run", 0),
        ("run", 1),
        ("run", 2),
    ]


def test_a_start_up_wait_names_what_ray_has_not_placed_after_a_short_wait_and_in_its_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A service Ray has not placed (its GPUs held elsewhere) is named once launcher.unplaced_report_s has
    passed, while the start waits on, and the timeout's error names it instead of the service's own "late"
    message (which blamed an engine that never started)."""
    cfg = SystemConfig.model_validate(
        {"run": {"run_dir": str(tmp_path)}, "launcher": {"unplaced_report_s": 0.3}}
    )
    services = Services(cfg, Stopping(), {}, time.monotonic())
    asked: list[float] = []

    def pending() -> list[str]:
        asked.append(time.monotonic())
        return ["sampler replica 3: no node has 1 GPU free (free now: 10.0.0.1 0 of 8 GPU)"]

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        services._await(lambda: None, 1.5, "the samplers were not generating after 2s", pending)
    assert str(err.value) == (
        "not placed by Ray after 2s: sampler replica 3: no node has 1 GPU free (free now: 10.0.0.1 0 of 8 GPU)"
    )
    assert asked[0] - t0 >= 0.3 and len(asked) == 2  # once past the short wait, once at the timeout
    said = capsys.readouterr().out
    assert said.count("[..] not placed   sampler replica 3: no node has 1 GPU free") == 1
    # all placed: the service's own message
    with pytest.raises(TimeoutError, match=r"^the samplers were not generating after 1s$"):
        services._await(lambda: None, 0.6, "the samplers were not generating after 1s", lambda: [])
