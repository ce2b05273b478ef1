"""The learner as a Ray actor group: one actor per rank, all in one placement group.

    placement group: learner.num_ranks bundles of {CPU: 1, GPU: learner.gpus_per_rank}, packed
    every actor imports the learner's modules; then rank 0's picks the rendezvous address (its node's IP, a
    free port) → every actor sets MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK and runs LearnerRank
    (service.py) in a thread
    stop(): rank 0 stops at the next poll, checkpoints and tells the other ranks; run() returns summaries
    RankWatch: the launcher calls every rank (its second thread answers while run() trains); a rank that
    answers nothing for launcher.learner_hang_timeout_s is hung (stopped, or stuck holding the interpreter),
    which no collective timeout sees in a group of one rank

Ray only places and restarts the processes; the ranks talk through torch.distributed, Redis and gRPC as in
the plain entry point (``python -m services.learner``), so both run the same code.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from services.common.ports import free_port
from services.learner.config import LearnerConfig, LearnerServiceConfig


@ray.remote(max_concurrency=2)  # run() holds one thread; stop() and address() use the other
class LearnerRankActor:
    def __init__(self, cfg_json: str, rank: int) -> None:
        self.cfg = LearnerServiceConfig.model_validate_json(cfg_json)
        self.rank = rank
        self.stop_event = threading.Event()
        self.published: int | None = None  # the version this rank published at start, once it has

    def prepare(self) -> None:
        """Import the learner's modules (torch, DeepSpeed, transformers: seconds, far more on a loaded node or
        a network filesystem). Every rank does so before rank 0 picks the rendezvous port: the rendezvous
        waits for the ranks only ``learner.collective_timeout_s`` (30 s in a chaos run), which a rank still
        importing missed (a CI run saw rank 1 miss it on a busy 2-core machine); and rank 0 binds the port
        moments after it was found free, not after the imports, while other processes take free ports."""
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401

        import services.learner.service  # noqa: F401

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (asked of rank 0 for the rendezvous, once it is prepared)."""
        return ray.util.get_node_ip_address(), self.cfg.learner.master_port or free_port("")

    def run(self, master: tuple[str, int], world: int, max_steps: int = 0) -> dict[str, Any]:
        from services.common.observability import actor_logging
        from services.learner.service import LearnerRank

        actor_logging(f"learner-rank{self.rank}", self.cfg.run.run_dir)
        local = (
            "0" if self.cfg.learner.gpus_per_rank > 0 else str(self.rank)
        )  # Ray shows each actor its GPU only
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=local,
        )
        learner = LearnerRank(self.cfg, self.stop_event)
        try:
            learner.start()
            self.published = learner.trainer.version
            summary = learner.serve(max_steps)
            learner.leave()
            return summary
        finally:
            learner.close()

    def started(self) -> int | None:
        """The version this rank published at start (its checkpoint's after a restart); None until then."""
        return self.published

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.stop_event.set()


def rank_bundle(learner: LearnerConfig) -> dict[str, float]:
    """What one rank asks Ray for: its bundle of the group's PACK placement group (the launcher's fit check
    counts the same)."""
    bundle: dict[str, float] = {"CPU": 1}
    if learner.gpus_per_rank > 0:
        bundle["GPU"] = learner.gpus_per_rank
    bundle.update(learner.ray_resources)
    return bundle


class LearnerGroup:
    """The learner's ranks as Ray actors in one placement group; :meth:`run` blocks until they finish."""

    def __init__(self, cfg: LearnerServiceConfig, generation: int = 0) -> None:
        """``generation``: how many groups this run started before this one (a restart's actors take new
        names, since a killed actor's name is released asynchronously)."""
        from services.common.tiny_model import run_model

        run_model(cfg.run)  # build the tiny model once, before the ranks load it
        self.cfg = cfg
        n = cfg.learner.num_ranks
        bundle = rank_bundle(cfg.learner)
        self.pg: PlacementGroup = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=600)
        except BaseException:  # no room for the ranks (e.g. a node lost): give the reservation back
            remove_placement_group(self.pg)
            raise
        payload = cfg.model_dump_json()
        self.actors = [
            LearnerRankActor.options(  # type: ignore[attr-defined]
                num_cpus=1,
                num_gpus=cfg.learner.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                name=f"vcpo-learner-{cfg.run.run_id}-rank{i}"
                + (f"-restart{generation}" if generation else ""),
            ).remote(payload, i)
            for i in range(n)
        ]
        self._runs: list[Any] = []

    def watch(self, timeout_s: float) -> RankWatch:
        """A :class:`RankWatch` over this group's ranks."""
        return RankWatch(self.actors, timeout_s)

    def start(self, max_steps: int = 0) -> None:
        ray.get([a.prepare.remote() for a in self.actors])  # every rank ready to meet (prepare's docstring)
        master = ray.get(self.actors[0].address.remote())
        world = len(self.actors)
        self._runs = [a.run.remote(master, world, max_steps) for a in self.actors]

    @property
    def runs(self) -> list[Any]:
        """The ranks' ``run`` refs (ready once a rank has finished or failed)."""
        return self._runs

    def started(self) -> int | None:
        """The version rank 0 published at start, once it has (the group is up and training); else None."""
        return ray.get(self.actors[0].started.remote(), timeout=60)

    def wait(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every rank's summary, once all have finished (an error in any rank is raised here)."""
        return list(ray.get(self._runs, timeout=timeout_s))

    def stop(self) -> None:
        """Ask rank 0 to stop; the ranks checkpoint and finish (collect their summaries with :meth:`wait`)."""
        ray.get(self.actors[0].stop.remote())

    def shutdown(self) -> None:
        """Kill every rank (also the ones still waiting in a collective for a rank that died) and free the
        placement group."""
        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(a)
        remove_placement_group(self.pg)


class RankWatch:
    """Calls every rank in turn and names those that answer nothing within ``timeout_s``: a hung process.

    :meth:`check` never blocks: it sends a call to every rank's ``started`` (answered by the actor's second
    thread, whatever run() is doing), and on later checks sees whether all have answered; once they have it
    sends the next. A rank killed outright answers with an error (its run ref says why); one that is alive but
    answers nothing (SIGSTOPped, swapped out, stuck in C code holding the interpreter) is reported once its
    call is ``timeout_s`` old.
    """

    def __init__(self, actors: Sequence[Any], timeout_s: float) -> None:
        self.actors = list(actors)
        self.timeout_s = timeout_s
        self._sent = 0.0
        self._calls: list[Any] = []

    def check(self, now: float | None = None) -> str | None:
        """None while every rank answers; else what is hung and for how long."""
        now = time.monotonic() if now is None else now
        if self._calls:
            ready, _ = ray.wait(self._calls, num_returns=len(self._calls), timeout=0)
            if len(ready) < len(self._calls):
                if now - self._sent <= self.timeout_s:
                    return None
                silent = [i for i, call in enumerate(self._calls) if call not in ready]
                return (
                    f"learner rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} answered "
                    f"nothing for {now - self._sent:.0f}s (launcher.learner_hang_timeout_s = "
                    f"{self.timeout_s:g}): hung"
                )
        self._calls = [a.started.remote() for a in self.actors]
        self._sent = now
        return None
