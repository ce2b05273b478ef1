"""The learner's rank processes without Ray: spawn ``learner.num_ranks`` on this machine and watch them.

    run(cfg)      the run's model made ready once ─► spawn ranks 0..N-1 (one torch.distributed group over
                  127.0.0.1:master_port) ─► wait; the exit status is 0 or the first failed rank's
    _rank_main    one rank: LearnerRank start ─ serve ─ leave ─ close; rank 0 writes learner/summary.json

SIGTERM or SIGINT to the parent is forwarded to rank 0, which stops gracefully (it checkpoints and tells the
other ranks); the other ranks ignore SIGINT. If any rank dies, the others are killed and the exit status is
the failed rank's (a signal N reads as 128 + N). ``ray_group.py`` runs the same ranks as Ray actors.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any

from services.common.ports import free_port
from services.learner.config import LearnerServiceConfig


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The environment torch.distributed reads in a rank of a one-machine group whose rank 0 listens on ``port``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )


def _rank_main(
    cfg_json: str, rank: int, world: int, port: int, max_steps: int, crash_after_step: int
) -> None:
    set_rank_env(rank, world, port)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s learner[{rank}] %(levelname)s %(message)s")
    from services.learner.service import LearnerRank

    cfg = LearnerServiceConfig.model_validate_json(cfg_json)
    stop = threading.Event()
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    else:  # rank 0 decides when to stop and tells the others
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    learner = LearnerRank(cfg, stop)
    try:
        learner.start()
        summary = learner.serve(max_steps, crash_after_step)
        if rank == 0:
            out = cfg.run.run_dir / "learner" / "summary.json"
            out.write_text(json.dumps(summary, indent=2) + "\n")
            logging.info("stopped at step %d, version %d", summary["step"], summary["version"])
        learner.leave()
    finally:
        learner.close()
    # done and durable: skip interpreter teardown, where DeepSpeed's and gloo's native threads have aborted
    # a finished rank ("terminate called without an active exception")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(cfg: LearnerServiceConfig, max_steps: int = 0, crash_after_step: int = 0) -> int:
    """Run every rank to the end; the exit status (0, or the first failed rank's)."""
    from services.common.tiny_model import run_model

    run_model(cfg.run)  # build the tiny model once, before the ranks load it
    world = cfg.learner.num_ranks
    port = cfg.learner.master_port or free_port()
    ctx = mp.get_context("spawn")
    args: list[tuple[Any, ...]] = [
        (cfg.model_dump_json(), r, world, port, max_steps, crash_after_step) for r in range(world)
    ]
    procs = [ctx.Process(target=_rank_main, args=a, name=f"learner-rank{a[1]}") for a in args]
    for p in procs:
        p.start()

    def forward(signum: int, _frame: Any) -> None:
        if procs[0].pid is not None and procs[0].is_alive():
            os.kill(procs[0].pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = None
    while failed is None and any(p.is_alive() for p in procs):
        for p in procs:
            p.join(timeout=0.5)
            if p.exitcode not in (None, 0):
                failed = p
                logging.error("%s exited with status %s; stopping the other ranks", p.name, p.exitcode)
                for q in procs:
                    if q.is_alive():
                        q.kill()
                break
    for p in procs:
        p.join()
    failed = failed or next((p for p in procs if p.exitcode != 0), None)  # all ended between two checks
    if failed is None or failed.exitcode is None:
        return 0
    return failed.exitcode if failed.exitcode > 0 else 128 - failed.exitcode  # a signal N reads as 128 + N
