"""The weight broker, wired: version store, gRPC service, TCP data plane, `weights` announcements, metrics; for
the plain entry point (``python -m services.weight_broker --config run.toml``) and the Ray actor alike."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from services.common.config import add_config_arguments, config_from_args, write_resolved
from services.common.observability import Metrics, grpc_server, serve_metrics
from services.common.streams.metrics import StreamMetrics
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import connect, stream_specs
from services.weight_broker.config import WeightBrokerServiceConfig
from services.weight_broker.dataplane_server import DataPlaneServer
from services.weight_broker.servicer import Announcer, BrokerMetrics, WeightBrokerServicer, add_to_server
from services.weight_transport.config import broker_host
from services.weight_transport.store import VersionStore

log = logging.getLogger(__name__)


class BrokerService:
    """A running broker; ``close()`` stops it. Ports of 0 in the config are bound to free ones (see
    :meth:`endpoints`)."""

    def __init__(self, cfg: WeightBrokerServiceConfig) -> None:
        wb, run = cfg.weight_broker, cfg.run
        self.host = broker_host(wb)  # what announcements and endpoints() name
        self.metrics = Metrics("weight_broker")
        root = (wb.storage_dir or run.run_dir / "weights") if wb.storage == "disk" else None
        store = VersionStore(wb.retain_versions, root)
        self.servicer = WeightBrokerServicer(
            store, BrokerMetrics(self.metrics), None, wb.chunk_bytes, run.run_id
        )
        self.server = grpc_server(lambda s: add_to_server(self.servicer, s), port=wb.grpc_port)
        # announce each version on the run's `weights` stream, with the port actually bound
        if run.redis_url:
            weights = stream_specs(run, cfg.streams)["weights"]
            producer = StreamProducer(connect(run.redis_url), weights, StreamMetrics(self.metrics))
            self.servicer.announcer = Announcer(producer, f"{self.host}:{self.server.port}")
        else:
            log.warning("run.redis_url is empty: versions will not be announced on the weights stream")
        self.plane = DataPlaneServer(self.servicer, port=wb.data_port, timeout_s=wb.rpc_timeout_s)
        self.http = serve_metrics(self.metrics, port=wb.metrics_port)
        log.info(
            "serving on gRPC port %d, data plane on TCP port %d, metrics on %s (storage: %s)",
            self.server.port,
            self.plane.port,
            self.http.url,
            wb.storage,
        )

    def endpoints(self) -> dict[str, Any]:
        return {
            "grpc_port": self.server.port,
            "data_port": self.plane.port,
            "metrics_url": self.http.url,
            "advertise_host": self.host,
        }

    def close(self) -> None:
        self.server.stop(grace=5)
        self.plane.stop()
        self.http.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the weight broker.")
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
