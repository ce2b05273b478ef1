"""Run the weight broker: ``python -m services.weight_broker --config run.toml [--weight_broker.grpc_port 0]``."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.common.observability import Metrics, grpc_server, serve_metrics
from services.common.streams import StreamMetrics, StreamProducer, connect, stream_specs
from services.weight_broker.config import WeightBrokerServiceConfig
from services.weight_broker.dataplane import DataPlaneServer
from services.weight_broker.servicer import Announcer, BrokerMetrics, WeightBrokerServicer, add_to_server
from services.weight_broker.store import make_store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_config_arguments(parser, WeightBrokerServiceConfig)
    cfg = config_from_args(WeightBrokerServiceConfig, parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s weight_broker %(levelname)s %(message)s")
    wb, run = cfg.weight_broker, cfg.run
    write_resolved(cfg, run.run_dir, "weight_broker.config.json")
    metrics = Metrics("weight_broker")
    store = make_store(wb.storage, wb.retain_versions, wb.storage_dir or run.run_dir / "weights")
    servicer = WeightBrokerServicer(store, BrokerMetrics(metrics), None, wb.chunk_bytes, run.run_id)
    server = grpc_server(lambda s: add_to_server(servicer, s), port=wb.grpc_port)
    if run.redis_url:  # announce each version on the run's `weights` stream, with the address actually bound
        weights = stream_specs(run, cfg.streams)["weights"]
        producer = StreamProducer(connect(run.redis_url), weights, StreamMetrics(metrics))
        servicer.announcer = Announcer(producer, "grpc", f"{wb.advertise_host}:{server.port}")
    else:
        logging.warning("run.redis_url is empty: versions will not be announced on the weights stream")
    plane = DataPlaneServer(servicer, port=wb.data_port, timeout_s=wb.rpc_timeout_s)
    http = serve_metrics(metrics, port=wb.metrics_port)
    logging.info("serving on gRPC port %d, data plane on TCP port %d, metrics on %s (storage: %s)",
                 server.port, plane.port, http.url, wb.storage)  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5)
    plane.stop()
    http.close()


if __name__ == "__main__":
    main()
