"""How policy versions travel from the learner to the samplers' engines (docs/design/weight-transport.md): the
library the learner, the samplers, the evaluator and the weight broker share. The broker's process
(``services/weight_broker/``) keeps versions and serves them; this package is what every side speaks.

Other services import the names below from this package, never its modules (an import contract in
pyproject.toml holds them to it); the broker, which serves what this package defines, may use its modules.
Names load lazily, so reading a run file's ``[weight_broker]`` table (``WeightBrokerConfig``, ``broker_host``)
imports no torch.

- What the learner sends: a version through the broker (``transport_from_config``, ``WeightTransport``,
  ``PublishResult``, ``StalePublish``, ``VersionExists``), described by ``TensorSpec`` (``dtype_name``); over
  the weight group (``coordinator_from_config``, ``GroupCoordinator``, ``CollectivePublisher``,
  ``TransferStats``); ``survive_weight_group_failures`` keeps its process alive after a failed NCCL broadcast
  (``TransferFailed``).
- What an engine receives: a version fetched whole from the broker into a ``Sink`` (or ``BrokerUnavailable``,
  ``VersionNotFound``); its membership of the weight group (``GroupRegistry``, ``Member``, ``MemberSeat``,
  ``Seat``, ``AnnouncementWatch``); a worker joining the group and receiving on a thread of its own
  (``WeightGroup``, ``GroupSpec``, ``CollectiveReceiver``, ``Background``; ``NoRoom``).
- What the broker serves, with the modules: ``store``, ``protocol`` (the publish and fetch streams, both halves),
  ``dataplane`` (the TCP data plane's frames) and ``tensors``.
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
