"""How the learner and the samplers move weights through the broker: one interface, one transport.

    learner (rank 0)   transport.publish(version, specs, tensors_fn)   tensors_fn() yields (name, tensor)
                                                                       one bucket at a time
    sampler            transport.fetch(sink, version=None)             sink(name, tensor), verified, in order

- ``base.py``: :class:`WeightTransport` (the interface), the bounded retries every call gets, the errors.
- ``tcp.py``: :class:`TcpTransport`, through the broker, weight bytes on its TCP data plane.

:func:`transport_from_config` builds it from a run's ``[weight_broker]`` section. The collective transport
(``weight_group.py``, ``collective.py``) is not one of these: it broadcasts into a process group, and what
the group does not carry goes through the broker with :class:`TcpTransport`.
"""

from __future__ import annotations

from services.common.config import RunConfig
from services.weight_transport.config import WeightBrokerConfig, broker_host
from services.weight_transport.transports.base import (
    BrokerUnavailable,
    PublishResult,
    RetryPolicy,
    StalePublish,
    TensorSource,
    VersionExists,
    WeightTransport,
)
from services.weight_transport.transports.tcp import TcpTransport

__all__ = [
    "BrokerUnavailable",
    "PublishResult",
    "RetryPolicy",
    "StalePublish",
    "TcpTransport",
    "TensorSource",
    "VersionExists",
    "WeightTransport",
    "transport_from_config",
]


def transport_from_config(wb: WeightBrokerConfig, run: RunConfig) -> WeightTransport:
    """The run's broker-path transport from its ``[weight_broker]`` section (with ``collective``, the path for
    what the weight group does not carry): the broker at ``advertise_host`` (127.0.0.1 when empty)."""
    host = broker_host(wb)
    retry = RetryPolicy(timeout_s=wb.rpc_timeout_s)
    return TcpTransport(f"{host}:{wb.grpc_port}", f"{host}:{wb.data_port}", retry, wb.chunk_bytes, run.run_id)
