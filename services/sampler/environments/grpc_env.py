"""A user's environment behind gRPC: the protocol's calls with deadlines, their failures named.

DEADLINE_EXCEEDED is a ``timeout``, UNAVAILABLE (the server is down or unreachable) ``unavailable``, any other
status ``error`` with the server's own details; a reply that cannot be used (a non-finite reward, a tool
without a name) is ``bad_reply``. Health is the standard ``grpc.health.v1`` check, for ``vcpo.v1.Environment``
or, when the server does not name its services, the server as a whole.

The stubs are made once, with the channel: grpcio (1.85) crashes the process (SIGSEGV) when a stub is made on
a closed channel, so nothing here touches the channel after :meth:`GrpcEnvironment.shutdown`.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.sampler.environments.base import Environment, EnvironmentFailure
from vcpo.v1 import environment_pb2, environment_pb2_grpc, rollout_pb2

SERVICE = "vcpo.v1.Environment"


HEALTH_ADVICE = (
    "Environment servers must serve grpc.health.v1.Health beside vcpo.v1.Environment: the sampler checks it "
    "when the environment is registered, so a server that is down or not ready is refused with the reason "
    "rather than sent episodes that fail. Add a health servicer that reports SERVING for "
    f"{SERVICE!r} (or for the server, ''): grpcio-health-checking in Python, grpc-health-check in Node.js "
    "(services/sampler/environments/server.py does it for Python environments)."
)


def _health_failure(endpoint: str, code: grpc.StatusCode | None, details: str, timeout_s: float) -> str:
    """What a failed health check at ``endpoint`` means, for the person registering it."""
    name = code.name if code is not None else "UNKNOWN"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"the server at {endpoint} answered UNIMPLEMENTED to grpc.health.v1.Health/Check. {HEALTH_ADVICE}"
        )
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (
            f"nothing at endpoint {endpoint!r} answered gRPC health checks within {timeout_s:g}s ({name}: "
            f"{details}); is a vcpo.v1.Environment server listening there, reachable from the sampler?"
        )
    return f"the health check at {endpoint} failed with {name}: {details}. {HEALTH_ADVICE}"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 address]:port`` as (host, port); ValueError naming the bad value."""
    if "://" in endpoint or "/" in endpoint:
        raise ValueError(
            f"{endpoint!r}: give host:port, without a scheme or a path (e.g. 10.0.0.5:50070 or "
            "env-server.default.svc:50070, not http://10.0.0.5:50070)"
        )
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{endpoint!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{endpoint!r}: an IPv6 host goes in brackets, e.g. [::1]:50051")
    elif ":" in host:
        raise ValueError(f"{endpoint!r}: an IPv6 host goes in brackets, e.g. [::1]:50051")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{endpoint!r}: the port must be a number in 1..65535, got {port_text!r}")
    return host, int(port_text)


class GrpcEnvironment(Environment):
    """A client of one ``vcpo.v1.Environment`` server at ``endpoint``: one channel (plaintext, or TLS with
    ``credentials``), a deadline per call, and the environment's ``token`` as bearer metadata if it has one."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        max_message_bytes: int = 4 << 20,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
    ) -> None:
        parse_endpoint(endpoint)
        self.name, self.endpoint, self.max_message_bytes = name, endpoint, max_message_bytes
        self._closed = False
        # the environment's own token, if it asks for one (not the run's API token)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self.channel = (
            grpc.secure_channel(endpoint, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(endpoint, options=options)
        )
        self.stub = environment_pb2_grpc.EnvironmentStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _shut(self, method: str) -> EnvironmentFailure:
        return EnvironmentFailure(
            self.name, "unavailable", f"{method} at {self.endpoint}: the client was shut down"
        )

    def _call(self, method: str, request: Any, timeout_s: float) -> Any:
        if self._closed:
            raise self._shut(method)
        try:
            return getattr(self.stub, method)(request, timeout=max(timeout_s, 0.001), metadata=self._metadata)
        except ValueError:
            if not self._closed:
                raise
            # shut down while this call was starting: grpc refuses a closed channel with a ValueError
            raise self._shut(method) from None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            reason = {
                grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
                grpc.StatusCode.UNAVAILABLE: "unavailable",
            }.get(code, "error")
            name = code.name if code is not None else "UNKNOWN"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details:
                details += (
                    f" (the limit is sampler.env_max_message_bytes = {self.max_message_bytes} bytes; raise it "
                    "or make the environment's replies smaller)"
                )
            raise EnvironmentFailure(
                self.name, reason, f"{method} at {self.endpoint}: {name}: {details}"
            ) from None

    def reset(
        self, session_id: str, task: rollout_pb2.Task, timeout_s: float
    ) -> environment_pb2.ResetResponse:
        request = environment_pb2.ResetRequest(session_id=session_id, task=task)
        reply: environment_pb2.ResetResponse = self._call("Reset", request, timeout_s)
        if any(not tool.name for tool in reply.tools):
            raise EnvironmentFailure(
                self.name, "bad_reply", f"Reset at {self.endpoint}: a tool without a name"
            )
        return reply

    def step(
        self, session_id: str, action: environment_pb2.Action, timeout_s: float
    ) -> environment_pb2.StepResponse:
        request = environment_pb2.StepRequest(session_id=session_id, action=action)
        reply: environment_pb2.StepResponse = self._call("Step", request, timeout_s)
        if not math.isfinite(reply.reward):
            raise EnvironmentFailure(
                self.name, "bad_reply", f"Step at {self.endpoint}: reward {reply.reward}"
            )
        return reply

    def close(self, session_id: str, timeout_s: float) -> None:
        self._call("Close", environment_pb2.CloseRequest(session_id=session_id), timeout_s)

    def healthy(self, timeout_s: float) -> bool:
        return self.health_problem(timeout_s) is None

    def health_problem(self, timeout_s: float) -> str | None:
        status_names = health_pb2.HealthCheckResponse.ServingStatus.Name
        for service in (SERVICE, ""):
            if self._closed:
                return "the client was shut down"
            try:
                reply = self.health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                if code == grpc.StatusCode.NOT_FOUND and service:
                    continue  # the server does not name its services: ask about the server
                return _health_failure(self.endpoint, code, details, timeout_s)
            except ValueError:  # the channel was closed meanwhile
                return "the client was shut down"
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return None
            return (
                f"the server at {self.endpoint} says it is {status_names(reply.status)}, not SERVING "
                f"(grpc.health.v1 Check of {service or 'the server'!r}); set it SERVING once it can take episodes"
            )
        return f"the server at {self.endpoint} knows neither {SERVICE!r} nor '' in grpc.health.v1"

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.channel.close()
