"""The collective transport inside vLLM's workers: a weight-transfer engine registered with vLLM's factory.

vLLM 0.32 builds one ``WeightTransferEngine`` per worker from ``weight_transfer_config.backend`` and drives it
through the worker methods ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` (called here through ``collective_rpc``). Its own NCCL engine loads each tensor as
it arrives; this one, ``vcpo_collective``, receives a whole version through the weight group
(services/weight_transport/collective.py: gloo on CPU, NCCL on GPU) into buffers on the worker's device (its
GPU under NCCL: a version's bytes beside the engine, in what ``sampler.gpu_memory_utilization`` leaves free)
and loads nothing until every member voted to commit it, so a broadcast that fails part-way leaves the model as it was. ``finish_weight_update`` then
loads the version in place with vLLM's own ``reload_weights`` (the broker path's loader, whose log-probs are
tested against Hugging Face's).

Joining the group and receiving a version run on a thread of the worker's own (``receiver.Background``, on
a CUDA stream of its own), and the worker call that starts them returns at once: vLLM's engine core runs a
worker call inline in its busy loop (with one GPU, on the thread that runs the model), so a receive inside
the call held every engine in the group still from a version's first byte to its commit. The sampler asks
``vcpo_weight_work`` between steps and loads the version at the apply that follows its ``quiesce``.

Each worker receives the whole version and loads its tensor-parallel share of it, as vLLM's NCCL engine does.
Its rank in the group is ``rank_offset`` plus its rank in the engine (data-parallel index × the engine's
world size + its parallel rank).
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

from services.sampler.kernel_tensors import finish_interrupted_reload, hold
from services.weight_transport import Background, CollectiveReceiver, GroupSpec, WeightGroup

log = logging.getLogger(__name__)

BACKEND = "vcpo_collective"
# how long leaving waits for the background work to end once its group is closed (a closed group ends a
# pending collective at once; a thread still there after this is left to finish on its own)
LEAVE_WAIT_S = 10.0


def register() -> None:
    """Make ``weight_transfer_config={"backend": "vcpo_collective"}`` known to vLLM in this process (the worker
    extension module calls it on import, so every worker process has it before its engine is built)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "CollectiveWeightTransferEngine")


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """The weight group to join (:class:`GroupSpec`'s fields) and where this engine's workers start in it."""

    host: str
    port: int
    world_size: int
    rank_offset: int
    backend: str = "gloo"
    epoch: int = 0
    timeout_s: float = 120.0
    form_timeout_s: float = 30.0


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
        self._staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.work: Background | None = None  # the last join or receive started
        self._ticket: object | None = None  # the join under way (``init_transfer_engine``)
        self._lock = threading.Lock()  # the join's thread sets ``group``; leaving takes it

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        """Start joining the weight group (leaving any earlier one) in the background: the group forms once
        every member has joined (``vcpo_weight_work`` says when)."""
        self.shutdown()
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        spec = GroupSpec(
            init_info.host,
            init_info.port,
            init_info.world_size,
            init_info.backend,
            init_info.epoch,
            init_info.timeout_s,
            init_info.form_timeout_s,
        )
        device = self.device if spec.backend == "nccl" else None
        ticket = self._ticket = object()  # a join this engine left before it formed keeps no group

        def join() -> None:
            group = WeightGroup(spec, rank, device)
            with self._lock:
                left = self._ticket is not ticket
                if not left:
                    self.group = group
            if left:
                group.close()
                raise RuntimeError(f"weight group epoch {spec.epoch} was left while it formed")
            log.info(
                "joined weight group %s:%d epoch %d as rank %d of %d",
                spec.host,
                spec.port,
                spec.epoch,
                rank,
                spec.world_size,
            )

        self.work = Background("join", join, device)

    def start_weight_update(self) -> None:
        self._staged = None

    def discard_staged(self) -> None:
        """Let go of a received version not loaded (the update failed in some worker)."""
        self._staged = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Start receiving the announced version in the background (``vcpo_weight_work`` says when it is
        whole); nothing is loaded yet (``finish_weight_update`` loads it)."""
        info = self.parse_update_info(update_info)
        if self.work is not None and self.work.running:
            raise RuntimeError(f"the weight group's {self.work.what} is still under way")
        if self.group is None or self.group.closed:
            raise RuntimeError(
                "not in a weight group: init_weight_transfer_engine first (or again, after a failure)"
            )
        # a newer version replaces one staged and not yet loaded: let that go first, so the device never
        # holds two
        self._staged = None
        group = self.group
        self.work = Background("receive", lambda: self.receive_weights(group, info), group.gpu)

    def receive_weights(self, group: WeightGroup, update_info: CollectiveUpdateInfo) -> None:
        """Receive the version being broadcast into this worker's staging (the background work)."""
        version, tensors, stats = CollectiveReceiver(group).receive()
        if version != update_info.version:  # marked for every rank: none waits in the next broadcast for it
            raise group.part_failed(
                f"the weight group delivered version {version}, the control plane announced "
                f"{update_info.version}"
            )
        self._staged = (version, tensors)
        log.info(
            "received version %d into %s: %d tensors, %.1f MB in %.2f s (%.2f GB/s)",
            version,
            group.device,
            stats.tensors,
            stats.bytes / 1e6,
            stats.seconds,
            stats.gb_per_s,
        )

    def finish_weight_update(self) -> None:
        """Load the received version in place; vLLM's reload state is finished even if loading fails, and every
        layer is back on its own tensors (``kernel_tensors.py``)."""
        if self.work is not None:
            self.work.wait()  # the sampler applies after it ended; whatever it staged is whole then
        if self._staged is None:
            raise RuntimeError("finish_weight_update without a received version")
        _, tensors = self._staged
        self._staged = None
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        hold(self.model)  # the layers' own tensors, put back should the load fail in one (kernel_tensors.py)
        try:
            reload_weights(self.vllm_config, self.model, iter(tensors), None, is_checkpoint_format=True)
        except BaseException:
            finish_interrupted_reload(self.model, self.model_config)
            raise
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def leave(self, why: str | None) -> None:
        """Leave the weight group; ``why``: this engine gave up on its epoch (a join that failed in another
        worker, a failure outside the group's collectives), marked for every rank first. A member that stopped
        receiving with its group open held the next broadcast, and every other engine's loop in it, for the
        group's timeout (rank 0 saw it alive: its heartbeat goes on)."""
        if self.group is not None and why is not None and not self.group.closed:
            self.group.part_failed(f"it left the group: {why}")
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:  # a join still forming closes its own group once formed
            work, group, self.group, self.work, self._ticket = self.work, self.group, None, None, None
        if group is not None:
            group.close()  # a receive under way fails at once
        if work is not None and work.what == "receive" and not work.wait(LEAVE_WAIT_S):
            log.warning("a receive was still running %gs after its weight group was closed", LEAVE_WAIT_S)
