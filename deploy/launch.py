"""The main job: a whole run from one config file (``make run``), on Ray (deploy/ray_launcher.py).

    python -m deploy.launch --config deploy/presets/local.toml [--k 0] [--run.run_dir runs/x] [--set a.b=c]

Everything comes up (Redis, weight broker, learner ranks, reward replicas, samplers), trains with a live
progress line until ``launcher.max_steps`` / ``launcher.max_minutes`` / Ctrl-C, stops cleanly with a last
checkpoint, checks the ledger and writes the report into the run directory. The same command on the same
run directory resumes from the last checkpoint. Exit codes: 0 done, 2 bad configuration, 3 the ledger did
not balance, 1 a service failed.
"""

from __future__ import annotations

import argparse
import logging
import sys

from deploy.config import SystemConfig
from services.common.config import ConfigError, add_config_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--k", type=int, default=None, help="maximum policy lag (same as --run.k; 0 = synchronous)"
    )
    add_config_arguments(parser, SystemConfig)
    args = parser.parse_args(argv)
    if args.k is not None:
        args.set.append(f"run.k={args.k}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(SystemConfig, args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    from deploy.preflight import ClusterFitError
    from deploy.preflight_nodes import NodeCheckError
    from deploy.ray_launcher import RayLauncher

    try:
        return RayLauncher(cfg).run()
    except (ClusterFitError, NodeCheckError) as exc:  # the run asks for what the cluster cannot give
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
