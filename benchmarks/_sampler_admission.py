"""How full the sampler keeps its engine's batch: ``active_over_cap`` for benchmarks/sampler.py.

The figure measures the sampler's admission policy (when a new group may start), not generation, so the
engine is a stand-in that schedules as vLLM does as far as admission can tell: at most ``batch_limit``
requests run in a step (vLLM's ``max_num_seqs``; more wait, first come, first served), each running request
produces one token per step, and each response's length is drawn from a long-tailed distribution
(log-normal, median 27 % of ``max_tokens``, cut at ``max_tokens``, which 5 % of responses reach: a base
model at temperature 1). Everything else is the real loop: ``Sampler.tick`` with its default cap (the
engine's batch limit), the real admission counter on a real Redis (a lag bound that never binds here: the
figure is about the in-flight cap) and real groups, written to a stand-in stream.

    active_over_cap = mean over steps of the requests running ÷ the cap

measured after the first in-flight set has turned over (from step ``max_tokens`` on). Admission by whole
groups would hold a group's seats until its longest response ends: about E[length] / E[longest of n] of
the cap, 0.4-0.45 with these lengths.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import torch

from services.common.admission import Admission, AdmissionCounter
from services.common.observability import Metrics
from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.sampler.feed import PreparedTask
from services.sampler.metrics import SamplerMetrics
from services.sampler.sampler import Sampler
from vcpo.v1 import rollout_pb2

TAIL_SIGMA = 0.8
AT_MAX = 0.05  # the share of responses cut at max_tokens
Z_AT_MAX = 1.645  # the standard normal's 95th percentile


def long_tailed(max_tokens: int, seed: int = 0) -> Callable[[str], int]:
    """Response lengths, one per request: log-normal with ``AT_MAX`` of them at ``max_tokens``."""
    rng = random.Random(seed)
    mu = math.log(max_tokens) - Z_AT_MAX * TAIL_SIGMA
    return lambda request_id: max(1, min(max_tokens, int(rng.lognormvariate(mu, TAIL_SIGMA))))


class BatchingEngine(GenerationEngine):
    """A stand-in engine that schedules like vLLM's (see the module docstring); ``length`` gives each
    request's response length. ``running_per_step`` records the batch of every step."""

    tokenizer = None
    max_model_len = 1 << 20  # the feed's budget sets each response's max_tokens

    def __init__(self, batch_limit: int, length: Callable[[str], int]) -> None:
        super().__init__()
        self.batch_limit = batch_limit
        self.length = length
        self.loaded_version = 0
        self.waiting: deque[str] = deque()
        self.running: dict[str, list[int]] = {}  # request -> [tokens produced, length]
        self.lengths: dict[str, int] = {}
        self.running_per_step: list[int] = []
        self.added: list[str] = []

    def add(self, request_id: str, prompt_tokens: Sequence[int], sampling: Sampling) -> None:
        self.lengths[request_id] = min(sampling.max_tokens, self.length(request_id))
        self.waiting.append(request_id)
        self.added.append(request_id)

    def step(self) -> list[TokenDelta]:
        while self.waiting and len(self.running) < (self.batch_limit or 0):
            request_id = self.waiting.popleft()
            self.running[request_id] = [0, self.lengths[request_id]]
        self.running_per_step.append(len(self.running))
        out = []
        for request_id, progress in list(self.running.items()):
            progress[0] += 1
            done = progress[0] >= progress[1]
            out.append(TokenDelta(request_id, [7], [-1.0], "", "stop" if done else None, detokenized=False))
            if done:
                del self.running[request_id]
        return out

    def abort(self, request_ids: Sequence[str]) -> None:
        gone = set(request_ids)
        for request_id in gone:
            self.running.pop(request_id, None)
        self.waiting = deque(r for r in self.waiting if r not in gone)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def decode(self, tokens: list[int]) -> str:
        return ""

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass

    def _load_initial(self) -> None:
        pass


