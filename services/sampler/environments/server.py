"""Serve any in-process :class:`Environment` over gRPC (with health), e.g. a built-in on its own.

    python -m services.sampler.environments.server --builtin python [--port N] [--host H]

An :class:`EnvironmentFailure` becomes the matching gRPC status (timeout: DEADLINE_EXCEEDED, unavailable:
UNAVAILABLE, else INTERNAL) and any other exception INTERNAL with its text, so the client-side
:class:`GrpcEnvironment` raises the same failure again. Each call's timeout is the client's deadline.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import grpc

from services.common.auth import TokenAuthInterceptor
from services.common.observability import GrpcServer, grpc_server
from services.common.tls import ServerTls, server_credentials
from services.sampler.environments.base import Environment, EnvironmentFailure
from vcpo.v1 import environment_pb2, environment_pb2_grpc

DEFAULT_TIMEOUT_S = 60.0
_CODES = {"timeout": grpc.StatusCode.DEADLINE_EXCEEDED, "unavailable": grpc.StatusCode.UNAVAILABLE}


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    """The protocol's three calls, each delegated to ``env`` under the client's deadline."""

    def __init__(self, env: Environment) -> None:
        self.env = env

    def _run(self, context: grpc.ServicerContext, fn: Any, *args: Any) -> Any:
        remaining = context.time_remaining()
        timeout = DEFAULT_TIMEOUT_S if remaining is None or remaining > 1e6 else remaining
        try:
            return fn(*args, timeout)
        except EnvironmentFailure as exc:
            context.abort(_CODES.get(exc.reason, grpc.StatusCode.INTERNAL), str(exc))
        except Exception as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def Reset(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.ResetResponse:
        reply: environment_pb2.ResetResponse = self._run(
            context, self.env.reset, request.session_id, request.task
        )
        return reply

    def Step(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.StepResponse:
        reply: environment_pb2.StepResponse = self._run(
            context, self.env.step, request.session_id, request.action
        )
        return reply

    def Close(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.CloseResponse:
        self._run(context, self.env.close, request.session_id)
        return environment_pb2.CloseResponse()


def serve_environment(
    env: Environment,
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
    max_message_bytes: int = 4 << 20,
    tls: ServerTls | None = None,
    token: str = "",
) -> GrpcServer:
    """Start a gRPC server of ``env``, with health (SERVING for "" and ``vcpo.v1.Environment``); over TLS with
    ``tls``, and refusing Environment calls without ``authorization: Bearer <token>`` when ``token`` is set
    (register it with the same ``auth_token``)."""

    def add(server: grpc.Server) -> list[str]:
        environment_pb2_grpc.add_EnvironmentServicer_to_server(EnvironmentServicer(env), server)
        return ["vcpo.v1.Environment"]

    interceptors = [TokenAuthInterceptor(token, {"vcpo.v1.Environment"})] if token else []
    return grpc_server(
        add,
        port=port,
        host=host,
        max_workers=max_workers,
        max_message_bytes=max_message_bytes,
        interceptors=interceptors,
        credentials=server_credentials(tls) if tls is not None else None,
    )


def main(argv: list[str] | None = None) -> None:
    from services.sampler.environments.builtin import BUILTINS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--builtin", required=True, choices=sorted(BUILTINS))
    parser.add_argument("--name", default="", help="the environment's name (default: the builtin's)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    env = BUILTINS[args.builtin](args.name or args.builtin)
    server = serve_environment(env, args.port, args.host)
    print(f"listening on {args.host}:{server.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2)
    env.shutdown()


if __name__ == "__main__":
    main()
