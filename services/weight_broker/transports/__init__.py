"""How the learner and the samplers move weights: one interface, three transports, chosen by config.

    learner (rank 0)   transport.publish(version, specs, tensors_fn)   tensors_fn() yields (name, tensor)
                                                                       one bucket at a time
    sampler            transport.fetch(sink, version=None)             sink(name, tensor), verified, in order

- ``base.py``: :class:`WeightTransport` (the interface), the bounded retries every call gets, the errors.
- ``tcp.py``: :class:`TcpTransport`, through the broker, weight bytes on its TCP data plane (the default).
- ``grpc.py``: :class:`GrpcTransport`, through the broker, everything on gRPC streams.
- ``filesystem.py``: :class:`FilesystemTransport`, the broker's disk layout on a shared path, no broker
  process; announcements go to the ``weights`` stream directly.

:func:`transport_from_config` picks one from a run's ``[weight_broker]`` section. The collective transport
(``weight_group.py``, ``collective.py``) is not one of these: it broadcasts into a process group, and what
the group does not carry goes through the broker with :class:`TcpTransport`.
"""

from __future__ import annotations

from services.common.config import RunConfig, StreamsConfig
from services.weight_broker.announce import Announcer
from services.weight_broker.config import WeightBrokerConfig, broker_host
from services.weight_broker.transports.base import (
    BrokerUnavailable,
    PublishResult,
    RetryPolicy,
    StalePublish,
    TensorSource,
    VersionExists,
    WeightTransport,
)
from services.weight_broker.transports.filesystem import FilesystemTransport
from services.weight_broker.transports.grpc import GrpcTransport
from services.weight_broker.transports.tcp import TcpTransport

__all__ = [
    "BrokerUnavailable",
    "FilesystemTransport",
    "GrpcTransport",
    "PublishResult",
    "RetryPolicy",
    "StalePublish",
    "TcpTransport",
    "TensorSource",
    "VersionExists",
    "WeightTransport",
    "transport_from_config",
]


def transport_from_config(
    wb: WeightBrokerConfig, run: RunConfig, streams: StreamsConfig, publisher: bool = False
) -> WeightTransport:
    """The run's broker-path transport from its ``[weight_broker]`` section (with ``collective``, the path for
    what the weight group does not carry: ``tcp``): ``tcp`` or ``grpc`` through the broker at
    ``advertise_host`` (127.0.0.1 when empty), or ``filesystem`` on the shared path (a publisher announces
    each version on the run's ``weights`` stream itself, as the broker would)."""
    retry = RetryPolicy(timeout_s=wb.rpc_timeout_s)
    if wb.transport == "filesystem":
        root = wb.storage_dir or str(run.run_dir / "weights")
        announcer = None
        if publisher and run.redis_url:
            from services.common.streams.producer import StreamProducer
            from services.common.streams.specs import connect, stream_specs

            spec = stream_specs(run, streams)["weights"]
            announcer = Announcer(StreamProducer(connect(run.redis_url), spec), "filesystem", root)
        return FilesystemTransport(
            root, wb.retain_versions, publisher, announcer, wb.chunk_bytes, run.run_id, retry
        )
    host = broker_host(wb)
    address = f"{host}:{wb.grpc_port}"
    if wb.transport in ("tcp", "collective"):  # collective: the broker's path is the TCP data plane
        return TcpTransport(address, f"{host}:{wb.data_port}", retry, wb.chunk_bytes, run.run_id)
    return GrpcTransport(address, retry, wb.chunk_bytes, run.run_id)
