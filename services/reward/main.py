"""Run a reward replica: ``python -m services.reward --config run.toml [--replica N] [--max-groups N]``.

It scores groups from the run's `rollouts` stream into `scored` and serves Score/ScoreBatch/ListScorers over
gRPC. SIGTERM or SIGINT stops it after the groups in hand are forwarded; a replica killed outright leaves
its groups pending, and another replica (or this one, restarted) takes them over.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.reward.config import RewardServiceConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replica", type=int, default=0, help="this replica's index (0-based)")
    parser.add_argument(
        "--max-groups", type=int, default=0, help="stop after forwarding this many groups; 0 = never"
    )
    add_config_arguments(parser, RewardServiceConfig)
    args = parser.parse_args(argv)
    cfg = config_from_args(RewardServiceConfig, args)
    name = f"reward-{args.replica}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    write_resolved(cfg, cfg.run.run_dir, f"{name}.config.json")
    from services.reward.service import RewardService  # imports the scorers (sympy)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = RewardService(cfg, name, port_offset=args.replica)
    try:
        summary = service.serve(stop, args.max_groups)
    finally:
        service.close()
    out = cfg.run.run_dir / "reward" / f"{name}.summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    logging.info("stopped: %s", summary)


if __name__ == "__main__":
    main()
