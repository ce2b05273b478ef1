"""Run the learner without Ray: ``python -m services.learner --config run.toml [--max-steps N]``.

The parent process spawns ``learner.num_ranks`` rank processes (one torch.distributed group on this machine)
and waits for them. SIGTERM or SIGINT stops rank 0 gracefully (it checkpoints and tells the other ranks);
if any rank dies, the others are stopped and the exit status is the failed rank's.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.learner.config import LearnerServiceConfig
from services.learner.supervisor import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps in all; 0 = never"
    )
    parser.add_argument(
        "--crash-after-step",
        type=int,
        default=0,
        help="fault injection for tests: rank 0 exits right after this step, before its checkpoint",
    )
    add_config_arguments(parser, LearnerServiceConfig)
    args = parser.parse_args(argv)
    cfg = config_from_args(LearnerServiceConfig, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(message)s")
    write_resolved(cfg, cfg.run.run_dir, "learner.config.json")
    sys.exit(run(cfg, args.max_steps, args.crash_after_step))


if __name__ == "__main__":
    main()
