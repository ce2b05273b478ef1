"""The vLLM engine's side of the collective transport (:class:`~services.sampler.engine.VllmEngine` takes it
in): its workers join the weight group, receive versions from the broadcast into their staging
(services/sampler/weight_transfer.py) and load them, all through ``collective_rpc``.

Joining and receiving run on a thread in each worker: ``begin_join`` and ``begin_receive`` return at once,
the engine goes on stepping, and :meth:`CollectiveWeights.weight_work_done` (asked between steps) says when
the work has ended. ``join_weight_group`` and ``stage_collective`` are the same, waited for."""

from __future__ import annotations

import logging
import time
from typing import Any

from services.weight_transport import NoRoom

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often the waiting forms ask the workers


class CollectiveWeights:
    """Versions from the weight group beside the broker path's ``stage``/``apply``; for an engine whose
    workers run the worker extension (services/sampler/vllm_worker.py)."""

    collective_staged: int | None  # a version received from the weight group, not yet loaded
    loaded_version: int | None
    _current: Any
    _weights_epoch: int
    llm: Any
    # the work the workers are doing: ("join", None) or ("receive", version); None: none
    _weight_work: tuple[str, int | None] | None = None
    _update_open = False  # vLLM's weight-update session is open in the workers (start_weight_update)

    def _rpc(self, method: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def begin_join(self, init: dict[str, Any]) -> None:
        """Every worker starts joining the weight group ``init`` names (:class:`~services.sampler.
        weight_transfer.CollectiveInitInfo`'s fields), leaving any earlier one; returns at once."""
        try:
            self._rpc("init_weight_transfer_engine", init)
        finally:
            self._drop_receive()  # after leaving the group, which ended it
        self._weight_work = ("join", None)

    def begin_receive(self, version: int) -> None:
        """Every worker starts receiving the announced ``version`` from the broadcast into its staging; returns
        at once. The model is untouched, so the engine goes on generating under its loaded version (the
        broadcast cannot wait for a sampler that drains its groups first). A version staged and not applied
        is dropped for this one."""
        self.collective_staged = None
        try:
            if not self._update_open:
                self._rpc("start_weight_update")
                self._update_open = True
            self._rpc("update_weights", {"version": version})
        except BaseException:
            self._end_failed_update()
            raise
        self._weight_work = ("receive", version)

    def weight_work_done(self) -> bool:
        """Whether the join or receive begun last has ended in every worker (True where none was begun). A
        received version is then staged (``collective_staged``). Raises :class:`WorkerCallFailed` with the
        workers' errors if it failed anywhere (:class:`NoRoom` where a worker's device had no room for the
        version): a failed receive dropped whatever was staged, the engine still on its loaded version; the
        weight group is then closed in the workers that failed (leave it)."""
        if self._weight_work is None:
            return True
        states = self.llm.collective_rpc("vcpo_weight_work")
        if "running" in states:
            return False
        what, version = self._weight_work
        self._weight_work = None
        failed = [(rank, state) for rank, state in enumerate(states) if state is not None]
        if failed:
            if what == "receive":
                self._end_failed_update()
            from services.sampler.engine import WorkerCallFailed

            ranks = ", ".join(str(rank) for rank, _ in failed)
            doing = "joining the weight group" if what == "join" else f"receiving version {version}"
            # a worker's own lack of room first: the others' errors may only echo it
            own = [state for _, state in failed if state.startswith(f"{NoRoom.__name__}:")]
            message = f"{doing} failed in worker(s) {ranks} of {len(states)}: {(own or [failed[0][1]])[0]}"
            raise NoRoom(message) if own else WorkerCallFailed(message)
        if what == "receive":
            self.collective_staged = version
        return True

    def wait_weight_work(self) -> None:
        """Wait until :meth:`weight_work_done` (raising what it raises)."""
        while not self.weight_work_done():
            time.sleep(POLL_S)

    def join_weight_group(self, init: dict[str, Any]) -> None:
        """:meth:`begin_join`, waited for: blocks until the whole group has joined."""
        self.begin_join(init)
        self.wait_weight_work()

    def leave_weight_group(self, why: str | None = None) -> None:
        """Every worker leaves its weight group. ``why``: the sampler gave up on the epoch, which every member
        is told, so rank 0's next broadcast fails at once instead of waiting for these workers until the
        group's timeout; None: the epoch was superseded (its group let go). A receive under way fails (its
        version dropped); one received whole stays staged. Never raises: it is called on the way out of
        failures (a worker that cannot leave closes its group at the next join)."""
        try:
            self._rpc("vcpo_leave_weight_group", why)
        except Exception:
            log.exception("could not leave the weight group")
        self._drop_receive()

    def stage_collective(self, version: int) -> float:
        """:meth:`begin_receive`, waited for; returns the seconds it took. A broadcast that fails on any member
        raises here, dropping whatever was staged, with the engine still on its loaded version and the weight
        group closed (join a new one)."""
        t0 = time.monotonic()
        self.begin_receive(version)
        self.wait_weight_work()
        return time.monotonic() - t0

    def _drop_receive(self) -> None:
        """Give up a receive under way (its group is being left, which fails it); a version received whole
        stays staged."""
        if self._weight_work is not None and self._weight_work[0] == "receive":
            self._end_failed_update()
            self.collective_staged = None
        self._weight_work = None

    def _end_failed_update(self) -> None:
        self._update_open = False
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
        self._update_open = False
        # the rollback source of a later broker-path version is the initial weights (``_restore``)
        self.loaded_version, self._current = version, None
        return time.monotonic() - t0

    def receive_collective(self, version: int) -> float:
        """:meth:`stage_collective` and :meth:`apply_collective` at once (in-flight updates)."""
        return self.stage_collective(version) + self.apply_collective(version)
