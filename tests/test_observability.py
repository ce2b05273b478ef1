"""Metrics and health: /metrics parses as Prometheus text (promtool), names are enforced, gRPC health."""

from __future__ import annotations

import shutil
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from services.common.observability import Metrics, check_health, grpc_server, serve_metrics
from services.common.redis_server import free_port
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
