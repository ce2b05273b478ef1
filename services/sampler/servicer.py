"""The sampler's gRPC services: Status (with health), and the environment registry clients talk to.

``RegisterEnvironment`` validates a spec (defaults filled in, a bad value named: INVALID_ARGUMENT; an endpoint
that does not answer health checks: FAILED_PRECONDITION) and stores it for every replica. ``SubmitTasks``
checks every task the way the sampler will (environment registered, payload JSON, prompt, context length),
gives a task of an environment that environment's scorer when it names none, and puts the good ones on the
run's `tasks` stream, where any replica picks them up; the reply counts both and names each rejected task
with its reason. ``UnregisterEnvironment`` takes an environment out of service: it drains (no more tasks
accepted; the admitted ones run to the end, counted by the registry as submitted and settled) and is removed
when none is left; the run file's environments are refused (FAILED_PRECONDITION). The registry's calls need
the run's API token (services.common.auth).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import grpc

from services.common.prompts import TaskError
from services.common.streams.producer import StreamProducer
from services.sampler.environments.registry import EnvironmentRegistry, SpecError, Unreachable, public
from vcpo.v1 import common_pb2, common_pb2_grpc, registry_pb2, registry_pb2_grpc, rollout_pb2


@dataclass
class SamplerState:
    """What Status reports; written by the loop, read by the gRPC thread."""

    state: int = common_pb2.ServiceStatus.STARTING
    detail: str = "starting"
    policy_version: int = 0
    figures: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class StatusServicer(common_pb2_grpc.StatusServicer):
    def __init__(self, status: SamplerState, run_id: str, replica_id: str) -> None:
        self.status, self.run_id, self.replica_id = status, run_id, replica_id

    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ServiceStatus:
        s = self.status
        return common_pb2.ServiceStatus(
            service="sampler",
            replica_id=self.replica_id,
            run_id=self.run_id,
            policy_version=s.policy_version,
            state=s.state,  # type: ignore[arg-type]
            detail=s.detail,
            uptime_seconds=time.monotonic() - s.started,
            figures={k: v for k, v in s.figures.items() if math.isfinite(v)},
        )


class RegistryServicer(registry_pb2_grpc.EnvironmentRegistryServicer):
    def __init__(
        self,
        validate: Callable[[rollout_pb2.Task], object],
        tasks: StreamProducer[rollout_pb2.Task],
        registry: EnvironmentRegistry,
        on_error: Callable[[TaskError], None] | None = None,
        run_file_environments: Collection[str] = (),
    ) -> None:
        self.validate, self.tasks, self.registry, self.on_error = validate, tasks, registry, on_error
        self.run_file_environments = set(run_file_environments)  # the run file's: not unregistered by a call

    def SubmitTasks(
        self, request_iterator: Iterator[registry_pb2.SubmitTasksRequest], context: grpc.ServicerContext
    ) -> registry_pb2.SubmitTasksResponse:
        good: list[tuple[rollout_pb2.Task, int]] = []
        errors: list[str] = []
        draining = self.registry.draining()
        for i, request in enumerate(request_iterator):
            task = rollout_pb2.Task()
            task.CopyFrom(request.task)
            if request.environment and not task.environment:
                task.environment = request.environment
            if not task.split:
                task.split = "train"
            if task.environment and not task.scorer:
                handle = self.registry.get(task.environment)
                if handle is not None:
                    task.scorer = handle.spec.scorer
            try:
                if task.environment in draining:
                    raise TaskError(
                        "environment_draining",
                        task.task_id,
                        f"environment {task.environment!r} is unregistered and draining: it takes no more tasks",
                    )
                self._check_fields(task)
                self.validate(task)
            except TaskError as exc:
                errors.append(f"task #{i}: {exc} [{exc.reason}]")
                if self.on_error is not None:
                    self.on_error(exc)
                continue
            good.append((task, 0))
        if good:
            self.tasks.put_many(good)
            for name, count in Counter(t.environment for t, _ in good if t.environment).items():
                self.registry.admitted(name, count)  # what a drain waits for
        return registry_pb2.SubmitTasksResponse(accepted=len(good), rejected=len(errors), errors=errors)

    def _check_fields(self, task: rollout_pb2.Task) -> None:
        """The enumerated fields of a submitted task: its split and its scorer (TaskError naming the choices)."""
        if task.split != "train":
            raise TaskError(
                "bad_split",
                task.task_id,
                f"split {task.split!r}: submitted tasks are trained on, so the split is 'train' (or empty); "
                "held-out tasks belong in [evaluation] sets",
            )
        known = self.registry.scorers
        if task.scorer and known is not None and task.scorer not in known:
            raise TaskError(
                "unknown_scorer",
                task.task_id,
                f"unknown scorer {task.scorer!r}; registered scorers: {', '.join(sorted(known))}",
            )

    def ListEnvironments(
        self, request: registry_pb2.ListEnvironmentsRequest, context: grpc.ServicerContext
    ) -> registry_pb2.ListEnvironmentsResponse:
        return registry_pb2.ListEnvironmentsResponse(environments=[public(s) for s in self.registry.specs()])

    def RegisterEnvironment(
        self, request: registry_pb2.RegisterEnvironmentRequest, context: grpc.ServicerContext
    ) -> registry_pb2.RegisterEnvironmentResponse:
        try:
            spec, created = self.registry.register(request.spec)
        except Unreachable as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except SpecError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        return registry_pb2.RegisterEnvironmentResponse(name=spec.name, created=created)

    def UnregisterEnvironment(
        self, request: registry_pb2.UnregisterEnvironmentRequest, context: grpc.ServicerContext
    ) -> registry_pb2.UnregisterEnvironmentResponse:
        if request.name in self.run_file_environments:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"environment {request.name!r} is listed in the run file ([[sampler.environments]]); remove it "
                "there and restart the samplers",
            )
        try:
            state, outstanding = self.registry.unregister(request.name)
        except KeyError:
            known = [s.name for s in self.registry.specs()]
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no environment named {request.name!r} is registered (known: {known})",
            )
            raise AssertionError("unreachable") from None
        return registry_pb2.UnregisterEnvironmentResponse(
            name=request.name, state=state, tasks_outstanding=outstanding
        )

    def EnvironmentStatus(
        self, request: registry_pb2.EnvironmentStatusRequest, context: grpc.ServicerContext
    ) -> registry_pb2.EnvironmentStatusResponse:
        status = self.registry.status(request.name)
        if status is None:
            known = [s.name for s in self.registry.specs()]
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no environment named {request.name!r} is registered (known: {known})",
            )
            raise AssertionError("unreachable")
        return status
