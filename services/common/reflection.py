"""gRPC server reflection, so grpcurl, Postman and other reflection clients can call our servers without the
.proto files.

Every server :func:`services.common.observability.grpc_server` builds offers ``grpc.reflection.v1`` and
``grpc.reflection.v1alpha``. grpcio-reflection implements v1alpha only; v1 is the same service and the same
messages under a new package name (the wire format is identical), so the v1 method is served by the same
servicer with v1alpha's message classes. Reflection is never behind the API token: it describes the protos,
which are public, and says nothing about a run.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"


def enable_reflection(server: grpc.Server, service_names: Sequence[str]) -> None:
    """Serve both reflection versions on ``server``, listing ``service_names``, health and themselves."""
    names = (*service_names, health.SERVICE_NAME, V1, V1ALPHA)
    servicer = reflection.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": v1}),))
