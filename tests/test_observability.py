"""Metrics and health: /metrics parses as Prometheus text (promtool), names are enforced, gRPC health."""

from __future__ import annotations

import errno
import shutil
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from services.common.observability import Metrics, check_health, grpc_server, serve_metrics
from services.common.ports import free_port
from vcpo.v1 import common_pb2, common_pb2_grpc


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_endpoint_serves_prometheus_text_that_promtool_accepts() -> None:
    metrics = Metrics("test")
    metrics.counter("vcpo_stream_entries_written_total", "Entries written", ["stream"]).labels(
        "rollouts"
    ).inc(3)
    metrics.gauge("vcpo_learner_ess_ratio", "ESS / B of the last step").set(0.5)
    metrics.histogram(
        "vcpo_learner_staleness_versions", "Lag of consumed rollouts", buckets=[0, 1, 2, 4]
    ).observe(1)
    healthy = {"ok": True}
    server = serve_metrics(metrics, port=0, healthy=lambda: healthy["ok"])
    try:
        status, body = _get(f"{server.url}/metrics")
        assert status == 200
        assert 'vcpo_stream_entries_written_total{stream="rollouts"} 3.0' in body
        assert "vcpo_learner_ess_ratio 0.5" in body
        assert 'vcpo_learner_staleness_versions_bucket{le="1.0"} 1.0' in body
        promtool = shutil.which("promtool")
        assert promtool, "promtool missing: `make setup` installs Debian's prometheus package"
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert _get(f"{server.url}/healthz") == (200, "ok\n")
        healthy["ok"] = False
        assert _get(f"{server.url}/healthz")[0] == 503
        assert _get(f"{server.url}/other")[0] == 404
    finally:
        server.close()


def test_a_metrics_port_in_use_is_named_in_the_error() -> None:
    taken = serve_metrics(Metrics("first"), port=0)
    try:
        with pytest.raises(
            OSError, match=f"could not serve learner's /metrics on 0.0.0.0:{taken.port}"
        ) as err:
            serve_metrics(Metrics("learner"), port=taken.port)
        assert err.value.errno == errno.EADDRINUSE
    finally:
        taken.close()


def test_metric_names_are_enforced() -> None:
    metrics = Metrics("test")
    with pytest.raises(ValueError, match="must match"):
        metrics.gauge("learner_ess_ratio", "no prefix")
    with pytest.raises(ValueError, match="must end in _total"):
        metrics.counter("vcpo_groups", "counter without _total")
    a = metrics.counter("vcpo_things_total", "x", ["kind"])
    assert metrics.counter("vcpo_things_total", "x", ["kind"]) is a  # shared, not duplicated
    with pytest.raises(ValueError, match="already exists as Counter"):
        metrics.gauge("vcpo_things_total", "x")


class _Status(common_pb2_grpc.StatusServicer):
    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ServiceStatus:
        return common_pb2.ServiceStatus(
            service="test", state=common_pb2.ServiceStatus.READY, policy_version=7
        )


def test_grpc_server_serves_health_and_its_services() -> None:
    def add(server: grpc.Server) -> list[str]:
        common_pb2_grpc.add_StatusServicer_to_server(_Status(), server)
        return ["vcpo.v1.Status"]

    server = grpc_server(add, port=0)
    target = f"127.0.0.1:{server.port}"
    try:
        assert check_health(target) and check_health(target, "vcpo.v1.Status")
        assert not check_health(target, "vcpo.v1.Unknown")
        with grpc.insecure_channel(target) as channel:
            reply = common_pb2_grpc.StatusStub(channel).GetStatus(common_pb2.StatusRequest(), timeout=5)
        assert reply.policy_version == 7 and reply.state == common_pb2.ServiceStatus.READY
        server.set_serving("vcpo.v1.Status", serving=False)
        assert not check_health(target, "vcpo.v1.Status")
    finally:
        server.stop(0)
    assert not check_health(target, timeout_s=0.5)


def test_grpc_server_reports_a_port_it_cannot_bind() -> None:
    port = free_port()
    first = grpc_server(lambda s: [], port=port, host="127.0.0.1")
    try:
        with pytest.raises(OSError, match=f"could not bind gRPC server to 127.0.0.1:{port}"):
            grpc_server(lambda s: [], port=port, host="127.0.0.1")
    finally:
        first.stop(0)


def test_grpc_servers_offer_reflection_v1_and_v1alpha_without_the_api_token() -> None:
    """A reflection client (grpcurl, Postman) lists the services and reads their protos from the server itself,
    over grpc.reflection.v1 and v1alpha, also where the API token guards the service."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from services.common.auth import TokenAuthInterceptor

    def add(server: grpc.Server) -> list[str]:
        common_pb2_grpc.add_StatusServicer_to_server(_Status(), server)
        return ["vcpo.v1.Status"]

    guard = TokenAuthInterceptor("secret", {"vcpo.v1.Status"}, lambda _: None)
    server = grpc_server(add, port=0, interceptors=[guard])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for version in ("v1", "v1alpha"):
                call = channel.stream_stream(
                    f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                listed, found = call(
                    iter(
                        [
                            reflection_pb2.ServerReflectionRequest(list_services=""),
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="vcpo.v1.Status"),
                        ]
                    ),
                    timeout=5,
                )
                names = {s.name for s in listed.list_services_response.service}
                assert names == {
                    "vcpo.v1.Status",
                    "grpc.health.v1.Health",
                    "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection",
                }, version
                files = [
                    descriptor_pb2.FileDescriptorProto.FromString(raw)
                    for raw in found.file_descriptor_response.file_descriptor_proto
                ]
                status = next(f for f in files if f.name == "vcpo/v1/common.proto")
                service = next(s for s in status.service if s.name == "Status")
                assert [m.name for m in service.method] == ["GetStatus"], version
            with pytest.raises(grpc.RpcError) as info:  # the service itself still needs the token
                common_pb2_grpc.StatusStub(channel).GetStatus(common_pb2.StatusRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)
