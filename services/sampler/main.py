"""Run a sampler replica: ``python -m services.sampler --config run.toml [--replica N] [--max-groups N]``.

SIGTERM or SIGINT stops it gracefully: in-flight groups are aborted and their admission slots released;
tasks taken from the `tasks` stream and not yet finished stay pending for another replica.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.sampler.config import SamplerServiceConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replica", type=int, default=0, help="this replica's index (0-based)")
    parser.add_argument(
        "--max-groups", type=int, default=0, help="stop after writing this many groups; 0 = never"
    )
    add_config_arguments(parser, SamplerServiceConfig)
    args = parser.parse_args(argv)
    cfg = config_from_args(SamplerServiceConfig, args)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s sampler-{args.replica} %(levelname)s %(message)s"
    )
    write_resolved(cfg, cfg.run.run_dir, f"sampler-{args.replica}.config.json")
    from services.sampler.service import SamplerService  # heavy: vLLM

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = SamplerService(cfg, args.replica)
    try:
        summary = service.serve(stop, args.max_groups)
    finally:
        service.close()
    out = cfg.run.run_dir / "sampler" / f"sampler-{args.replica}.summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    logging.info("stopped: %s", summary)


if __name__ == "__main__":
    main()
