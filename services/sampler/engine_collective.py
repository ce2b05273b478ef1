"""The vLLM engine's side of the collective transport (:class:`~services.sampler.engine.VllmEngine` takes it
in): its workers join the weight group, receive versions from the broadcast into their staging
(services/sampler/weight_transfer.py) and load them, all through ``collective_rpc``."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class CollectiveWeights:
    """Versions from the weight group beside the broker path's ``stage``/``apply``; for an engine whose
    workers run the worker extension (services/sampler/vllm_worker.py)."""

    collective_staged: int | None  # a version received from the weight group, not yet loaded
    loaded_version: int | None
    _current: Any
    _weights_epoch: int

    def _rpc(self, method: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def join_weight_group(self, init: dict[str, Any]) -> None:
        """Every worker joins the weight group ``init`` names (:class:`~services.sampler.weight_transfer.
        CollectiveInitInfo`'s fields); blocks until the whole group has joined."""
        self._rpc("init_weight_transfer_engine", init)

    def leave_weight_group(self, why: str | None = None) -> None:
        """Every worker leaves its weight group. ``why``: the sampler gave up on the epoch, which every member
        is told, so rank 0's next broadcast fails at once instead of waiting for these workers until the
        group's timeout; None: the epoch was superseded (its group and host copy let go). Never raises: it is
        called on the way out of failures (a worker that cannot leave closes its group at the next join)."""
        try:
            self._rpc("vcpo_leave_weight_group", why)
        except Exception:
            log.exception("could not leave the weight group")

    def stage_collective(self, version: int) -> float:
        """Receive the announced ``version`` from the broadcast into the workers' staging; returns the seconds
        it took. The model is untouched, so the engine may go on generating under its loaded version until
        :meth:`apply_collective` (the broadcast cannot wait for a sampler that drains its groups first).

        A newer version staged before the last was applied replaces it. A broadcast that fails on any member
        raises here, dropping whatever was staged, with the engine still on its loaded version and the weight
        group closed (join a new one)."""
        t0 = time.monotonic()
        try:
            if self.collective_staged is None:
                self._rpc("start_weight_update")
            self._rpc("update_weights", {"version": version})
        except BaseException:
            self.collective_staged = None
            # vLLM ends the update session only in a worker whose call raised: one whose part worked (with
            # tensor parallelism, an error local to another worker) would refuse every later session
            self._end_failed_update()
            raise
        self.collective_staged = version
        return time.monotonic() - t0

    def _end_failed_update(self) -> None:
        try:  # a named worker method (vllm_worker.py)
            self._rpc("vcpo_end_failed_weight_update")
        except Exception:
            log.exception("could not end the failed weight update session")

    def apply_collective(self, version: int) -> float:
        """Load the staged ``version`` into the model; returns the seconds it took. Call between steps, after
        ``quiesce``, as for ``apply``. A load that fails part-way leaves the version unknown (``loaded_version``
        None): catch up from the broker."""
        if self.collective_staged != version:
            raise RuntimeError(
                f"version {version} is not staged from the weight group (staged: {self.collective_staged})"
            )
        t0 = time.monotonic()
        self.collective_staged = None
        self._weights_epoch += 1  # a new prefix-cache salt before any request sees the new weights
        try:
            self._rpc("finish_weight_update")
        except BaseException:
            self.loaded_version, self._current = None, None
            self._end_failed_update()  # so that the next broadcast version can be taken
            raise
        # the rollback source of a later broker-path version is the initial weights (``_restore``)
        self.loaded_version, self._current = version, None
        return time.monotonic() - t0

    def receive_collective(self, version: int) -> float:
        """:meth:`stage_collective` and :meth:`apply_collective` at once (in-flight updates)."""
        return self.stage_collective(version) + self.apply_collective(version)
