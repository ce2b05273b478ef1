"""Publishing from 2 DeepSpeed ZeRO-3 ranks (gloo, CPU): bucket by bucket, bit-exact, and no hang on failure."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.ports import free_port
from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.weight_transport.store import MemoryStore
from services.weight_transport.transport import RetryPolicy, WeightTransport
from tests.test_weight_broker import Broker

BUCKET = 200_000  # bytes: several buckets for the tiny model


def _zero3_module(rank: int, port: int, model_dir: str) -> Any:
    """This spawned process as rank ``rank`` of 2 DeepSpeed ZeRO-3 ranks (gloo): the partitioned model."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    import deepspeed
    from transformers import AutoModelForCausalLM

    from services.learner.trainer import init_distributed

    init_distributed("gloo", 1800)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # torch's AdamW, as the trainer passes it: DeepSpeed's own "AdamW" is its FusedAdam, JIT-compiled on a
    # machine's first use (a minute here)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert hasattr(next(engine.module.parameters()), "ds_id")  # really partitioned
    return engine.module


def _spawn_ranks(target: Any, *args: Any) -> list[tuple[Any, ...]]:
    """``target(rank, port, *args, out)`` on 2 spawned ranks; their reports, sorted by rank, once both exited 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, results
    return results


def _rank(rank: int, port: int, model_dir: str, broker: tuple[str, str], attempts: int, out: Any) -> None:
    try:
        from services.learner.publish import GatherStats, publish_version

        module = _zero3_module(rank, port, model_dir)
        retry = RetryPolicy(attempts=1, timeout_s=30)
        transport = WeightTransport(*broker, retry=retry) if rank == 0 else None
        stats = GatherStats()
        try:
            result = publish_version(
                module, transport, 1, rank, BUCKET, attempts=attempts, backoff_s=0.05, stats=stats
            )
            out.put(
                (rank, "ok", result.policy_version if result else None, stats.buckets, stats.max_bucket_bytes)
            )
        except Exception as exc:
            out.put((rank, "error", f"{type(exc).__name__}: {exc}", stats.buckets, 0))
    except BaseException as exc:
        out.put((rank, "crash", f"{type(exc).__name__}: {exc}", 0, 0))
        raise


def run_ranks(model_dir: Path, broker: tuple[str, str], attempts: int = 2) -> list[tuple[Any, ...]]:
    return _spawn_ranks(_rank, str(model_dir), broker, attempts)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("zero3") / "model", TinyModelSpec())


@pytest.mark.slow
def test_zero3_ranks_publish_bucket_by_bucket_bit_exact(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    broker = Broker(MemoryStore(2))
    try:
        results = run_ranks(model_dir, (broker.address, broker.data_address))
        assert [r[:3] for r in results] == [(0, "ok", 1), (1, "ok", None)], results
        reference = dict(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()
        )
        largest = max(p.numel() * p.element_size() for p in reference.values())
        for _, _, _, buckets, biggest in results:  # gathered a bucket at a time, never the whole model
            assert buckets > 3 and biggest <= max(BUCKET, largest)
        got: dict[str, torch.Tensor] = {}
        broker.client().fetch(lambda n, t: got.__setitem__(n, t.clone()), 1)
        assert list(got) == list(reference)  # Hugging Face names, in order
        for name, p in reference.items():
            assert torch.equal(got[name], p.detach()), name
    finally:
        broker.stop()


@pytest.mark.slow
def test_a_failed_publish_raises_on_every_rank_without_hanging(model_dir: Path) -> None:
    nobody = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")  # nobody listens there
    results = run_ranks(model_dir, nobody, attempts=2)
    assert [r[:2] for r in results] == [(0, "error"), (1, "error")], results
    assert "ConnectionRefusedError" in results[0][2]
    assert "rank 0 failed to publish version 1" in results[1][2]
    assert results[1][3] > 3 * 2  # rank 1 took part in every bucket's gather, in both attempts


def test_the_publish_outcome_travels_on_the_backends_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL communicates CUDA tensors only: the outcome flag rank 0 broadcasts goes on the current CUDA
    device there (a CPU flag failed at version 0 with "No backend type associated with device type cpu"),
    on the CPU under gloo. The real NCCL broadcast runs in tests/test_trainer.py's gpu-marked publish."""
    import torch.distributed as dist

    from services.learner import publish

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert publish.collective_device() == torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert publish.collective_device() == torch.device("cpu")


def _collective_rank(rank: int, port: int, model_dir: str, spec: dict[str, Any], out: Any) -> None:
    try:
        from services.learner.publish import GatherStats, publish_collective
        from services.weight_transport.collective import CollectivePublisher
        from services.weight_transport.weight_group import GroupSpec, WeightGroup

        module = _zero3_module(rank, port, model_dir)
        publisher = CollectivePublisher(WeightGroup(GroupSpec(**spec), 0), 100_000) if rank == 0 else None
        stats = GatherStats()
        try:
            result = publish_collective(module, publisher, 1, rank, BUCKET, stats)
            out.put((rank, "ok", result.version if result else None, stats.buckets, stats.max_bucket_bytes))
        except Exception as exc:
            out.put((rank, "error", f"{type(exc).__name__}: {exc}", stats.buckets, 0))
    except BaseException as exc:
        out.put((rank, "crash", f"{type(exc).__name__}: {exc}", 0, 0))
        raise


