"""The collective transport inside vLLM's workers: a weight-transfer engine (``vcpo_collective``) registered
with vLLM 0.32's factory and driven through its worker methods (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``).

vLLM's own NCCL engine loads each tensor as it arrives; this one receives a whole version through the weight
group into buffers on the worker's device and loads nothing until every member voted to commit it, so a
broadcast that fails part-way leaves the model as it was. Joining and receiving run on a thread of the worker's
own (``Background``): vLLM's engine core runs a worker call inline in its busy loop, so a receive inside the call
would hold the engine still until the commit. Design: docs/design/weight-transport.md, "Into vLLM's workers".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from services.sampler.kernel_tensors import guarded_reload
from services.weight_transport import Background, CollectiveReceiver, GroupSpec, WeightGroup

log = logging.getLogger(__name__)

BACKEND = "vcpo_collective"
# how long leaving waits for a receive to end once its group is closed (which ends a pending collective at
# once; a thread still there after this is left to finish on its own)
LEAVE_WAIT_S = 10.0


def register() -> None:
    """Make the ``vcpo_collective`` backend known to vLLM in this process (vllm_worker.py calls it on import)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "CollectiveWeightTransferEngine")


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """The weight group to join and where this engine's workers start in it (``Seat.init_info()``)."""

    spec: GroupSpec
    rank_offset: int


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    """The version the control plane announced: a different one arriving is refused."""

    version: int


class CollectiveWeightTransferEngine(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: WeightGroup | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None  # a version received, not loaded
        self.work: Background | None = None  # the last join or receive started
        self._ticket: object | None = None  # the join under way
        self._lock = threading.Lock()  # the join's thread sets ``group``; leaving takes it

    def parse_init_info(self, init_dict: dict[str, Any]) -> CollectiveInitInfo:
        spec = {k: v for k, v in init_dict.items() if k != "rank_offset"}
        return CollectiveInitInfo(GroupSpec(**spec), int(init_dict["rank_offset"]))

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Start joining the weight group (leaving any earlier one); it forms once every member has joined."""
        self.shutdown()
        pc, spec = self.parallel_config, init_info.spec
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        device = self.device if spec.backend == "nccl" else None
        ticket = self._ticket = object()  # a join this engine left before it formed keeps no group

        def join() -> None:
            group = WeightGroup(spec, rank, device)
            with self._lock:
                if self._ticket is ticket:
                    self.group = group
            if self.group is not group:  # left while it formed
                group.close()
                raise RuntimeError(f"weight group epoch {spec.epoch} was left while it formed")
            where = f"{spec.host}:{spec.port} epoch {spec.epoch}"
            log.info("joined weight group %s as rank %d of %d", where, rank, spec.world_size)

        self.work = Background("join", join, device)

    def start_weight_update(self) -> None:
        self._staged = None

    discard_staged = start_weight_update  # a version received and not loaded is let go (vllm_worker.py)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Start receiving the announced version in the background; ``finish_weight_update`` loads it."""
        info = self.parse_update_info(update_info)
        if self.work is not None and self.work.running:
            raise RuntimeError(f"the weight group's {self.work.what} is still under way")
        if self.group is None or self.group.closed:
            raise RuntimeError("not in a weight group: init_weight_transfer_engine (again) first")
        self._staged = None  # a newer version replaces one not loaded: the device never holds two
        group = self.group
        self.work = Background("receive", lambda: self.receive_weights(group, info), group.gpu)

    def receive_weights(self, group: WeightGroup, update_info: CollectiveUpdateInfo) -> None:
        version, tensors, stats = CollectiveReceiver(group).receive()
        if version != update_info.version:  # marked for every rank: none waits in the next broadcast for it
            raise group.part_failed(
                f"the weight group delivered version {version}, the control plane announced "
                f"{update_info.version}"
            )
        self._staged = tensors
        took = f"{stats.bytes / 1e6:.1f} MB in {stats.seconds:.2f} s ({stats.gb_per_s:.2f} GB/s)"
        log.info("received version %d into %s: %d tensors, %s", version, group.device, stats.tensors, took)

    def finish_weight_update(self) -> None:
        """Load the received version in place (``guarded_reload``, as every load)."""
        if self.work is not None:
            self.work.wait()  # the sampler applies after it ended; whatever it staged is whole then
        tensors, self._staged = self._staged, None
        if tensors is None:
            raise RuntimeError("finish_weight_update without a received version")
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with guarded_reload(self.model, self.model_config):
            reload_weights(self.vllm_config, self.model, iter(tensors), None, is_checkpoint_format=True)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def shutdown(self, why: str | None = None) -> None:
        """Leave the weight group; ``why``: this engine gave up on its epoch, which every rank is told first (a
        member gone quiet with its group open would hold the next broadcast for the group's timeout)."""
        if self.group is not None and why is not None and not self.group.closed:
            self.group.part_failed(f"it left the group: {why}")
        with self._lock:  # a join still forming closes its own group once formed
            work, group, self.group, self.work, self._ticket = self.work, self.group, None, None, None
        if group is not None:
            group.close()  # a receive under way fails at once
        if work is not None and work.what == "receive" and not work.wait(LEAVE_WAIT_S):
            log.warning("a receive was still running %gs after its weight group was closed", LEAVE_WAIT_S)
