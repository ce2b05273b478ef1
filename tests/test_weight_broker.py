"""The weight broker over real gRPC, its TCP data plane and real Redis: exact round-trips, atomic publishes,
retention, restarts."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from services.common.config import RunConfig, StreamsConfig
from services.common.observability import GrpcServer, Metrics, grpc_server
from services.common.streams.consumer import StreamTail
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.sampler.weights import WeightSync
from services.weight_broker.dataplane_server import DataPlaneServer
from services.weight_broker.servicer import Announcer, BrokerMetrics, WeightBrokerServicer, add_to_server
from services.weight_transport import dataplane
from services.weight_transport.protocol import publish_frames
from services.weight_transport.store import (
    DiskStore,
    MemoryStore,
    PublishRejected,
    VersionNotFound,
    VersionStore,
    version_dir,
)
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transport import (
    BrokerUnavailable,
    RetryPolicy,
    StalePublish,
    VersionExists,
    WeightTransport,
)
from tests.sampler_helpers import DictEngine
from vcpo.v1 import weights_pb2

FAST = RetryPolicy(attempts=2, initial_backoff_s=0.05, timeout_s=30)


@pytest.fixture(scope="module")
def state_dict(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model_dir = build_tiny_model(tmp_path_factory.mktemp("broker") / "model", TinyModelSpec())
    tensors = load_file(model_dir / "model.safetensors")
    tensors["extra.bf16"] = torch.randn(3, 5).to(torch.bfloat16)  # another dtype
    tensors["extra.scalar"] = torch.tensor(2.5)  # zero-dimensional
    tensors["extra.empty"] = torch.zeros(0, 4)  # no bytes at all
    return tensors


def specs_of(sd: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(n, t) for n, t in sd.items()]


def source(sd: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    return lambda: iter(sd.items())


class Broker:
    """The broker in this process, as ``service.py`` wires it: its gRPC server and its TCP data plane."""

    def __init__(
        self, store: VersionStore, announcer: Announcer | None = None, chunk_bytes: int = 64 << 10
    ) -> None:
        self.metrics = BrokerMetrics(Metrics("test-broker"))
        self.servicer = WeightBrokerServicer(store, self.metrics, announcer, chunk_bytes)
        self.server: GrpcServer = grpc_server(
            lambda s: add_to_server(self.servicer, s), port=0, host="127.0.0.1"
        )
        self.plane = DataPlaneServer(self.servicer, port=0, host="127.0.0.1", timeout_s=10)
        self.address = f"127.0.0.1:{self.server.port}"
        self.data_address = f"127.0.0.1:{self.plane.port}"

    def client(self, **kwargs: Any) -> WeightTransport:
        return WeightTransport(
            self.address, self.data_address, **{"retry": FAST, "chunk_bytes": 64 << 10, **kwargs}
        )

    def stop(self) -> None:
        self.plane.stop()
        self.server.stop(0)


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(MemoryStore(retain=3))
    yield b
    b.stop()


def fetch_all(transport: WeightTransport, version: int | None = None) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    transport.fetch(lambda name, t: got.__setitem__(name, t.clone()), version)
    return got


def fetch_concurrently(make_client: Callable[[], WeightTransport], n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` fetches of the latest version at once, each with its own client; any error fails the test."""
    results: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    errors: list[BaseException] = []

    def fetch(i: int) -> None:
        try:
            results[i] = fetch_all(make_client())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    return results


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].reshape(-1).view(torch.uint8).equal(b[name].reshape(-1).view(torch.uint8)), name


