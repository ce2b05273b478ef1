"""Bearer-token authentication of client-facing gRPC calls, and where a run's API token comes from.

Every call to a protected service must carry ``authorization: Bearer <token>`` metadata; anything else is
refused with UNAUTHENTICATED before the servicer runs (compared in constant time). Internal services (Status,
gRPC health) stay open to probes.

The token, in order: the configured value (on a cluster: an environment variable from a Kubernetes Secret),
else the contents of the configured token file, else ``<run_dir>/api_token``, created with a random token
(mode 0600) by whichever replica gets there first, so every replica of a local run shares it and a user finds
it beside the run's other outputs.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import grpc

TOKEN_FILENAME = "api_token"


def resolve_api_token(token: str, token_file: str, run_dir: Path) -> tuple[str, str]:
    """(the token, where it came from)."""
    if token:
        return token, "configuration"
    if token_file:
        path = Path(token_file)
        value = path.read_text().strip()
        if not value:
            raise ValueError(f"API token file {path} is empty")
        return value, str(path)
    path = run_dir / TOKEN_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        value = path.read_text().strip()
        if value:
            return value, str(path)
        raise ValueError(
            f"API token file {path} exists but is empty; remove it or configure a token"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))  # no newline: clients that read the file whole send it as is
    return path.read_text().strip(), str(path)


def bearer(token: str) -> tuple[tuple[str, str]]:
    """The metadata a client sends: ``stub.Call(request, metadata=bearer(token))``."""
    return (("authorization", f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls to ``services`` (full names, e.g. ``vcpo.v1.EnvironmentRegistry``) without the token."""

    def __init__(
        self, token: str, services: Collection[str], on_refused: Callable[[str], None] | None = None
    ) -> None:
        if not token:
            raise ValueError("an empty API token would let anyone in")
        self._expected = f"Bearer {token}".encode()
        self.services = frozenset(services)
        self.on_refused = on_refused

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method: str = handler_call_details.method  # "/vcpo.v1.EnvironmentRegistry/SubmitTasks"
        if method.split("/")[1] not in self.services:
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._expected):
            return continuation(handler_call_details)
        why = "no authorization metadata" if not sent else "a wrong token"
        if self.on_refused is not None:
            self.on_refused(method)
        message = f"{method}: {why}; send 'authorization: Bearer <token>' (the run's API token)"
        return _refusal(continuation(handler_call_details), message)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind (unary or streaming each way) as the method's own, that only refuses."""
    if handler is None:  # no such method: let gRPC answer UNIMPLEMENTED
        return None

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        abort,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