def _weight_receiver(spec: dict[str, Any], behaviour: str, out: Any) -> None:
    from services.weight_transport.receiver import CollectiveReceiver
    from services.weight_transport.weight_group import GroupSpec, TransferFailed, WeightGroup

    group = WeightGroup(GroupSpec(**spec), 1)
    if behaviour == "die-after-header":
        group.ready(1)  # as a receiver says it is in its receive
        group.broadcast(torch.zeros(3, dtype=torch.int64)).wait()
        os._exit(3)
    try:
        # as a sampler does: rank 0 gathers and stages the whole version (longer than the group's timeout on a
        # loaded machine) before it announces it and its first collective
        while group.next_announcement(timeout_s=1.0) is None:
            pass
        version, tensors, _ = CollectiveReceiver(group).receive()
        # numpy arrays travel by value (a tensor would be a handle into this process, gone once it exits)
        arrays = [(n, t.numpy().copy()) for n, t in tensors]
        out.put(("receiver", version, arrays))
    except TransferFailed as exc:
        out.put(("receiver", "failed", str(exc)))


def run_collective(model_dir: Path, behaviour: str) -> tuple[list[tuple[Any, ...]], Any]:
    ctx = mp.get_context("spawn")
    got = ctx.Queue()
    # the receiver waits at the rendezvous while both ranks build their ZeRO-3 module, which has taken over the
    # default 30 s on a loaded 2-core machine
    spec = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": 2,
        "timeout_s": 20.0,
        "form_timeout_s": 120.0,
    }
    receiver = ctx.Process(target=_weight_receiver, args=(spec, behaviour, got))
    receiver.start()
    results = _spawn_ranks(_collective_rank, str(model_dir), spec)
    received = got.get(timeout=60) if behaviour == "ok" else None
    receiver.join(60)
    return results, received


@pytest.mark.slow
def test_zero3_ranks_broadcast_a_version_into_the_weight_group_bit_exact(model_dir: Path) -> None:
    """Gathered bucket by bucket on both ranks, into the receiver bit-exact over the group's sockets."""
    from transformers import AutoModelForCausalLM

    results, received = run_collective(model_dir, "ok")
    assert [r[:3] for r in results] == [(0, "ok", 1), (1, "ok", None)], results
    assert all(buckets > 3 for *_, buckets, _ in results)  # gathered a bucket at a time on both ranks
    reference = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    _, version, tensors = received
    assert version == 1 and [n for n, _ in tensors] == list(reference)  # Hugging Face names, in order
    for name, array in tensors:
        assert torch.equal(torch.from_numpy(array), reference[name].detach()), name


@pytest.mark.slow
def test_a_receiver_killed_mid_broadcast_fails_every_learner_rank_without_hanging(model_dir: Path) -> None:
    results, _ = run_collective(model_dir, "die-after-header")
    assert [r[:2] for r in results] == [(0, "error"), (1, "error")], results
    assert results[0][2].startswith("TransferFailed: version 1")
    assert "rank 0's broadcast failed" in results[1][2]
    assert results[1][3] > 3  # rank 1 took part in every bucket's gather


class _FlakyTransport:
    """A broker-path transport whose first ``fail`` publishes find nobody listening (a broker being
    restarted), and which then answers with ``then`` (None: takes the version)."""

    where = "flaky"

    def __init__(self, fail: int, then: Exception | None = None) -> None:
        self.fail, self.then, self.calls = fail, then, 0

    def publish_once(self, version: int, specs: Any, tensors: Any) -> Any:
        from services.weight_transport.transport import PublishResult

        self.calls += 1
        for _ in tensors:  # consumes the gathered buckets as a real transport does
            pass
        if self.calls <= self.fail:
            raise ConnectionRefusedError("nobody listens")
        if self.then is not None:
            raise self.then
        return PublishResult(version, 1, 0.0)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)


def test_a_publish_rides_out_a_broker_restart_and_a_redone_version_counts_as_published() -> None:
    """The broker's restart (Ray brings it back on its ports) outlasts the plain attempts: the publish goes on
    retrying for ``retry_s``. A learner group restarted from its checkpoint redoes steps whose versions the
    broker already holds, or has moved past: both count as published, so the run goes on."""
    from services.learner.publish import publish_version
    from services.weight_transport.transport import StalePublish, VersionExists

    module = torch.nn.Linear(4, 4)
    flaky = _FlakyTransport(fail=5)
    result = publish_version(module, flaky, 7, 0, attempts=2, backoff_s=0.01, retry_s=30.0)
    assert result is not None and result.policy_version == 7 and flaky.calls == 6
    for answer in (VersionExists("version 7 is already published"), StalePublish("7 is older than 9")):
        result = publish_version(module, _FlakyTransport(0, answer), 7, 0)
        assert result is not None and result.policy_version == 7
    down = _FlakyTransport(fail=1 << 30)
    with pytest.raises(ConnectionRefusedError):  # no retry window: the plain attempts, then the error
        publish_version(module, down, 7, 0, attempts=3, backoff_s=0.01)
    assert down.calls == 3
