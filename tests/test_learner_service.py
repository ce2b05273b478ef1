"""The learner service end to end on real Redis and 2 DeepSpeed ZeRO-3 ranks: lag bound, bad input, and a
crash between a step and its checkpoint that changes nothing (bit-exact weights, every group once)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.local_ranks import scored_groups
from services.weight_transport.store import DiskStore
from tests.test_weight_broker import Broker
from vcpo.v1 import rollout_pb2

pytestmark = pytest.mark.slow

_brokers: list[Broker] = []  # started by _config, stopped after each test


@pytest.fixture(autouse=True)
def _stop_brokers() -> Iterator[None]:
    yield
    while _brokers:
        _brokers.pop().stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("learner") / "model", TinyModelSpec())


def _config(tmp: Path, run_id: str, redis_url: str, model: Path, **learner: Any) -> Path:
    """The run file of a learner that publishes to a broker of its own in this process (disk storage under
    ``<run_dir>/weights``)."""
    broker = Broker(DiskStore(tmp / run_id / "weights", retain=10))
    _brokers.append(broker)
    cfg = {
        "run": {
            "run_id": run_id,
            "k": 1,
            "groups_per_step": 2,
            "model": str(model),
            "redis_url": redis_url,
            "run_dir": str(tmp / run_id),
            "seed": 0,
        },
        "learner": {
            "num_ranks": 2,
            "micro_batch_size": 2,
            "lr": 1e-3,
            "weight_decay": 0.01,
            "max_group_size": 4,
            "checkpoint_every": 2,
            "metrics_port": 0,
            "grpc_port": 0,
            "read_block_ms": 200,
            **learner,
        },
        "weight_broker": {
            "transport": "tcp",
            "advertise_host": "127.0.0.1",
            "grpc_port": broker.server.port,
            "data_port": broker.plane.port,
        },
    }
    path = tmp / f"{run_id}.json"
    path.write_text(json.dumps(cfg))
    return path


def _learner(config: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.learner", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _fill(client: redis.Redis, run_id: str, entries: list[tuple[rollout_pb2.TrajectoryGroup, int]]) -> None:
    spec = stream_specs(RunConfig(run_id=run_id), StreamsConfig())["scored"]
    StreamProducer(client, spec).put_many(entries)


def _stream(model_dir: Path) -> tuple[list[tuple[rollout_pb2.TrajectoryGroup, int]], dict[str, list[str]]]:
    """Scored entries for 4 steps at k = 1, with a NaN reward, an oversized group and a too-old group."""
    good = iter(scored_groups(model_dir, [2, 3, 2, 3, 2, 2, 3, 2, 3, 2], seed=7))
    bad_reward, too_big, too_old = scored_groups(model_dir, [2, 5, 2], seed=8)
    bad_reward.trajectories[1].reward.value = math.nan
    order: list[tuple[str, int]] = [  # (what, policy_version_start); the learner is at version t in step t+1
        ("good", 0),
        ("nan", 0),
        ("good", 0),  # step 1 from version 0
        ("good", 0),
        ("good", 1),  # step 2 from version 1: lag 1 and 0
        ("old", 0),
        ("good", 1),
        ("good", 2),  # step 3 from version 2: lag 2 > k is dropped
        ("good", 3),
        ("big", 3),
        ("good", 2),  # step 4 from version 3
    ]
    entries, names = [], {"good": [], "dropped": [], "rejected": []}
    for what, version in order:
        group = {"nan": bad_reward, "big": too_big, "old": too_old}.get(what) or next(good)
        group = rollout_pb2.TrajectoryGroup.FromString(group.SerializeToString())
        group.group_id = f"{what}-{len(entries)}"
        group.policy_version_start = version
        for t in group.trajectories:
            t.policy_version_start = t.policy_version_end = version
        entries.append((group, version))
        names["good" if what == "good" else "dropped" if what == "old" else "rejected"].append(group.group_id)
    return entries, names


def _steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The audit log, last line per step (a step redone after a restart is logged again)."""
    lines = [json.loads(line) for line in (run_dir / "learner" / "steps.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines}


def test_crash_between_step_and_checkpoint_changes_nothing(
    tmp_path: Path, model_dir: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    entries, names = _stream(model_dir)
    for run_id in ("straight", "crashed"):
        _fill(redis_client, run_id, entries)
    straight = _config(tmp_path, "straight", redis_url, model_dir)
    crashed = _config(tmp_path, "crashed", redis_url, model_dir)

    done = _learner(straight, "--max-steps", "4")
    assert done.returncode == 0, done.stderr[-4000:]
    # steps 1-2 are checkpointed, step 3 is trained and published, then the learner dies before step 4
    died = _learner(crashed, "--max-steps", "4", "--crash-after-step", "3")
    assert died.returncode == 17, died.stderr[-4000:]
    assert "fault injection" in died.stderr
    resumed = _learner(crashed, "--max-steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step 2" in resumed.stderr
    assert "replay" in resumed.stderr

    # the same steps from the same groups: every good group exactly once, the bad ones never
    a, b = _steps(tmp_path / "straight"), _steps(tmp_path / "crashed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s]["groups"] for s in a] == [b[s]["groups"] for s in a]
    trained = [g for s in sorted(a) for g in a[s]["groups"]]
    assert sorted(trained) == sorted(names["good"])
    for s in a:
        assert a[s]["version"] == s
        for key in ("loss", "grad_norm", "ess_ratio"):
            assert a[s]["metrics"][key] == b[s]["metrics"][key], (s, key)

    # bit-exact weights of every version, as each broker stored them
    for v in range(5):
        wa = tmp_path / "straight" / "weights" / f"v{v:010d}" / "model.safetensors"
        wb = tmp_path / "crashed" / "weights" / f"v{v:010d}" / "model.safetensors"
        assert wa.read_bytes() == wb.read_bytes(), f"version {v} differs"
    v0 = (tmp_path / "straight" / "weights" / f"v{0:010d}" / "model.safetensors").read_bytes()
    assert v0 != (tmp_path / "straight" / "weights" / f"v{4:010d}" / "model.safetensors").read_bytes()

    # counted, and every consumed entry acknowledged and deleted after the final checkpoint
    for run_id in ("straight", "crashed"):
        summary = json.loads((tmp_path / run_id / "learner" / "summary.json").read_text())
        assert summary["version"] == summary["step"] == 4
        feed = summary["feed"]
        assert feed["rejected"] == {"nonfinite_reward": 1, "group_too_large": 1}
        assert feed["dropped_by_lag"] == {"2": 1}
        assert feed["trained_groups"] == 8 and feed["consumed"] == len(entries)
        spec = stream_specs(RunConfig(run_id=run_id), StreamsConfig())["scored"]
        assert redis_client.xlen(spec.key) == 0
        assert redis_client.xpending(spec.key, spec.group)["pending"] == 0


def test_k0_trains_only_on_the_current_version(
    tmp_path: Path, model_dir: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    groups = scored_groups(model_dir, [2] * 6, seed=3)
    versions = [0, 0, 0, 1, 1, 1]  # k = 0: step 1 (from version 0) takes two v0 groups ...
    entries = []
    for i, (g, v) in enumerate(zip(groups, versions, strict=True)):
        g.group_id, g.policy_version_start = f"g{i}-v{v}", v
        for t in g.trajectories:
            t.policy_version_start = t.policy_version_end = v
        entries.append((g, v))
    _fill(redis_client, "k0", entries)
    config = _config(tmp_path, "k0", redis_url, model_dir, num_ranks=1, checkpoint_every=10)
    cfg = json.loads(config.read_text())
    cfg["run"]["k"] = 0
    cfg["run"]["groups_per_step"] = 2
    config.write_text(json.dumps(cfg))
    # ... and step 2 (from version 1) drops the late v0 group and takes two v1 groups
    done = _learner(config, "--max-steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    steps = _steps(tmp_path / "k0")
    assert steps[1]["groups"] == ["g0-v0", "g1-v0"]
    assert steps[2]["groups"] == ["g3-v1", "g4-v1"]
    summary = json.loads((tmp_path / "k0" / "learner" / "summary.json").read_text())
    assert summary["feed"]["dropped_by_lag"] == {"1": 1}
    assert summary["feed"]["consumed"] == 5  # the sixth group is left for the next step


def test_status_metrics_and_graceful_stop(
    tmp_path: Path, model_dir: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    import signal
    import time
    import urllib.request

    import grpc

    from vcpo.v1 import common_pb2, common_pb2_grpc

    groups = scored_groups(model_dir, [2, 3, 2, 2, 2, 2, 2], seed=5)
    groups[1].trajectories[0].reward.value = math.nan  # bad input: rejected and counted, never trained on
    del groups[3].trajectories[1].behaviour_logprobs[:]  # missing log-probs
    groups[4].trajectories[0].loss_mask.append(True)  # a mask longer than the response
    _fill(redis_client, "live", [(g, 0) for g in groups])  # steps from versions 0 and 1 (lag 1 = k)
    spec = stream_specs(RunConfig(run_id="live"), StreamsConfig())["scored"]
    redis_client.xadd(
        spec.key, {b"policy_version": b"0", b"type": b"vcpo.v1.TrajectoryGroup", b"payload": b"\xff"}
    )
    redis_client.set("vcpo:live:admission:started", 7)  # the samplers started the 7 groups
    config = _config(tmp_path, "live", redis_url, model_dir, checkpoint_every=10)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.learner", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        endpoints = tmp_path / "live" / "learner" / "endpoints.json"
        deadline = time.monotonic() + 180
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            if endpoints.exists():
                port = json.loads(endpoints.read_text())["grpc_port"]
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    status = common_pb2_grpc.StatusStub(channel).GetStatus(
                        common_pb2.StatusRequest(), timeout=5
                    )
                if status.policy_version == 2 and status.state == common_pb2.ServiceStatus.WAITING:
                    break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert status is not None and status.policy_version == 2, status
        assert status.service == "learner" and status.run_id == "live"
        assert "waiting for scored groups" in status.detail
        assert status.figures["step"] == 2 and 0 < status.figures["ess_ratio"] <= 1

        url = json.loads(endpoints.read_text())["metrics_url"]
        text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        values = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        assert values["vcpo_learner_policy_version"] == 2
        assert values["vcpo_learner_steps_total"] == 2
        assert values['vcpo_learner_groups_dropped_total{cause="nonfinite_reward"}'] == 1
        assert values['vcpo_learner_groups_dropped_total{cause="missing_logprobs"}'] == 1
        assert values['vcpo_learner_groups_dropped_total{cause="length_mismatch"}'] == 1
        assert values['vcpo_stream_malformed_total{kind="bad_payload",stream="scored"}'] == 1
        assert values['vcpo_learner_groups_dropped_total{cause="lag"}'] == 0
        assert values["vcpo_learner_groups_trained_total"] == 4
        # the 3 rejected groups gave their admission slots back, so samplers may start others in their place
        assert int(redis_client.get("vcpo:live:admission:started")) == 4
        assert values["vcpo_learner_staleness_versions_count"] == 4
        assert values['vcpo_learner_staleness_versions_bucket{le="0.0"}'] == 2  # step 1: lag 0; step 2: lag 1
        assert values['vcpo_learner_phase_seconds_count{phase="publish"}'] == 2
        assert values['vcpo_learner_phase_seconds_count{phase="gradient"}'] == 2
        assert values['vcpo_learner_phase_seconds_count{phase="wait"}'] >= 3  # two steps' reads, then idle
        assert 0 < values["vcpo_learner_ess_ratio"] <= 1 and values["vcpo_learner_grad_norm"] > 0
        assert values["vcpo_learner_tokens_per_second"] > 0
        assert 'vcpo_learner_log_weight{quantile="0.5"}' in values

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "live" / "learner" / "summary.json").read_text())
    assert summary["step"] == 2 and summary["feed"]["consumed"] == 7  # the garbage entry went to dead letters
    assert redis_client.xlen(spec.dead_letter_key) == 1
    # the stop took a checkpoint (none was due before step 10), so every consumed entry is acknowledged
    assert (tmp_path / "live" / "learner" / "checkpoints" / "step000000002").is_dir()
    assert redis_client.xlen(spec.key) == 0


def test_ray_actor_group_trains_like_the_plain_entry_point(
    tmp_path: Path, model_dir: Path, redis_client: redis.Redis, redis_url: str, ray_local: Any
) -> None:
    from services.common.config import load_config
    from services.learner.config import LearnerServiceConfig
    from services.learner.ray_group import LearnerGroup

    groups = scored_groups(model_dir, [2, 3, 2, 2], seed=11)
    for run_id in ("plain", "ray"):
        _fill(redis_client, run_id, [(g, 0) for g in groups])
    plain = _learner(_config(tmp_path, "plain", redis_url, model_dir), "--max-steps", "2")
    assert plain.returncode == 0, plain.stderr[-4000:]
    cfg = load_config(LearnerServiceConfig, [_config(tmp_path, "ray", redis_url, model_dir)])
    group = LearnerGroup(cfg)
    try:
        group.start(max_steps=2)
        summaries = group.wait(timeout_s=240)
    finally:
        group.shutdown()
    assert [s["rank"] for s in summaries] == [0, 1]
    assert all(s["version"] == 2 for s in summaries)
    assert summaries[0]["feed"]["trained_groups"] == 4
    a, b = _steps(tmp_path / "plain"), _steps(tmp_path / "ray")
    assert [a[s]["groups"] for s in (1, 2)] == [b[s]["groups"] for s in (1, 2)]
    final = f"v{2:010d}/model.safetensors"
    assert (tmp_path / "plain" / "weights" / final).read_bytes() == (
        tmp_path / "ray" / "weights" / final
    ).read_bytes()


def test_weight_group_events_are_counted_and_set_the_epoch_gauge() -> None:
    """Each event is counted; ``formed`` sets the epoch gauge to the formed group's epoch, a failure to 0."""
    from types import SimpleNamespace

    from services.common.observability import Metrics
    from services.learner.metrics import LearnerMetrics
    from services.learner.service import LearnerRank

    registry = Metrics("learner")
    rank = SimpleNamespace(metrics=LearnerMetrics(registry, k=2), coordinator=SimpleNamespace(epoch=7))

    def sample(name: str, **labels: str) -> float | None:
        return registry.registry.get_sample_value(name, labels)

    for event in ("formed", "formed"):
        LearnerRank._group_event(rank, event)  # type: ignore[arg-type]
    assert sample("vcpo_weight_group_events_total", event="formed") == 2
    assert sample("vcpo_weight_group_epoch") == 7
    LearnerRank._group_event(rank, "broadcast_failed")  # type: ignore[arg-type]
    assert sample("vcpo_weight_group_events_total", event="broadcast_failed") == 1
    assert sample("vcpo_weight_group_epoch") == 0


@pytest.mark.parametrize("transport", ["collective", "tcp"])
def test_with_the_collective_transport_the_learner_keeps_torchs_monitor_off_a_weight_groups_failure(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set before the trainer makes the process's first NCCL group (DeepSpeed's), whose monitor would
    otherwise end learner rank 0 minutes after a failed weight broadcast (nccl_group.DUMP_ON_FAILURE)."""
    import os

    from services.learner import service
    from services.learner.config import LearnerServiceConfig
    from services.weight_transport.nccl_group import DUMP_ON_FAILURE

    monkeypatch.delenv(DUMP_ON_FAILURE, raising=False)
    seen: list[str | None] = []

    class Built(Exception):
        pass

    def trainer(*args: Any, **kwargs: Any) -> None:
        seen.append(os.environ.get(DUMP_ON_FAILURE))
        raise Built

    monkeypatch.setattr(service, "Trainer", trainer)
    cfg = LearnerServiceConfig.model_validate({"weight_broker": {"transport": transport}})
    with pytest.raises(Built):
        service.LearnerRank(cfg)
    assert seen == (["0"] if transport == "collective" else [None])


def test_an_idle_learner_republishes_the_version_its_failed_background_broadcast_lost(
    redis_client: redis.Redis,
) -> None:
    """Learner rank 0 broadcast version 4 into the weight group in the background, and that broadcast failed
    (a member left mid-broadcast): no sampler has version 4, and only the next step would publish again,
    which with k = 0 needs groups sampled from version 4, so the run would wait for good. While it waits for
    groups it notices the failure (counted, the group dropped) and republishes version 4 through the broker,
    once; a failure is not looked for when the broker was given the current version already."""
    import time
    from types import SimpleNamespace

    from services.learner.service import LearnerRank
    from services.weight_transport.group_control import GroupCoordinator
    from services.weight_transport.seats import GroupRegistry
    from tests.test_collective_weights import specs_of, version_tensors
    from tests.test_weight_group_control import Receiver, _until

    registry = GroupRegistry(redis_client, f"lost-{time.monotonic_ns()}", ttl_s=1.0)
    coordinator = GroupCoordinator(
        registry, "127.0.0.1", "gloo", timeout_s=10, form_timeout_s=3, bucket_bytes=8192
    )
    a = Receiver(registry, "sampler-0.a")
    a.start()
    rank: Any = LearnerRank.__new__(LearnerRank)
    rank.coordinator, rank._given_broker, rank.trainer = coordinator, 3, SimpleNamespace(version=4)
    try:
        _until("a group", lambda: coordinator.wait_formed(0.1), timeout_s=40)
        assert not rank._broadcast_lost()  # nothing failed
        publisher = coordinator.publisher()
        assert publisher is not None
        a.refuse = True  # leaves the group at the next announcement: the broadcast fails
        tensors = version_tensors(4)
        publisher.send_background(4, specs_of(tensors), iter(tensors))
        _until("the broadcast's end", lambda: publisher._pending is None or publisher._pending.done())
        assert rank._broadcast_lost() and coordinator.failures == 1
        assert not rank._broadcast_lost()  # once
        rank._given_broker = 4  # what the republish does
        coordinator.failures += 1  # even were another failure noticed now: the broker holds version 4
        assert not rank._broadcast_lost()
    finally:
        a.halt.set()
        a.join(10)
        coordinator.close()


def test_a_weight_group_that_cannot_be_asked_sends_the_version_through_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 asks the coordinator for the weight group before every rank agrees on the path (rank0_code):
    an error there (Redis unreachable) used to leave rank 0's publish while the other ranks waited in that
    agreement until the learner's collective timeout. The version goes through the broker's path instead, and
    the idle check asks again later."""
    from types import SimpleNamespace

    import redis as redis_lib

    from services.learner import service

    class Unreachable:
        failures = 0

        def publisher(self) -> None:
            raise redis_lib.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")

    published: list[int] = []
    monkeypatch.setattr(
        service, "publish_version", lambda module, transport, version, *a, **k: published.append(version)
    )
    rank: Any = service.LearnerRank.__new__(service.LearnerRank)
    rank.trainer, rank.rank, rank.collective = SimpleNamespace(version=5, module=None), 0, True
    rank.coordinator, rank.transport, rank._superseded, rank._given_broker = Unreachable(), object(), -1, 4
    rank.learner, rank.clock, rank.metrics = SimpleNamespace(publish_bucket_mb=1), None, None
    rank.cfg = SimpleNamespace(weight_broker=SimpleNamespace(publish_retry_s=0.0))
    assert rank._publish()[1] == "broker" and published == [5]
    rank._given_broker = 4  # as if version 5 went into the group: the idle check asks, and says nothing
    assert rank._broadcast_lost() is False
