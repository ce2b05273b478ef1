"""The broker's TCP data plane: the broker's publish and fetch messages and guarantees, over a plain socket."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch

from services.weight_broker.dataplane_server import DataPlaneServer
from services.weight_transport import dataplane
from services.weight_transport.protocol import publish_requests
from services.weight_transport.store import MemoryStore, VersionNotFound
from services.weight_transport.transports import StalePublish, VersionExists
from tests.test_weight_broker import (
    Broker,
    as_protos,
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
    assert_bit_exact(fetch_all(broker.client(chunk_bytes=10_000), 1), state_dict)  # cut and encoded anew
    names = list(state_dict)
    got: dict[str, torch.Tensor] = {}
    client.fetch(lambda n, t: got.__setitem__(n, t.clone()), start_tensor=names[5])
    assert_bit_exact(got, {n: state_dict[n] for n in names[5:]})
    # plain protobuf messages framed on the data plane: what it serves parses, and what it is sent is read
    raw = list(dataplane.fetch(broker.data_address, 1, "", 0, 30))
    fetched = [weights_pb2.FetchResponse.FromString(bytes(m)) for m in raw]
    assert fetched[0].manifest == client.versions()[0] and len(fetched) > len(state_dict)
    publish_raw(broker, as_protos(state_dict, 2))
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
    messages = list(publish_requests(1, specs_of(state_dict), source(state_dict)(), 64 << 10))
    with dataplane.connect(broker.data_address, 10) as sock:
        dataplane.send_json(sock, {"op": "publish"})
        for m in messages[: len(messages) // 2]:
            dataplane.send_frame(sock, m)
    # and one without its commit, ended cleanly
    for _ in range(100):  # until the server has seen the broken connection ("in progress" till then)
        status = dataplane.publish(broker.data_address, [(m,) for m in messages[:-1]], 10)
        if status.get("reason") != "in_progress":
            break
        time.sleep(0.05)
    assert status["ok"] is False and status["reason"] == "invalid" and "without a commit" in status["message"]
    client = broker.client()
    assert client.latest() is None and client.versions() == []
    # nothing is left behind (were the server still reading the broken one, "in progress" is retried)
    client.publish(1, specs_of(state_dict), source(state_dict))
    assert_bit_exact(fetch_all(client), state_dict)


def test_a_corrupted_chunk_is_refused(broker: Broker, state_dict: dict[str, torch.Tensor]) -> None:
    messages = [
        bytearray(m) for m in publish_requests(1, specs_of(state_dict), source(state_dict)(), 64 << 10)
    ]
    messages[3][-5] ^= 0xFF  # one flipped byte of tensor data in transit
    status = dataplane.publish(broker.data_address, [(bytes(m),) for m in messages], 10)
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