def test_round_trip_of_a_tiny_model_is_bit_exact(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    client = broker.client()
    assert client.latest() is None
    result = client.publish(1, specs_of(state_dict), source(state_dict))
    assert result.policy_version == 1 and result.total_bytes == sum(t.nbytes for t in state_dict.values())
    assert client.latest() == 1
    assert_bit_exact(fetch_all(client), state_dict)  # served as the very messages received
    assert_bit_exact(fetch_all(client, 1), state_dict)
    other_chunking = broker.client(chunk_bytes=10_000)  # cut and encoded anew
    assert_bit_exact(fetch_all(other_chunking, 1), state_dict)
    [manifest] = client.versions()
    assert manifest.policy_version == 1 and all(t.checksum.startswith("xxh3_128:") for t in manifest.tensors)


def test_versions_only_move_forward(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    client = broker.client()
    client.publish(5, specs_of(state_dict), source(state_dict))
    with pytest.raises(VersionExists, match="version 5 is already published"):
        client.publish(5, specs_of(state_dict), source(state_dict))
    with pytest.raises(StalePublish, match="version 4 is older than the latest published version 5"):
        client.publish(4, specs_of(state_dict), source(state_dict))
    assert broker.metrics.rejected.labels("stale")._value.get() == 1
    assert broker.metrics.rejected.labels("duplicate")._value.get() == 1
    client.publish(6, specs_of(state_dict), source(state_dict))
    assert client.latest() == 6


def as_frames(sd: dict[str, torch.Tensor], version: int) -> list[bytes]:
    """A publish's frames (manifest, payloads of at most 64 KiB, commit), each as bytes of its own."""
    return [bytes(f) for f in publish_frames(version, specs_of(sd), iter(sd.items()), 64 << 10)]


def publish_raw(broker: Broker, frames: Iterable[bytes]) -> dict[str, Any]:
    """``frames`` sent as they are on the data plane; the broker's answer (``ok``, or the ``reason`` and
    ``message`` of a refusal)."""
    return dataplane.publish(broker.data_address, frames, 30)


def _broken_off(sd: dict[str, torch.Tensor], version: int) -> Iterator[bytes]:
    """A publish stream that dies half-way through, as when the learner crashes."""
    for i, frame in enumerate(as_frames(sd, version)):
        if i == 10:
            raise RuntimeError("learner died")
        yield frame


def test_interrupted_publish_leaves_no_version(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    with pytest.raises(RuntimeError, match="learner died"):
        publish_raw(broker, _broken_off(state_dict, 1))
    # a stream that ends without its commit is refused too
    without_commit = as_frames(state_dict, 1)[:-1]
    deadline = time.monotonic() + 10  # the broker releases the broken-off publish once it sees the stream end
    while (answer := publish_raw(broker, without_commit))["reason"] == "in_progress":
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)
    assert answer["reason"] == "invalid" and "without a commit" in answer["message"], answer
    client = broker.client()
    assert client.latest() is None and client.versions() == []
    # nothing is left in progress: the same version publishes cleanly afterwards
    client.publish(1, specs_of(state_dict), source(state_dict))
    assert_bit_exact(fetch_all(client), state_dict)


def test_a_publish_the_store_could_not_take_is_counted_and_the_next_one_is_stored(
    state_dict: dict[str, torch.Tensor],
) -> None:
    """A full disk under the broker mid-publish: answered as ``store_error`` naming the disk's error (the
    connection used to just close, and the learner saw a broken stream), counted as
    ``rejected{reason="store_error"}``, and the store takes the next version. A learner whose stream broke is
    not counted so."""

    class FullOnce(MemoryStore):
        def begin(self, manifest: Any) -> Any:
            writer = super().begin(manifest)
            if manifest.policy_version == 3:

                def full(chunk: Any) -> None:
                    raise OSError(28, "No space left on device")

                writer.write = full
            return writer

    broker = Broker(FullOnce(retain=3))
    try:
        answer = publish_raw(broker, as_frames(state_dict, 3))
        assert answer["reason"] == "store_error" and "No space left on device" in answer["message"], answer
        with pytest.raises(PublishRejected, match="No space left on device") as info:  # the learner's client
            broker.client().publish_once(3, specs_of(state_dict), source(state_dict)())
        assert info.value.reason == "store_error" and broker.client().is_transient(info.value)
        assert broker.metrics.rejected.labels("store_error")._value.get() == 2
        with pytest.raises(RuntimeError, match="learner died"):
            publish_raw(broker, _broken_off(state_dict, 4))
        assert broker.metrics.rejected.labels("store_error")._value.get() == 2  # a broken stream is not
        client = broker.client()
        client.publish(5, specs_of(state_dict), source(state_dict))
        assert client.latest() == 5
    finally:
        broker.stop()


def test_a_disk_store_whose_disk_filled_mid_publish_takes_the_next_version(
    tmp_path: Path, state_dict: dict[str, torch.Tensor]
) -> None:
    """The disk fills while version 3 is written: its file's buffered bytes cannot be written when the writer
    is discarded either. That second error used to skip the store's release of the publish, which stayed "in
    progress": the store refused every later version until the broker restarted."""
    import errno
    import io

    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    class FullOnce(DiskStore):
        def begin(self, manifest: Any) -> Any:
            writer = super().begin(manifest)
            if manifest.policy_version == 3:  # what is written stays in the buffer until the disk refuses it
                writer._file.close()
                writer._file = io.BufferedWriter(Full(), buffer_size=1 << 30)
            return writer

    broker = Broker(FullOnce(tmp_path, retain=3))
    try:
        answer = publish_raw(broker, as_frames(state_dict, 3))
        assert answer["reason"] == "store_error" and "No space left on device" in answer["message"], answer
        assert broker.metrics.rejected.labels("store_error")._value.get() == 1
        client = broker.client()
        client.publish(4, specs_of(state_dict), source(state_dict))
        assert client.latest() == 4 and sorted(p.name for p in tmp_path.iterdir()) == ["v0000000004"]
        assert_bit_exact(fetch_all(client), state_dict)
    finally:
        broker.stop()


def test_corrupted_chunk_is_detected(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    frames = as_frames(state_dict, 1)
    name = next(n for n, t in state_dict.items() if t.nbytes)  # frames[1] is its first payload
    frames[1] = bytes([frames[1][0] ^ 0xFF]) + frames[1][1:]  # one flipped byte in transit
    answer = publish_raw(broker, frames)
    assert answer["reason"] == "integrity", answer
    assert "checksum" in answer["message"] and repr(name) in answer["message"]
    assert broker.client().latest() is None
    assert broker.metrics.rejected.labels("integrity")._value.get() == 1


def test_corruption_at_rest_is_detected_by_the_fetcher(
    tmp_path: Path, state_dict: dict[str, torch.Tensor]
) -> None:
    b = Broker(DiskStore(tmp_path / "store", retain=2))
    try:
        client = b.client()
        client.publish(1, specs_of(state_dict), source(state_dict))
        weights = next((tmp_path / "store").glob("v*/model.safetensors"))
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0x01  # a bit flips on disk
        weights.write_bytes(bytes(raw))
        with pytest.raises(BrokerUnavailable, match=r"IntegrityError: version 1, tensor .* checksum"):
            fetch_all(client)
    finally:
        b.stop()


def test_four_concurrent_fetchers_get_identical_bytes(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    broker.client().publish(1, specs_of(state_dict), source(state_dict))
    for r in fetch_concurrently(broker.client, 4):
        assert_bit_exact(r, state_dict)
    # the server counts a fetch when its stream closes, just after the client has the last chunk
    complete = broker.metrics.fetches.labels("complete")._value
    deadline = time.monotonic() + 5
    while complete.get() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert complete.get() == 4


def test_retention_drops_the_oldest(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    client = broker.client()
    for v in range(1, 6):
        client.publish(v, specs_of(state_dict), source(state_dict))
    assert [m.policy_version for m in client.versions()] == [3, 4, 5]
    with pytest.raises(VersionNotFound, match=r"version 1 is not retained \(retained: \[3, 4, 5\]\)"):
        fetch_all(client, 1)
    assert broker.metrics.stored._value.get() == 3 * sum(t.nbytes for t in state_dict.values())


def test_fetch_resumes_from_a_given_tensor(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    client = broker.client()
    client.publish(1, specs_of(state_dict), source(state_dict))
    names = list(state_dict)
    got: dict[str, torch.Tensor] = {}
    client.fetch(lambda n, t: got.__setitem__(n, t.clone()), start_tensor=names[7])
    assert list(got) == names[7:]
    assert_bit_exact(got, {n: state_dict[n] for n in names[7:]})


class _CutFetch(WeightTransport):
    """A client whose fetch connections its sink can cut (a stream broken off mid-version); it records the
    (version, start tensor) each connection asked for."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker.address, broker.data_address, retry=FAST, chunk_bytes=64 << 10)
        self.asked: list[tuple[int | None, str]] = []
        self.sock: Any = None

    @contextmanager
    def _fetch_stream(self, version: int | None, start_tensor: str) -> Iterator[Any]:
        self.asked.append((version, start_tensor))
        with super()._fetch_stream(version, start_tensor) as sock:
            self.sock = sock
            yield sock


def test_a_broken_off_fetch_continues_its_version_from_the_first_tensor_not_received(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    """The stream breaks after 5 tensors, just as a newer version lands: the retry asks for the version the
    fetch began from the 6th tensor on, so the sink gets every tensor of that version once and no mix."""
    publisher = broker.client()
    publisher.publish(1, specs_of(state_dict), source(state_dict))
    newer = {n: t + 1 if t.is_floating_point() else t for n, t in state_dict.items()}
    names, client, got = list(state_dict), _CutFetch(broker), {}

    def sink(name: str, tensor: torch.Tensor) -> None:
        got[name] = tensor.clone()
        if len(got) == 5 and len(client.asked) == 1:
            publisher.publish(2, specs_of(newer), source(newer))
            client.sock.close()  # the connection is gone mid-version

    manifest = client.fetch(sink)
    assert manifest.policy_version == 1 and client.latest() == 2
    assert client.asked == [(None, ""), (1, names[5])]
    assert_bit_exact(got, state_dict)


def test_announcement_arrives_on_the_weights_stream(
    redis_client: redis.Redis, state_dict: dict[str, torch.Tensor]
) -> None:
    spec = stream_specs(RunConfig(run_id="wb"), StreamsConfig())["weights"]
    b = Broker(MemoryStore(retain=2), Announcer(StreamProducer(redis_client, spec), "broker:1234"))
    try:
        b.client().publish(7, specs_of(state_dict), source(state_dict))
        [entry] = StreamTail(redis_client, spec).read()
        a = entry.message
        assert entry.policy_version == 7 and a.policy_version == 7
        assert a.location == "broker:1234"
        assert a.manifest.total_bytes == sum(t.nbytes for t in state_dict.values())
        assert [t.name for t in a.manifest.tensors] == list(state_dict)
        assert a.manifest.checksum == b.client().versions()[0].checksum
    finally:
        b.stop()


def test_disk_retention_survives_a_broker_restart(
    tmp_path: Path, state_dict: dict[str, torch.Tensor]
) -> None:
    b = Broker(DiskStore(tmp_path / "store", retain=2))
    for v in (1, 2, 3):
        b.client().publish(v, specs_of(state_dict), source(state_dict))
    b.stop()
    (tmp_path / "store" / ".v0000000004.partial-1-dead").mkdir()  # what a crash mid-publish leaves
    restarted = Broker(DiskStore(tmp_path / "store", retain=2))
    try:
        client = restarted.client()
        assert [m.policy_version for m in client.versions()] == [2, 3]
        assert_bit_exact(fetch_all(client, 2), state_dict)
        assert not list((tmp_path / "store").glob(".v*"))  # the partial version is gone
        with pytest.raises(StalePublish):
            client.publish(1, specs_of(state_dict), source(state_dict))
    finally:
        restarted.stop()


def test_disk_versions_load_as_ordinary_safetensors(
    tmp_path: Path, state_dict: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import load_file

    b = Broker(DiskStore(tmp_path / "store", retain=2))
    try:
        b.client().publish(3, specs_of(state_dict), source(state_dict))
        assert_bit_exact(load_file(version_dir(tmp_path / "store", 3) / "model.safetensors"), state_dict)
    finally:
        b.stop()


def test_publisher_checks_tensors_against_the_manifest(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    specs = specs_of(state_dict)
    wrong = dict(state_dict)
    first = next(iter(wrong))
    wrong[first] = wrong[first].double()
    with pytest.raises(ValueError, match=rf"tensor 0 is TensorSpec\(name='{first}', dtype='float64'"):
        list(publish_frames(1, specs, iter(wrong.items())))
    with pytest.raises(ValueError, match="the source ended at tensor 3"):
        list(publish_frames(1, specs, iter(list(state_dict.items())[:3])))
    with pytest.raises(ValueError, match=r"more tensors than the header named, e\.g\. 'extra'"):
        list(publish_frames(1, specs, iter([*state_dict.items(), ("extra", torch.zeros(1))])))
    # through the client, the caller sees that error, not a broken connection
    with pytest.raises(ValueError, match=rf"tensor 0 is TensorSpec\(name='{first}', dtype='float64'"):
        broker.client().publish(1, specs, source(wrong))
    assert broker.client().latest() is None


def test_unreachable_broker_fails_after_bounded_retries() -> None:
    from services.common.ports import free_port

    retry = RetryPolicy(attempts=3, initial_backoff_s=0.01, timeout_s=2)
    client = WeightTransport(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", retry=retry)
    with pytest.raises(
        BrokerUnavailable, match=r"latest version from 127.0.0.1:\d+ failed 3 times; last error: UNAVAILABLE"
    ):
        client.latest()
    with pytest.raises(
        BrokerUnavailable,
        match=r"fetch of the latest version .* failed 3 times; last error: ConnectionRefused",
    ):
        fetch_all(client)


def test_weight_sync_stages_announced_versions_whole_and_says_why_it_waits(
    redis_client: redis.Redis, state_dict: dict[str, torch.Tensor]
) -> None:
    from services.common.admission import AdmissionCounter

    spec = stream_specs(RunConfig(run_id="follow"), StreamsConfig())["weights"]
    b = Broker(MemoryStore(retain=2), Announcer(StreamProducer(redis_client, spec), "x"))
    engine = DictEngine()
    sync = WeightSync(engine, b.client(), StreamTail(redis_client, spec))
    assert not sync.poll() and sync.fetched is None and sync.ready() is None  # nothing published yet
    b.client().publish(0, specs_of(state_dict), source(state_dict))
    assert sync.poll() and sync.fetched == 0 and engine.loaded_version is None  # staged, not applied yet
    assert sync.ready() == 0
    sync.apply(0)
    assert engine.loaded_version == 0 and sync.ready() is None
    assert_bit_exact(engine.model, state_dict)
    assert engine.events == [("stage", 0), ("apply", 0)]

    # the broker goes away after announcing version 1 but before anyone fetched it
    b.client().publish(1, specs_of(state_dict), source(state_dict))
    b.stop()
    sync.transport = b.client(retry=RetryPolicy(attempts=2, initial_backoff_s=0.01, timeout_s=2))
    assert not sync.poll() and sync.newest_known == 1
    assert sync.fetched == 0 and engine.events[-2:] == [("stage", 1), ("discard", 1)]
    assert engine.staged_version() is None and sync.ready() is None  # nothing of version 1 is kept
    assert engine.loaded_version == 0  # version 0 stays, whole
    assert_bit_exact(engine.model, state_dict)
    counter = AdmissionCounter(redis_client, "follow", k=1, groups_per_step=2)
    admitted = [counter.try_admit(engine.loaded_version) for _ in range(5)]
    assert [a.admitted for a in admitted] == [True] * 4 + [False]  # keeps generating while the bound allows
    reason = sync.waiting_reason(admitted[-1])
    assert "lag bound reached" in reason and "serving version 0" in reason
    assert re.search(r"cannot get newer weights for \d+s: .*ConnectionRefusedError", reason), reason


def test_weight_sync_with_a_filter_fetches_only_the_versions_it_wants(
    redis_client: redis.Redis, state_dict: dict[str, torch.Tensor]
) -> None:
    spec = stream_specs(RunConfig(run_id="filter"), StreamsConfig())["weights"]
    b = Broker(MemoryStore(retain=2), Announcer(StreamProducer(redis_client, spec), "x"))
    asked: list[int] = []

    def wanted(version: int) -> bool:
        asked.append(version)
        return version % 3 == 0

    engine = DictEngine()
    sync = WeightSync(engine, b.client(), StreamTail(redis_client, spec), wanted=wanted)
    try:
        for version in range(5):
            b.client().publish(version, specs_of(state_dict), source(state_dict))
            sync.poll()
            sync.poll()  # a refused version is asked about once
        assert [e for e in engine.events if e[0] == "stage"] == [("stage", 0), ("stage", 3)]
        assert sync.fetched == 3 and sync.ready() == 3 and sync.newest_known == 4
        assert asked == [0, 1, 2, 3, 4] and sync.declined == 4 and sync.declined_total == 3
        assert sync.unreachable_since is None and not sync.error
    finally:
        b.stop()


def test_frames_any_client_writes_interoperate_on_the_data_plane(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    """A publish framed by hand as another language would (a protobuf manifest, each tensor's bytes in one
    frame, a JSON commit) is what the broker reads, and its fetch parses the same way."""
    import json

    import xxhash

    def hashed(t: torch.Tensor) -> str:
        return "xxh3_128:" + xxhash.xxh3_128_hexdigest(raw_bytes(t))

    manifest = weights_pb2.VersionManifest(
        policy_version=2, total_bytes=sum(t.nbytes for t in state_dict.values())
    )
    for name, t in state_dict.items():
        manifest.tensors.add(
            name=name, dtype=str(t.dtype).removeprefix("torch."), shape=t.shape, nbytes=t.nbytes
        )
    checksums = [hashed(t) for t in state_dict.values()]
    lines = "".join(f"{n}\0{c}\n" for n, c in zip(state_dict, checksums, strict=True))
    commit = {"checksums": checksums, "checksum": "xxh3_128:" + xxhash.xxh3_128_hexdigest(lines.encode())}
    payloads = [raw_bytes(t) for t in state_dict.values() if t.nbytes]
    frames = [manifest.SerializeToString(), *payloads, json.dumps(commit).encode()]
    assert publish_raw(broker, frames)["policy_version"] == 2
    assert_bit_exact(fetch_all(broker.client()), state_dict)  # our client reads what the plain frames wrote
    with dataplane.fetch(broker.data_address, None, "", 0, 30) as sock:
        raw = [bytes(f) for f in dataplane.frames(sock)]
    fetched = weights_pb2.VersionManifest.FromString(raw[0])
    assert fetched.policy_version == 2 and [t.checksum for t in fetched.tensors] == checksums
    assert b"".join(raw[1:]) == b"".join(payloads)  # the tensors' bytes, nothing else


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.nbytes else b""


def test_weight_sync_fetches_a_version_whose_announcement_was_lost(
    redis_client: redis.Redis, state_dict: dict[str, torch.Tensor]
) -> None:
    """The broker could not announce version 1 (Redis out of reach for a moment: counted, and the version is
    committed and fetchable). The weight sync asks the broker's latest version beside the announcements, so
    it is not missed until version 2 comes, which with k = 0 and one sampler never would."""
    spec = stream_specs(RunConfig(run_id=f"lost-{time.monotonic_ns()}"), StreamsConfig())["weights"]

    class LosesOne(Announcer):
        def announce(self, manifest: Any) -> None:
            if manifest.policy_version == 1:
                raise redis.ConnectionError("Connection reset by peer")
            super().announce(manifest)

    b = Broker(MemoryStore(retain=2), LosesOne(StreamProducer(redis_client, spec), "x"))
    engine = DictEngine()
    sync = WeightSync(engine, b.client(), StreamTail(redis_client, spec), latest_every_s=0.0)
    try:
        b.client().publish(0, specs_of(state_dict), source(state_dict))
        assert sync.poll() and sync.fetched == 0
        b.client().publish(1, specs_of(state_dict), source(state_dict))
        assert sync.poll() and sync.fetched == 1 and sync.ready() == 1
        assert not sync.poll()  # nothing newer
    finally:
        b.stop()