class EndlessFeed:
    """Tasks without end, each with the same short prompt (the task feed's interface, as the loop uses it)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.encoder = self
        self.errors: dict[str, int] = {}
        self.served = 0
        self.acked = 0
        self.retried = 0

    def response_budget(self, prompt_len: int) -> int:
        return self.max_tokens

    def next(self, can_start: Any = None) -> PreparedTask:
        self.served += 1
        return PreparedTask(rollout_pb2.Task(task_id=f"task-{self.served}"), [1, 2, 3])

    def done(self, prepared: PreparedTask) -> None:
        self.acked += 1

    def retry(self, prepared: PreparedTask, failure: str | None = None) -> None:
        self.retried += 1

    def keep_alive(self) -> None:
        pass

    def waiting_count(self, environment: str | None = None) -> int:
        return 0


class Written:
    """The `rollouts` stream's producer, as the loop uses it: keeps what is written."""

    def __init__(self) -> None:
        self.groups: list[rollout_pb2.TrajectoryGroup] = []

    def put(
        self, message: rollout_pb2.TrajectoryGroup, version: int, write_id: str = "", count_in: Any = ()
    ) -> None:
        self.groups.append(message)


class FixedVersion:
    """Weight sync at one version: nothing newer is ever published (``newest`` may be moved by a test)."""

    error = ""
    fetch_seconds = 0.0
    last_path = "broker"

    def __init__(self, newest: int = 0) -> None:
        self.newest_known: int | None = newest

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def pump(self) -> None:
        pass

    def ready(self) -> int | None:
        return None

    def poll_now(self) -> None:
        pass

    def waiting_reason(self, admission: Admission) -> str:
        return admission.reason


def stand_in_sampler(
    engine: GenerationEngine,
    client: redis.Redis,
    *,
    n: int,
    max_tokens: int,
    k: int = 1_000_000,
    groups_per_step: int = 1,
    max_requests_in_flight: int = 0,
    run_id: str = "admission",
    replica_id: str = "sampler-0",
    sync: Any = None,
) -> Sampler:
    """The real sampler loop over ``engine`` with stand-ins for the feed, the stream and weight sync, and the
    real admission counter of ``run_id`` on ``client``."""
    return Sampler(
        engine,
        EndlessFeed(max_tokens),  # type: ignore[arg-type]
        AdmissionCounter(client, run_id, k, groups_per_step),
        Written(),  # type: ignore[arg-type]
        sync or FixedVersion(),  # type: ignore[arg-type]
        SamplerMetrics(Metrics("sampler"), replica_id),
        run_id=run_id,
        replica_id=replica_id,
        n=n,
        sampling=Sampling(max_tokens=max_tokens),
        max_requests_in_flight=max_requests_in_flight,
    )


def measure(client: redis.Redis, cap: int, n: int, max_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Run the loop for ``6 * max_tokens`` engine steps at the engine's batch limit ``cap``; the figures."""
    client.delete("vcpo:admission:admission:started", "vcpo:admission:admission:holders")
    engine = BatchingEngine(cap, long_tailed(max_tokens, seed))
    sampler = stand_in_sampler(engine, client, n=n, max_tokens=max_tokens)
    steps = 6 * max_tokens
    while len(engine.running_per_step) < steps:
        sampler.tick()
    sampler.shutdown()
    measured = engine.running_per_step[max_tokens:]
    mean_active = sum(measured) / len(measured)
    lengths = list(engine.lengths.values())
    return {
        "active_over_cap": round(mean_active / cap, 4),
        "mean_active": round(mean_active, 1),
        "cap": sampler.max_requests_in_flight,
        "n": n,
        "max_tokens": max_tokens,
        "steps": steps,
        "groups_written": sampler.emitted,
        "mean_length_over_max": round(sum(lengths) / len(lengths) / max_tokens, 3),
        "share_at_max": round(sum(x == max_tokens for x in lengths) / len(lengths), 3),
    }
