"""The learner's gRPC face: the ``vcpo.v1.Status`` call rank 0 answers (version, step, last step's metrics).

The service loop updates a :class:`LearnerState`; the servicer only reads it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import grpc

from vcpo.v1 import common_pb2, common_pb2_grpc


@dataclass
class LearnerState:
    """What the Status call reports."""

    state: int = common_pb2.ServiceStatus.STARTING
    detail: str = "starting"
    version: int = 0
    step: int = 0
    figures: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class StatusServicer(common_pb2_grpc.StatusServicer):
    def __init__(self, status: LearnerState, run_id: str) -> None:
        self.status, self.run_id = status, run_id

    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ServiceStatus:
        s = self.status
        figures = {k: v for k, v in s.figures.items() if math.isfinite(v)}
        figures["step"] = float(s.step)
        return common_pb2.ServiceStatus(
            service="learner",
            replica_id="rank0",
            run_id=self.run_id,
            policy_version=s.version,
            state=s.state,  # type: ignore[arg-type]
            detail=s.detail,
            uptime_seconds=time.monotonic() - s.started,
            figures=figures,
        )
