"""The launcher's start-up waits (:class:`Waits`, a part of :class:`~deploy.launcher_services.Services`): each
polls its service until it is up, and names what Ray has not placed.

Each wait polls every 0.5 s up to ``launcher.start_timeout_s``: a service that finishes (fails) while it is
awaited raises, and a stop request (Ctrl-C) meanwhile raises KeyboardInterrupt.

Placement: Ray queues an actor or a placement group it has no room for and tells the caller nothing, so a
replica whose GPUs something else holds looked like one whose engine was slow to start ("the samplers were not
generating after 600s", pointing at logs its process never wrote). Past ``launcher.unplaced_report_s`` a wait
asks Ray's GCS which of its actors are still pending creation and what each node has free, prints a line naming
each ("sampler replica 3: no node has 1 GPU free (free now: ...)"), and its timeout's error names them. The
learner's ranks are placed as one placement group inside ``LearnerGroup``, which waits for it without a word
and cannot be told to stop waiting: the launcher first reserves a group of the same bundles itself
(:meth:`Waits.learner_room`), waits on that one (naming it, stoppable), gives it back and starts the learner
on the room it has just seen free. The reservation is also what an autoscaler sees asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from deploy.config import SystemConfig
from deploy.launcher_starting import Starting
from deploy.launcher_stopping import Stopping
from deploy.preflight import actor_pending, demands, unplaced

log = logging.getLogger("vcpo.launch")
T = TypeVar("T")


class Waits:
    """The start-up waits of :class:`~deploy.launcher_services.Services` (which sets these attributes)."""

    cfg: SystemConfig
    stopping: Stopping
    run_dir: Path
    learner: Any
    samplers: list[Any]
    sampler_runs: list[Any]
    evaluator: Any
    evaluator_run: Any
    reward_start: Starting | None

    def _demand(self, kind: str) -> tuple[dict[str, float], str]:
        """What one ``kind`` ("sampler replica", ...) asks Ray for, and the keys that size it."""
        d = next(d for d in demands(self.cfg) if d.kind == kind)
        return dict(d.resources), d.keys

    def _pending(self, actors: list[Any], kind: str, names: Callable[[int], str]) -> list[str]:
        """A line for each of ``actors`` Ray has not placed yet, naming it and what the nodes have free."""
        waiting = [i for i, a in enumerate(actors) if actor_pending(a)]
        if not waiting:
            return []
        resources, keys = self._demand(kind)
        first = names(waiting[0])
        why = unplaced(first, resources, keys) or (
            f"{first}: pending creation, though a node has room for it (its process is starting)"
        )
        if len(waiting) == 1:
            return [why]
        return [why, f"and {len(waiting) - 1} more: {', '.join(names(i) for i in waiting[1:])}"]

    def learner_room(self, timeout_s: float | None = None) -> None:
        """Until the cluster has room for the learner's ranks, placed as ``LearnerGroup`` places them (one PACK
        group of a bundle per rank); the reservation is given back at once."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        timeout_s = self.cfg.launcher.start_timeout_s if timeout_s is None else timeout_s
        lr = self.cfg.learner
        bundle, keys = self._demand("learner rank")
        pg = placement_group([dict(bundle) for _ in range(lr.num_ranks)], strategy="PACK")
        placed = pg.ready()
        what = f"learner ({lr.num_ranks} rank{'s' if lr.num_ranks != 1 else ''})"
        try:
            self._await(
                lambda: True if ray.wait([placed], timeout=0)[0] else None,
                timeout_s,
                f"the learner's ranks were not placed in {timeout_s:.0f}s",
                lambda: [line for line in [unplaced(what, bundle, keys, lr.num_ranks)] if line],
            )
        finally:
            remove_placement_group(pg)

    def wait_samplers(self, timeout_s: float | None = None) -> None:
        """Until every sampler replica has its engine and weights (its status is past STARTING)."""
        timeout_s = self.cfg.launcher.start_timeout_s if timeout_s is None else timeout_s
        import ray

        def ready() -> bool | None:
            _raise_if_finished(self.sampler_runs, "a sampler finished before it generated")
            if any(actor_pending(a) for a in self.samplers):
                return None
            statuses = ray.get([a.status.remote() for a in self.samplers], timeout=60)
            return True if all(s["state"] != "STARTING" for s in statuses) else None

        self._await(
            ready,
            timeout_s,
            f"the samplers were not generating after {timeout_s:.0f}s; see {self.run_dir / 'logs'}",
            lambda: self._pending(self.samplers, "sampler replica", lambda i: f"sampler replica {i}"),
        )

    def wait_evaluator(self, timeout_s: float | None = None) -> None:
        """Until the dedicated evaluator has its engine and the version the learner published at start."""
        timeout_s = self.cfg.launcher.start_timeout_s if timeout_s is None else timeout_s
        import ray

        def ready() -> int | None:
            _raise_if_finished([self.evaluator_run], "the evaluator finished before it evaluated")
            if actor_pending(self.evaluator):
                return None
            version: int | None = ray.get(self.evaluator.first_version.remote(), timeout=60)
            return version

        self._await(
            ready,
            timeout_s,
            f"the evaluator was not following the versions after {timeout_s:.0f}s; see "
            f"{self.run_dir / 'logs' / 'evaluator.log'}",
            lambda: self._pending([self.evaluator], "evaluator", lambda _: "evaluator"),
        )

    def wait_learner(self, timeout_s: float | None = None) -> int:
        """Until learner rank 0 has published its version at start (0, or its checkpoint's after a restart);
        returns it."""
        timeout_s = self.cfg.launcher.start_timeout_s if timeout_s is None else timeout_s

        def ready() -> int | None:
            # a rank that failed at start raises here
            _raise_if_finished(self.learner.runs, "the learner finished before it published a version")
            version = self.learner.started()
            return None if version is None else int(version)

        return self._await(
            ready,
            timeout_s,
            f"the learner published no version in {timeout_s:.0f}s; see {self.run_dir / 'logs'}",
        )

    def wait_reward(self, timeout_s: float | None = None) -> None:
        """Until the reward app's deployment (started by ``up``) has its replicas ready."""
        timeout_s = self.cfg.launcher.start_timeout_s if timeout_s is None else timeout_s
        start = self.reward_start
        assert start is not None

        def ready() -> bool | None:
            if not start.done(0):
                return None
            start.result()  # raises what the deploy raised
            return True

        def pending() -> list[str]:
            import ray

            if not ray.is_initialized():
                return []
            resources, keys = self._demand("reward replica")
            why = unplaced("reward replica", resources, keys)
            return [why] if why else []

        self._await(
            ready,
            timeout_s,
            f"the reward app was not ready after {timeout_s:.0f}s; see {self.run_dir / 'logs'}",
            pending,
        )

    def _await(
        self,
        ready: Callable[[], T | None],
        timeout_s: float,
        late: str,
        pending: Callable[[], list[str]] | None = None,
    ) -> T:
        """Call ``ready`` every 0.5 s until it returns something other than None (it raises for a service that
        failed meanwhile) and return that; a stop request raises KeyboardInterrupt, and ``timeout_s`` without
        an answer TimeoutError: what ``pending`` names as not placed, else ``late``. Past
        ``launcher.unplaced_report_s``, what ``pending`` names is printed. A call into an actor that did not
        answer in time (Ray's GetTimeoutError: not placed yet, its GPUs still held or its node not joined) is
        not an answer."""
        from ray.exceptions import GetTimeoutError

        start = time.monotonic()
        deadline = start + timeout_s
        report_at = start + self.cfg.launcher.unplaced_report_s
        while time.monotonic() < deadline:
            try:
                value = ready()
            except GetTimeoutError:  # not ready yet: the start goes on waiting, up to the deadline
                value = None
            if value is not None:
                return value
            if self.stopping.event.is_set():
                raise KeyboardInterrupt
            if pending is not None and time.monotonic() >= report_at:
                lines = _ask(pending)
                for line in lines:
                    print(f"  [..] not placed   {line} ({time.monotonic() - start:.0f}s)", flush=True)
                # said once per wait; asked again a while later when all was placed
                report_at = float("inf") if lines else time.monotonic() + self.cfg.launcher.unplaced_report_s
            time.sleep(0.5)
        named = _ask(pending) if pending is not None else []
        if named:
            raise TimeoutError(f"not placed by Ray after {timeout_s:.0f}s: " + "; ".join(named))
        raise TimeoutError(late)


def _ask(pending: Callable[[], list[str]]) -> list[str]:
    """What ``pending`` names; nothing where Ray cannot say (its state API is a diagnosis, never a failure)."""
    try:
        return pending()
    except Exception:
        log.warning("could not ask Ray what it has not placed", exc_info=True)
        return []


def _raise_if_finished(refs: list[Any], what: str) -> None:
    """A service awaited at start-up that finished has failed: its error is raised, else ``what``."""
    import ray

    done, _ = ray.wait(refs, timeout=0)
    if done:
        ray.get(done)
        raise RuntimeError(what)
