"""The broker's TCP data plane: a version as frames (manifest, the tensors' bytes, commit) over a plain socket,
with the broker's guarantees."""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from services.weight_broker.dataplane_server import DataPlaneServer
from services.weight_transport import dataplane
from services.weight_transport.dataplane import BrokenStream
from services.weight_transport.protocol import (
    IntegrityError,
    apply_publish,
    fetch_frames,
    publish_frames,
    receive_fetch,
)
from services.weight_transport.store import MemoryStore, PublishRejected, VersionNotFound
from services.weight_transport.transport import StalePublish, VersionExists
from tests.test_weight_broker import (
    Broker,
    as_frames,
    assert_bit_exact,
    fetch_all,
    fetch_concurrently,
    publish_raw,
    source,
    specs_of,
    state_dict,
)
from vcpo.v1 import weights_pb2

__all__ = ["state_dict"]  # the fixture, shared with test_weight_broker


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(MemoryStore(retain=3))
    yield b
    b.stop()


def test_round_trip_resume_and_rechunking_are_bit_exact(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    client = broker.client()
    result = client.publish(1, specs_of(state_dict), source(state_dict))
    assert result.policy_version == 1 and result.total_bytes == sum(t.nbytes for t in state_dict.values())
    assert client.latest() == 1  # control calls stay on gRPC
    assert_bit_exact(fetch_all(client), state_dict)
    assert_bit_exact(fetch_all(broker.client(chunk_bytes=10_000), 1), state_dict)  # cut smaller
    names = list(state_dict)
    got: dict[str, torch.Tensor] = {}
    client.fetch(lambda n, t: got.__setitem__(n, t.clone()), start_tensor=names[5])
    assert_bit_exact(got, {n: state_dict[n] for n in names[5:]})
    # what it serves: the manifest, then nothing but the tensors' bytes, in pieces of at most the asked size
    with dataplane.fetch(broker.data_address, 1, "", 10_000, 30) as sock:
        raw = [bytes(f) for f in dataplane.frames(sock)]
    assert weights_pb2.VersionManifest.FromString(raw[0]) == client.versions()[0]
    assert max(len(f) for f in raw[1:]) == 10_000 and len(raw) > len(state_dict)
    assert b"".join(raw[1:]) == b"".join(_bytes(t) for t in state_dict.values())
    publish_raw(broker, as_frames(state_dict, 2))
    assert_bit_exact(fetch_all(client, 2), state_dict)
    assert broker.metrics.published._value.get() == 2


def test_versions_only_move_forward(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    client = broker.client()
    client.publish(2, specs_of(state_dict), source(state_dict))
    with pytest.raises(VersionExists, match="already"):
        client.publish_once(2, specs_of(state_dict), source(state_dict)())
    with pytest.raises(StalePublish):
        client.publish_once(1, specs_of(state_dict), source(state_dict)())
    with pytest.raises(VersionNotFound):
        fetch_all(client, 1)


def test_a_connection_that_breaks_off_leaves_no_version(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    messages = as_frames(state_dict, 1)
    with dataplane.connect(broker.data_address, 10) as sock:
        dataplane.send_json(sock, {"op": "publish"})
        for m in messages[: len(messages) // 2]:
            dataplane.send_frame(sock, m)
    # and one without its commit, ended cleanly
    for _ in range(100):  # until the server has seen the broken connection ("in progress" till then)
        status = dataplane.publish(broker.data_address, messages[:-1], 10)
        if status.get("reason") != "in_progress":
            break
        time.sleep(0.05)
    assert status["ok"] is False and status["reason"] == "invalid" and "without a commit" in status["message"]
    client = broker.client()
    assert client.latest() is None and client.versions() == []
    # nothing is left behind (were the server still reading the broken one, "in progress" is retried)
    client.publish(1, specs_of(state_dict), source(state_dict))
    assert_bit_exact(fetch_all(client), state_dict)


def test_a_corrupted_payload_is_refused(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    messages = [bytearray(m) for m in as_frames(state_dict, 1)]
    messages[3][-5] ^= 0xFF  # one flipped byte of tensor data in transit
    status = dataplane.publish(broker.data_address, [bytes(m) for m in messages], 10)
    assert status["ok"] is False and status["reason"] == "integrity" and "checksum" in status["message"]
    assert broker.client().latest() is None
    assert broker.metrics.rejected.labels("integrity")._value.get() == 1


def test_four_concurrent_fetchers_get_identical_bytes(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    broker.client().publish(1, specs_of(state_dict), source(state_dict))
    for r in fetch_concurrently(broker.client, 4):
        assert_bit_exact(r, state_dict)


def test_garbage_on_the_port_is_dropped_and_serving_goes_on(
    broker: Broker, state_dict: dict[str, torch.Tensor]
) -> None:
    for junk in (b"GET / HTTP/1.1\r\n\r\n", struct.pack("!I", 5) + b"nojsn", struct.pack("!I", 2**31)):
        with socket.create_connection(("127.0.0.1", broker.plane.port), timeout=5) as sock:
            try:
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                sock.recv(1024)  # the server answers or closes; it does not hang or die
            except OSError:
                pass  # it may already have closed the connection on the bad length prefix
    client = broker.client()
    client.publish(1, specs_of(state_dict), source(state_dict))
    assert_bit_exact(fetch_all(client), state_dict)


def test_a_data_port_in_use_is_named_with_its_setting(broker: Broker) -> None:
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{broker.plane.port} \(weight_broker\.data_port\)"):
        DataPlaneServer(broker.servicer, port=broker.plane.port, host="127.0.0.1")


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.nbytes else b""


def _whole_tensors(sd: dict[str, torch.Tensor]) -> list[bytes]:
    """A publish's frames with each tensor's bytes in one payload."""
    return [bytes(f) for f in publish_frames(1, specs_of(sd), source(sd)(), 1 << 30)]


def _read_only(frames: list[bytes]) -> list[memoryview]:
    """Frames as the data plane hands them to the store: read-only views of buffers of their own."""
    return [memoryview(bytearray(f)).toreadonly() for f in frames]


def test_the_memory_store_serves_fetches_from_the_payloads_it_received(
    state_dict: dict[str, torch.Tensor],
) -> None:
    """No copy in the broker: every payload a fetch is served is a view of a buffer the publish arrived in, at
    the publisher's piece size and at a smaller one."""
    store = MemoryStore(retain=1)
    frames = _read_only(as_frames(state_dict, 1))
    apply_publish(store, iter(frames))
    received = {id(f.obj) for f in frames[1:-1]}
    for chunk_bytes in (64 << 10, 10_000):
        served = list(fetch_frames(store, 1, "", chunk_bytes))[1:]
        assert all(isinstance(f, memoryview) and id(f.obj) in received for f in served)
        assert max(len(f) for f in served) == chunk_bytes
        assert b"".join(served) == b"".join(_bytes(t) for t in state_dict.values())


def _refusal(frames: list[bytes]) -> PublishRejected:
    with pytest.raises(PublishRejected) as info:
        apply_publish(MemoryStore(retain=1), iter(_read_only(frames)))
    return info.value


def test_malformed_publishes_are_refused_with_their_reason(state_dict: dict[str, torch.Tensor]) -> None:
    import json

    frames = _whole_tensors(state_dict)
    commit = json.loads(frames[-1])
    names = [n for n, t in state_dict.items() if t.nbytes]  # one payload each
    # a payload that runs into the next tensor: the first two tensors' bytes in one frame
    spanning = _refusal([frames[0], frames[1] + frames[2], *frames[3:]])
    assert spanning.reason == "invalid" and "never spans two tensors" in str(spanning)
    assert repr(names[0]) in str(spanning)
    wrong_tensor = _refusal(
        [*frames[:-1], json.dumps({**commit, "checksums": commit["checksums"][::-1]}).encode()]
    )
    assert wrong_tensor.reason == "integrity" and "checksum" in str(wrong_tensor)
    wrong_version = _refusal([*frames[:-1], json.dumps({**commit, "checksum": "xxh3_128:0"}).encode()])
    assert wrong_version.reason == "integrity" and "version checksum" in str(wrong_version)
    not_a_commit = _refusal([*frames[:-1], b"{}"])
    assert not_a_commit.reason == "invalid" and "not a commit" in str(not_a_commit)
    extra = _refusal([*frames, frames[1]])
    assert extra.reason == "invalid" and "after the commit" in str(extra)
    garbage = _refusal([b"\xff\xff\xff", *frames[1:]])
    assert garbage.reason == "invalid" and "manifest" in str(garbage)


def _serve(frames: list[bytes]) -> socket.socket:
    """A connection whose peer sends ``frames`` and then the end frame (from a thread: they outgrow the
    socket's buffer), or until the connection is closed."""
    ours, theirs = socket.socketpair()

    def send() -> None:
        with theirs, contextlib.suppress(OSError):
            for f in frames:
                dataplane.send_frame(theirs, f)
            dataplane.send_end(theirs)

    threading.Thread(target=send, daemon=True).start()
    return ours


def test_the_fetching_side_refuses_a_malformed_stream_before_its_sink_sees_it(
    state_dict: dict[str, torch.Tensor],
) -> None:
    store = MemoryStore(retain=1)
    apply_publish(store, iter(_read_only(_whole_tensors(state_dict))))
    served = [bytes(f) for f in fetch_frames(store, 1, "", 1 << 30)]  # one payload per tensor
    names = [n for n, t in state_dict.items() if t.nbytes]
    seen: list[str] = []
    with _serve(served) as sock:
        manifest = receive_fetch(sock, lambda n, t: seen.append(n))
    assert seen == list(state_dict) and manifest.policy_version == 1  # empty tensors too
    before_third = list(state_dict)[: list(state_dict).index(names[2])]
    for frames, error, match, delivered in (
        ([served[0], served[1] + served[2], *served[3:]], BrokenStream, "bytes left of the tensor", []),
        ([served[0], served[1][:-1] + b"x", *served[2:]], IntegrityError, re.escape(repr(names[0])), []),
        (served[:3], BrokenStream, "ended inside tensor", before_third),
        ([*served, served[1]], BrokenStream, "frames after its last tensor", list(state_dict)),
    ):
        seen.clear()
        with _serve(frames) as sock, pytest.raises(error, match=match):
            receive_fetch(sock, lambda n, t: seen.append(n))
        assert seen == delivered, match
