"""What the weight broker's process reads: the shared sections and ``[weight_broker]``."""

from __future__ import annotations

from pydantic import Field

from services.common.config import ServiceConfig
from services.weight_transport.config import WeightBrokerConfig


class WeightBrokerServiceConfig(ServiceConfig):
    weight_broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)
