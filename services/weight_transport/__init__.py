"""How policy versions travel from the learner to the samplers' engines: the library the learner, the samplers,
the evaluator and the weight broker share. The broker's process (``services/weight_broker/``) is the service
that keeps versions and serves them; this package is what every side speaks.

Other services import the names below from this package, never its modules (an import contract in
pyproject.toml holds them to it); the broker, which serves what this package defines, may use its modules.
Names load lazily, so reading a run file's ``[weight_broker]`` table imports no torch.

What the learner sends:

- ``transport_from_config``, ``WeightTransport``, ``PublishResult``, ``StalePublish``, ``VersionExists``: a
  version published through the broker (``transport``).
- ``TensorSpec``, ``dtype_name``: a version's tensors as the wire names them (``tensors``).
- ``GroupCoordinator``, ``coordinator_from_config``, ``CollectivePublisher``, ``TransferStats``: the weight
  group's control plane on learner rank 0 and its broadcasts (``group_control``, ``collective``).
- ``TransferFailed``, ``survive_weight_group_failures``: a failed broadcast, and the NCCL setting that keeps a
  process alive after one (``weight_group``, ``nccl_group``).

What an engine receives:

- ``Sink``, ``BrokerUnavailable``, ``VersionNotFound``: where a version fetched whole from the broker goes, and why
  a fetch failed (``protocol``, ``transport``, ``store``).
- ``GroupRegistry``, ``Member``, ``MemberSeat``, ``Seat``, ``AnnouncementWatch``: an engine's membership of the
  weight group (``seats``, ``weight_group``).
- ``GroupSpec``, ``WeightGroup``, ``CollectiveReceiver``, ``Background``, ``NoRoom``: a worker joining the
  group and receiving versions on a thread of its own (``weight_group``, ``receiver``).

Configuration: ``WeightBrokerConfig`` (the ``[weight_broker]`` table), ``broker_host`` (``config``).

What the broker serves, the modules it uses: ``store`` (versioned storage), ``protocol`` (the publish and fetch
streams, both halves), ``dataplane`` (the TCP data plane's frames and client calls), ``tensors``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.weight_transport.buckets import TransferStats
    from services.weight_transport.collective import CollectivePublisher
    from services.weight_transport.config import WeightBrokerConfig, broker_host
    from services.weight_transport.group_control import GroupCoordinator, coordinator_from_config
    from services.weight_transport.nccl_group import survive_weight_group_failures
    from services.weight_transport.protocol import Sink
    from services.weight_transport.receiver import Background, CollectiveReceiver, NoRoom
    from services.weight_transport.seats import GroupRegistry, Member, MemberSeat, Seat
    from services.weight_transport.store import VersionNotFound
    from services.weight_transport.tensors import TensorSpec, dtype_name
    from services.weight_transport.transport import (
        BrokerUnavailable,
        PublishResult,
        StalePublish,
        VersionExists,
        WeightTransport,
        transport_from_config,
    )
    from services.weight_transport.weight_group import (
        AnnouncementWatch,
        GroupSpec,
        TransferFailed,
        WeightGroup,
    )

_WHERE = {
    "TransferStats": "buckets",
    "CollectivePublisher": "collective",
    "WeightBrokerConfig": "config",
    "broker_host": "config",
    "GroupCoordinator": "group_control",
    "coordinator_from_config": "group_control",
    "survive_weight_group_failures": "nccl_group",
    "Sink": "protocol",
    "Background": "receiver",
    "CollectiveReceiver": "receiver",
    "NoRoom": "receiver",
    "GroupRegistry": "seats",
    "Member": "seats",
    "MemberSeat": "seats",
    "Seat": "seats",
    "VersionNotFound": "store",
    "TensorSpec": "tensors",
    "dtype_name": "tensors",
    "BrokerUnavailable": "transport",
    "PublishResult": "transport",
    "StalePublish": "transport",
    "VersionExists": "transport",
    "WeightTransport": "transport",
    "transport_from_config": "transport",
    "AnnouncementWatch": "weight_group",
    "GroupSpec": "weight_group",
    "TransferFailed": "weight_group",
    "WeightGroup": "weight_group",
}
__all__ = [
    "AnnouncementWatch",
    "Background",
    "BrokerUnavailable",
    "CollectivePublisher",
    "CollectiveReceiver",
    "GroupCoordinator",
    "GroupRegistry",
    "GroupSpec",
    "Member",
    "MemberSeat",
    "NoRoom",
    "PublishResult",
    "Seat",
    "Sink",
    "StalePublish",
    "TensorSpec",
    "TransferFailed",
    "TransferStats",
    "VersionExists",
    "VersionNotFound",
    "WeightBrokerConfig",
    "WeightGroup",
    "WeightTransport",
    "broker_host",
    "coordinator_from_config",
    "dtype_name",
    "survive_weight_group_failures",
    "transport_from_config",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
