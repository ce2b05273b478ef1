"""`python -m services.weight_broker` as a process: health, publish/fetch, announcement, /metrics, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis
import torch

from services.common.config import RunConfig, StreamsConfig
from services.common.observability import check_health
from services.common.ports import free_port
from services.common.streams.consumer import StreamTail
from services.common.streams.specs import stream_specs
from services.weight_transport.seats import GroupRegistry, Member
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transport import WeightTransport

ROOT = Path(__file__).parent.parent


def test_broker_process_serves_announces_and_stops_cleanly(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    port, metrics_port, data_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.weight_broker",
            "--set",
            f"run.redis_url={redis_url}",
            "--set",
            "run.run_id=svc",
            "--set",
            f"run.run_dir={tmp_path}",
            "--weight_broker.grpc_port",
            str(port),
            "--weight_broker.metrics_port",
            str(metrics_port),
            # Not the default 50055: that lies in Linux's ephemeral range, where any client socket may hold it.
            "--weight_broker.data_port",
            str(data_port),
            "--weight_broker.storage",
            "disk",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not check_health(f"127.0.0.1:{port}", "vcpo.v1.WeightBroker", timeout_s=1):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "broker did not become healthy"
            time.sleep(0.2)
        tensors = {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.ones(4, dtype=torch.bfloat16),
        }
        client = WeightTransport(f"127.0.0.1:{port}", f"127.0.0.1:{data_port}")
        client.publish(1, [TensorSpec.of(n, t) for n, t in tensors.items()], lambda: iter(tensors.items()))
        got: dict[str, torch.Tensor] = {}
        client.fetch(lambda n, t: got.__setitem__(n, t.clone()))
        assert all(got[n].equal(tensors[n]) for n in tensors)
        [entry] = StreamTail(
            redis_client, stream_specs(RunConfig(run_id="svc"), StreamsConfig())["weights"]
        ).read()
        assert entry.policy_version == 1 and entry.message.location == f"127.0.0.1:{port}"
        assert (
            tmp_path / "weights" / "v0000000001" / "model.safetensors"
        ).exists()  # disk storage in run_dir
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert (
            "vcpo_broker_versions_published_total 1.0" in body
            and "vcpo_broker_latest_policy_version 1.0" in body
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_the_broker_advertises_its_nodes_ip_on_a_cluster_and_the_loopback_on_one_machine() -> None:
    from services.weight_broker.ray_actor import advertised_host
    from services.weight_transport.config import WeightBrokerConfig

    empty, named = WeightBrokerConfig(), WeightBrokerConfig(advertise_host="broker.rl.svc")
    assert advertised_host(empty, local_ray=False, node_ip="10.1.2.3") == "10.1.2.3"
    assert advertised_host(empty, local_ray=True, node_ip="10.1.2.3") == "127.0.0.1"
    assert advertised_host(named, local_ray=False, node_ip="10.1.2.3") == "broker.rl.svc"


def test_broker_as_a_ray_actor_serves_on_free_ports_and_announces(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, ray_local: object
) -> None:
    """Started as on a Ray cluster with no advertise_host: it announces its node's IP, which the launcher
    hands to the learner and the samplers (127.0.0.1 would send every other node to itself)."""
    import ray

    from services.weight_broker.config import WeightBrokerServiceConfig
    from services.weight_broker.ray_actor import start_broker

    cfg = WeightBrokerServiceConfig.model_validate(
        {
            "run": {"run_id": "ray-broker", "redis_url": redis_url, "run_dir": str(tmp_path)},
            "weight_broker": {"grpc_port": 0, "data_port": 0, "metrics_port": 0, "transport": "collective"},
        }
    )
    assert cfg.weight_broker.advertise_host == ""
    actor, endpoints = start_broker(cfg, local_ray=False)
    node_ip = ray.util.get_node_ip_address()
    try:
        assert GroupRegistry(redis_client, "ray-broker").live() == {}  # never a member of the weight group
        assert endpoints["grpc_port"] > 0 and endpoints["data_port"] > 0
        assert endpoints["advertise_host"] == endpoints["host"] == node_ip
        port = endpoints["grpc_port"]
        assert check_health(f"127.0.0.1:{port}", "vcpo.v1.WeightBroker", timeout_s=5)
        tensors = {"w": torch.randn(5, 3)}
        client = WeightTransport(f"127.0.0.1:{port}", f"127.0.0.1:{endpoints['data_port']}")
        client.publish(2, [TensorSpec.of("w", tensors["w"])], lambda: iter(tensors.items()))
        got: dict[str, torch.Tensor] = {}
        client.fetch(lambda n, t: got.__setitem__(n, t.clone()))
        assert got["w"].equal(tensors["w"])
        [entry] = StreamTail(
            redis_client, stream_specs(RunConfig(run_id="ray-broker"), StreamsConfig())["weights"]
        ).read()
        assert entry.policy_version == 2 and entry.message.location == f"{node_ip}:{port}"
        client.close()
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)
    assert not check_health(f"127.0.0.1:{port}", "vcpo.v1.WeightBroker", timeout_s=1)


def test_the_broker_is_never_a_member_of_the_weight_group(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    """Under the collective transport the broker holds only what is published through it, on GPUs and CPUs
    alike (a CPU-only member used to make gloo runs differ from NCCL ones), and registers nothing."""
    from services.weight_broker.config import WeightBrokerServiceConfig
    from services.weight_broker.service import BrokerService

    assert Member.here("s", 2, "sampler").devices == ("cuda" if torch.cuda.is_available() else "cpu")
    assert Member.here("s", 2, "sampler", gpu=True).devices == "cuda"
    cfg = WeightBrokerServiceConfig.model_validate(
        {
            "run": {"run_id": "broker-no-member", "redis_url": redis_url, "run_dir": str(tmp_path)},
            "weight_broker": {"grpc_port": 0, "data_port": 0, "metrics_port": 0, "transport": "collective"},
        }
    )
    broker = BrokerService(cfg)
    try:
        time.sleep(0.5)
        assert GroupRegistry(redis_client, "broker-no-member").live() == {}
    finally:
        broker.close()
