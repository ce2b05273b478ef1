"""How a rank waits for the weight group's collectives, timed on a gloo broadcast between two processes.

Rank 0 broadcasts ``--mib`` MiB (1 GiB by default) in 64 MiB pieces, every piece queued at once, to rank 1 of
a :class:`WeightGroup` over loopback; both ranks then wait for every piece in one of three ways, the three
taking turns each round (so a busy moment of this shared machine hits all of them alike):

    group      ``WeightGroup.wait``: the project's wait (gloo's own wait, 50 ms at a time, between checks of
               the group's failure marks)
    polling    what ``WeightGroup.wait`` did before: ``is_completed()`` every 50 us, doubling up to 1 ms
    blocking   torch's ``work.wait()``: the floor (no failure marks checked)

Prints each round's seconds (rank 1, from the first piece issued until it holds the last), then a JSON line:
``group_over_blocking`` and ``polling_over_blocking``, medians over the rounds (1.0: as fast as blocking).

    python benchmarks/group_wait.py [--mib 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.common.ports import free_port

WAYS = ("group", "polling", "blocking")
PIECE = 64 << 20


def _polling(work: Any) -> None:
    nap = 5e-5
    while not work.is_completed():
        time.sleep(nap)
        nap = min(nap * 2, 1e-3)
    work.wait()


def _rank(rank: int, spec: dict[str, Any], nbytes: int, rounds: int, results: Any) -> None:
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    group = WeightGroup(GroupSpec(**spec), rank)
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    waits = {"group": group.wait, "polling": _polling, "blocking": lambda work: work.wait()}
    for _ in range(rounds):
        for way in WAYS:
            group.commit()  # both ranks start together
            t0 = time.monotonic()
            works = [group.broadcast(buf[a : a + PIECE]) for a in range(0, nbytes, PIECE)]
            for work in works:
                waits[way](work)
            if rank == 1:
                seconds = time.monotonic() - t0
                if not bool((buf == 1).all()):
                    raise SystemExit("rank 1 did not receive the broadcast bytes")
                results.put((way, seconds))
                buf.zero_()
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=1024, help="bytes broadcast per round, in MiB")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each times the three ways)")
    args = parser.parse_args()
    spec = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo", "timeout_s": 300.0}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, spec, args.mib << 20, args.rounds, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds * len(WAYS)):
        way, s = results.get(timeout=600)
        seconds[way].append(s)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    print(f"{args.mib} MiB gloo broadcast over loopback, 64 MiB pieces; seconds per round (rank 1):")
    for way in WAYS:
        print(f"{way:>9} " + " ".join(f"{s:.3f}" for s in seconds[way]))
    floor = statistics.median(seconds["blocking"])
    print(
        json.dumps(
            {
                "group_over_blocking": round(statistics.median(seconds["group"]) / floor, 3),
                "polling_over_blocking": round(statistics.median(seconds["polling"]) / floor, 3),
                "median_s": {way: round(statistics.median(s), 3) for way, s in seconds.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
