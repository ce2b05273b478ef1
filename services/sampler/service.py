"""A sampler replica, wired: engine, task feed, admission, weight sync, `rollouts` producer, metrics, gRPC.

Used by the plain entry point (``python -m services.sampler``) and the Ray actor alike; the generation
engine can be handed in (tests of the loop's logic use a scripted one), otherwise it is vLLM.
The engine and the environment registry are built by :mod:`services.sampler.build`, which the evaluator uses
too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc
import redis

from services.common.admission import AdmissionCounter
from services.common.auth import TokenAuthInterceptor, resolve_api_token
from services.common.datasets import load_dataset
from services.common.observability import Metrics, grpc_server, serve_metrics, write_endpoints
from services.common.ports import reachable_host
from services.common.prompts import PromptEncoder, TaskError
from services.common.streams.consumer import StreamConsumer, StreamTail
from services.common.streams.metrics import StreamMetrics
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import connect, stream_specs
from services.common.tls import server_credentials
from services.sampler.agent import AgentLoop
from services.sampler.agents.episodes import EpisodeBook
from services.sampler.agents.tokens import ChatRenderer, PrefixRule
from services.sampler.build import environment_registry, make_engine
from services.sampler.config import SamplerServiceConfig
from services.sampler.cotenant import Cotenant, EngineShare, cotenant_for
from services.sampler.engine import GenerationEngine, Sampling
from services.sampler.feed import TaskFeed
from services.sampler.metrics import SamplerMetrics
from services.sampler.sampler import Sampler
from services.sampler.servicer import RegistryServicer, StatusServicer
from services.sampler.tasks import DatasetTasks
from services.sampler.weights import CollectiveWeightSync, WeightSync
from services.weight_transport import GroupRegistry, Member, MemberSeat, transport_from_config
from vcpo.v1 import common_pb2_grpc, registry_pb2_grpc

log = logging.getLogger(__name__)


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class SamplerService:
    def __init__(
        self, cfg: SamplerServiceConfig, replica: int = 0, engine: GenerationEngine | None = None
    ) -> None:
        s, run = cfg.sampler, cfg.run
        if not run.redis_url:
            raise ValueError(
                "run.redis_url is empty: the sampler needs the run's Redis (the launcher starts one)"
            )
        self.cfg, self.replica_id = cfg, f"sampler-{replica}"
        self.registry = Metrics("sampler")
        self.metrics = SamplerMetrics(self.registry, self.replica_id)
        stream_metrics = StreamMetrics(self.registry)
        client = connect(run.redis_url)
        specs = stream_specs(run, cfg.streams)
        self._owns_engine = engine is None
        self.engine = engine or make_engine(cfg, replica)
        encoder = PromptEncoder(self.engine.tokenizer, s.max_model_len, s.max_tokens, s.system_prompt)
        self.environments = environment_registry(cfg, client, self.replica_id)
        dataset = None
        if s.dataset:
            tasks = load_dataset(
                s.dataset,
                s.prompt_field,
                s.answer_field,
                seed=run.seed,
                scorer_by_source=s.scorer_by_source,
                source_field=s.source_field,
            )
            if s.dataset_environment:
                handle = self.environments.get(s.dataset_environment)
                if handle is None:
                    raise ValueError(
                        f"sampler.dataset_environment {s.dataset_environment!r} is not registered; "
                        "list it in [[sampler.environments]]"
                    )
                for task in tasks:
                    task.environment = s.dataset_environment
                    task.scorer = task.scorer or handle.spec.scorer
            dataset = DatasetTasks(tasks, seed=run.seed * 1000 + replica)
        consumer = StreamConsumer(
            client,
            specs["tasks"],
            self.replica_id,
            stream_metrics,
            cfg.streams.reclaim_idle_ms,
            cfg.streams.max_deliveries,
        )
        self.feed = TaskFeed(
            encoder,
            dataset,
            consumer,
            self._task_error,
            environment_known=self.environments.known,
            weight=self._environment_weight,
            max_attempts=s.env_max_attempts,
            on_settled=self.environments.settled,
        )
        self.transport = transport_from_config(cfg.weight_broker, run)
        # the co-tenant of this engine: the evaluator, with [evaluation] placement = "shared"
        share = EngineShare(
            cfg, self.engine, encoder, self.registry, client, self.replica_id, self.environments
        )
        self.evaluator: Cotenant | None = cotenant_for(share)
        announcements = StreamTail(client, specs["weights"], metrics=stream_metrics)
        sync: WeightSync
        if cfg.weight_broker.transport == "collective" and hasattr(self.engine, "begin_join"):
            wb = cfg.weight_broker
            member = Member.here(self.replica_id, s.tensor_parallel_size, "sampler")
            seat = MemberSeat(GroupRegistry(client, run.run_id, wb.group_member_ttl_s), member)
            sync = CollectiveWeightSync(
                self.engine,
                self.transport,
                announcements,
                seat,
                s.weight_poll_interval_s,
                on_failure=self.metrics.broadcast_failures.labels(self.replica_id).inc,
            )
        else:
            if cfg.weight_broker.transport == "collective":
                log.warning(
                    "%s: this engine cannot join the weight group; weights come through the broker",
                    self.replica_id,
                )
            sync = WeightSync(self.engine, self.transport, announcements, s.weight_poll_interval_s)
        self.sampler = Sampler(
            self.engine,
            self.feed,
            AdmissionCounter(client, run.run_id, run.k, run.groups_per_step),
            StreamProducer(client, specs["rollouts"], stream_metrics, cfg.streams.producer_wait_timeout_s),
            sync,
            self.metrics,
            run_id=run.run_id,
            replica_id=self.replica_id,
            n=s.n,
            sampling=Sampling(s.temperature, s.top_p, s.top_k, s.max_tokens, tuple(s.stop)),
            max_requests_in_flight=s.max_requests_in_flight,
            weight_update=s.weight_update,
            agent=AgentLoop(self.engine, self.environments, encoder, self.metrics, threads=s.env_threads),
            cotenant=self.evaluator,
        )
        tasks_producer = StreamProducer(
            client, specs["tasks"], stream_metrics, cfg.streams.producer_wait_timeout_s
        )
        status = StatusServicer(self.sampler.status, run.run_id, self.replica_id)
        registry = RegistryServicer(
            self.feed.validate,
            tasks_producer,
            self.environments,
            self._task_error,
            run_file_environments=[e.name for e in s.environments],
        )

        def add(server: grpc.Server) -> list[str]:
            common_pb2_grpc.add_StatusServicer_to_server(status, server)
            registry_pb2_grpc.add_EnvironmentRegistryServicer_to_server(registry, server)
            return ["vcpo.v1.Status", "vcpo.v1.EnvironmentRegistry"]

        token, source = resolve_api_token(s.api_token.get_secret_value(), s.api_token_file, run.run_dir)
        log.info("%s: client calls need the API token (from %s)", self.replica_id, source)
        auth = TokenAuthInterceptor(token, {"vcpo.v1.EnvironmentRegistry"}, self._refused)
        offset = replica if s.port_per_replica else 0
        port = s.grpc_port + offset if s.grpc_port else 0
        self.server = grpc_server(
            add,
            port=port,
            max_message_bytes=s.max_request_bytes,
            interceptors=[auth],
            credentials=server_credentials(s.api_tls),
        )
        self.http = serve_metrics(self.registry, port=s.metrics_port + offset if s.metrics_port else 0)
        self.agents = self._agent_api(token, offset, encoder, client) if cfg.agents.enabled else None
        more = {"agents_url": self.agents.url} if self.agents is not None else {}
        self.endpoints = write_endpoints(
            run.run_dir / "sampler", self.replica_id, self.server.port, self.http.url, **more
        )

    def _agent_api(self, token: str, offset: int, encoder: PromptEncoder, client: redis.Redis) -> Any:
        """The agent API on this replica: its episodes are the tasks without an environment. Every replica's
        address is in Redis, so a replica passes an episode's requests on to the one that holds it."""
        from services.sampler.agents.api import AgentApi  # FastAPI and uvicorn: only where agents are served

        a, sampler, run = self.cfg.agents, self.sampler, self.cfg.run
        peers = f"vcpo:{run.run_id}:agents:replicas"
        renderer = ChatRenderer(self.engine.tokenizer, template_kwargs=a.chat_template_kwargs)
        sampler.book = EpisodeBook(
            self.engine,
            PrefixRule(renderer, a.prefix_mode),
            sampler.sampling,
            admit=sampler.admit_agents,
            messages=lambda group: encoder.messages(group.task),
            lag=sampler.lag,
            k=sampler.k,
            episode_timeout_s=a.episode_timeout_s,
            max_turns=a.max_turns,
            id_prefix=f"{self.replica_id}.{sampler.incarnation}-",
            on_break=lambda reason: self.metrics.agent_breaks.labels(self.replica_id, reason).inc(),
        )
        api = AgentApi(
            sampler.book,
            model=self.cfg.run.model or "policy",
            token=token,
            tokenizer=self.engine.tokenizer,
            tool_parser=a.tool_parser,
            claim_timeout_s=a.claim_timeout_s,
            metrics=self.metrics,
            host=a.host,
            port=a.port + offset if a.port else 0,
            tls=self.cfg.sampler.api_tls,
            replica=self.replica_id,
            peer=lambda replica: _text(client.hget(peers, replica)),
        )
        host = a.advertise_host or reachable_host(run.redis_url, "agents.advertise_host")
        client.hset(peers, self.replica_id, f"{api.scheme}://{host}:{api.port}")
        return api

    def _task_error(self, exc: TaskError) -> None:
        self.metrics.task_errors.labels(self.replica_id, exc.reason).inc()

    def _refused(self, method: str) -> None:
        self.metrics.unauthenticated.labels(self.replica_id).inc()

    def _environment_weight(self, name: str) -> float:
        handle = self.environments.handles.get(name)
        return handle.spec.weight if handle is not None else 1.0

    def serve(self, stop: threading.Event, max_groups: int = 0) -> dict[str, Any]:
        log.info("%s: gRPC on port %d, metrics on %s", self.replica_id, self.server.port, self.http.url)
        self.sampler.run(stop, max_groups)
        return self.sampler.summary()

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
        self.server.stop(grace=1)
        self.environments.close()
        self.http.close()
        self.transport.close()
        if self.evaluator is not None:
            self.evaluator.close()  # closed when the loop stopped, unless it never ran
        if self._owns_engine:
            self.engine.close()
