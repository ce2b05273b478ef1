"""Run the weight broker: ``python -m services.weight_broker --config run.toml [--weight_broker.grpc_port 0]``."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.weight_broker.config import WeightBrokerServiceConfig
from services.weight_broker.service import BrokerService


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_config_arguments(parser, WeightBrokerServiceConfig)
    cfg = config_from_args(WeightBrokerServiceConfig, parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s weight_broker %(levelname)s %(message)s")
    write_resolved(cfg, cfg.run.run_dir, "weight_broker.config.json")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    broker = BrokerService(cfg)
    stop.wait()
    broker.close()


if __name__ == "__main__":
    main()
