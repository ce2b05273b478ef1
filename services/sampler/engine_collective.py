"""The vLLM engine's side of the collective transport, beside the broker path's ``stage``/``apply``
(:class:`~services.sampler.engine.VllmEngine` takes it in): through ``collective_rpc`` its workers
(vllm_worker.py, weight_transfer.py) join the weight group, receive versions and load them. ``begin_join`` and
``begin_receive`` return at once (the workers' own threads do the work while the engine steps);
``weight_work_done``, asked between steps, says when it ended."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from services.weight_transport import NoRoom

log = logging.getLogger(__name__)


class CollectiveWeights:
    collective_staged: int | None  # a version received from the weight group, not yet loaded
    loaded_version: int | None
    _current: Any
    _weights_epoch: int
    llm: Any
    # the work the workers are doing: ("join", None) or ("receive", version); None: none
    _weight_work: tuple[str, int | None] | None = None
    _update_open = False  # vLLM's weight-update session is open in the workers (start_weight_update)
    _rpc: Callable[..., None]  # a worker method on every worker (``VllmEngine._rpc``)

    def begin_join(self, init: dict[str, Any]) -> None:
        """Every worker starts joining the weight group ``init`` names (``Seat.init_info()``), leaving any
        earlier one (which ends a receive under way there)."""
        self._weight_work = None
        self._rpc("init_weight_transfer_engine", init)
        self._weight_work = ("join", None)

    def begin_receive(self, version: int) -> None:
        """Every worker starts receiving the announced ``version``; it replaces a version staged, not applied."""
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
        """Whether the join or receive begun last has ended in every worker (a version received is then
        ``collective_staged``); raises :class:`WorkerCallFailed` (:class:`NoRoom` where a worker's device had
        no room for the version) if it failed anywhere: nothing staged, the group closed where it failed."""
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

    def leave_weight_group(self, why: str | None = None) -> None:
        """Every worker leaves its weight group, telling every member ``why`` the sampler gave up on the epoch
        (None: superseded). A receive under way fails; a version received whole stays staged. Never raises:
        it runs on the way out of failures (a worker that cannot leave closes its group at the next join)."""
        try:
            self._rpc("vcpo_leave_weight_group", why)
        except Exception:
            log.exception("could not leave the weight group")
        self._weight_work = None

    def _end_failed_update(self) -> None:
        self._update_open = False
        try:  # a named worker method (vllm_worker.py)
            self._rpc("vcpo_end_failed_weight_update")
        except Exception:
            log.exception("could not end the failed weight update session")

    def apply_collective(self, version: int) -> float:
        """Load the staged ``version`` (as ``apply``); the seconds it took. A load that fails part-way leaves
        no known version (``loaded_version`` None): catch up from the broker."""
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
