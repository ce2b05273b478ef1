"""Held-out evaluation during training: validation sets sampled at chosen policy versions, scored, recorded.

    EvalSchedule.claim(v)   the sets due at v: the first version of every `every` versions of each set (and
        │                   version 0); one evaluation per set and bucket across every replica and evaluator
        │                   (a Redis SET NX)
    Evaluator.begin(v, due) ─► n requests per task with the set's own sampling, at most max_in_flight in the engine
        engine.step() ─► Evaluator.absorb(delta) ─► each response's tokens and log-probs
        a set with an environment: each task's n samples are one group of episodes in an AgentLoop of the
        evaluator's own (training's agent loop: turns, tool calls, masked observations, the environment's reward)
    all generated ─► scoring thread: the reward service's ScoringPool and scorers ─► SetResult per set
        ─► EvalRecorder: Redis list vcpo:<run>:eval:results (the launcher writes <run_dir>/metrics.jsonl from
                         it), gauges vcpo_eval_*, a log line

Where it runs (``[evaluation] placement``):

- **shared** (:class:`~services.sampler.sampler.Sampler`): the replica that loads a due version starts a round
  in its own engine beside its training groups (its requests share the engine's batches). It holds newer
  versions back until the round is generated, so every response comes from the version named, but at most
  ``max_delay_s``: past that the round is abandoned (counted) and the newer version is loaded, so evaluation
  never delays training beyond that budget. Scoring runs on a thread and holds nothing back.
- **dedicated** (:class:`EvalRunner`): an engine of its own follows the published versions and loads only the
  due ones; training never waits for it. It fetches only versions some set may be due at
  (:meth:`EvalSchedule.wants`), so between rounds the broker sends it nothing.
- **the eval command** (``deploy/eval.py``): one round on a saved model, with no schedule.

Evaluation requests never become groups: nothing of them reaches the `rollouts` stream, the reward service
or the learner. A response is correct when its reward is at least the set's ``correct_at``; mean@n is the
mean over tasks of the fraction of a task's n samples that are correct, pass@n the fraction of tasks with at
least one correct sample.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from services.common.clock import RunClock, eval_results_key
from services.common.datasets import load_dataset
from services.common.observability import Metrics
from services.common.prompts import PromptEncoder, TaskError
from services.reward.pool import Outcome
from services.reward.scorers import ScoreInput
from services.sampler.agent import AgentLoop
from services.sampler.config import SamplerServiceConfig, eval_set_environment
from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.sampler.groups import Group
from services.sampler.groups import Response as EpisodeResponse
from services.sampler.weights import WeightSync
from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)

REQUEST_PREFIX = "eval/"
"""Every evaluation request id starts with it (a training request id never does)."""
ROUND_OUTCOMES = ("done", "abandoned", "shutdown")

ScoreMany = Callable[[Sequence[tuple[str, ScoreInput]]], list[Outcome]]


# ------------------------------------------------------------------------------------------ the sets


@dataclass
class EvalSet:
    """A validation set ready to sample: its tasks, their prompt tokens, its scorer and sampling settings."""

    name: str
    tasks: list[rollout_pb2.Task]
    prompts: list[list[int]]
    scorer: str  # for tasks that name no scorer of their own ("": decided per response, see scorer_of)
    n: int
    sampling: Sampling
    correct_at: float = 1.0
    environment: str = ""  # each task's n samples run as one group of episodes in this environment
    # reward.default_scorer: for an episode that names no scorer and that its environment gave no reward
    default_scorer: str = "exact_match"

    def scorer_of(self, task: rollout_pb2.Task, environment_reward: float | None) -> str:
        """As the reward service picks one for training groups: the task's own, the set's (or its
        environment's), the environment's reward when it gave one, else reward.default_scorer."""
        if task.scorer or self.scorer:
            return task.scorer or self.scorer
        return "environment" if environment_reward is not None else self.default_scorer


def load_eval_sets(cfg: SamplerServiceConfig, encoder: PromptEncoder) -> list[EvalSet]:
    """The run's ``[[evaluation.sets]]``, loaded with the training readers and encoded with its chat template.
    A set that cannot be loaded, is empty or holds a task that cannot be sampled is a ValueError naming it."""
    s = cfg.sampler
    out = []
    for spec in cfg.evaluation.sets:
        environment = eval_set_environment(s, spec)
        prompt_field, answer_field = spec.prompt_field or s.prompt_field, spec.answer_field or s.answer_field
        try:
            # a set's own scorer judges all its tasks; else each task's from sampler.scorer_by_source
            by_source = {} if spec.scorer else s.scorer_by_source
            tasks = load_dataset(
                spec.dataset,
                prompt_field,
                answer_field,
                split=spec.split,
                seed=cfg.run.seed,
                scorer_by_source=by_source,
                source_field=s.source_field,
            )
            tasks = tasks[: spec.limit] if spec.limit else tasks
            prompts = [encoder.encode(task) for task in tasks]
        except (TaskError, ValueError) as exc:
            raise ValueError(f"evaluation set {spec.name!r}: {exc}") from exc
        if not tasks:
            raise ValueError(f"evaluation set {spec.name!r}: {spec.dataset!r} has no tasks")
        greedy = spec.temperature == 0
        sampling = Sampling(
            temperature=spec.temperature,
            top_p=1.0 if greedy else spec.top_p,
            max_tokens=spec.max_tokens or s.max_tokens,
            stop=tuple(s.stop),
        )
        if environment is not None:
            for task in tasks:
                task.environment = environment.name
            scorer = spec.scorer or environment.scorer  # "": per episode
        else:
            scorer = spec.scorer or cfg.reward.default_scorer
        out.append(
            EvalSet(
                spec.name,
                tasks,
                prompts,
                scorer,
                spec.n,
                sampling,
                spec.correct_at,
                spec.environment,
                cfg.reward.default_scorer,
            )
        )
    return out


def accuracy(rewards: Sequence[Sequence[float]], correct_at: float) -> tuple[float, float, float]:
    """``(mean@n, pass@n, mean reward)`` of each task's sample rewards."""
    if not rewards or any(not r for r in rewards):
        raise ValueError("accuracy needs at least one task and one sample per task")
    correct = [[r >= correct_at for r in task] for task in rewards]
    mean_at_n = sum(sum(c) / len(c) for c in correct) / len(correct)
    pass_at_n = sum(any(c) for c in correct) / len(correct)
    reward_mean = sum(sum(r) for r in rewards) / sum(len(r) for r in rewards)
    return mean_at_n, pass_at_n, reward_mean


@dataclass
class SetResult:
    """One set's accuracy at one version."""

    set: str
    version: int
    n: int
    tasks: int
    mean_at_n: float
    pass_at_n: float
    reward_mean: float
    failed_scores: int
    eval_seconds: float
    tokens: int
    per_task: list[list[float]] = field(default_factory=list, repr=False)  # rewards, task by task
    failed_episodes: int = 0  # samples whose environment failed (scored 0; environment sets only)

    def record(
        self, where: str, replica: str, train_seconds: float | None, gpu_hours: float | None
    ) -> dict[str, Any]:
        """The metrics-log line (``kind: eval``)."""
        return {
            "kind": "eval",
            "set": self.set,
            "version": self.version,
            "n": self.n,
            "tasks": self.tasks,
            "mean_at_n": self.mean_at_n,
            "pass_at_n": self.pass_at_n,
            "reward_mean": self.reward_mean,
            "train_seconds": train_seconds,
            "gpu_hours": gpu_hours,
            "time": time.time(),
            "eval_seconds": self.eval_seconds,
            "tokens": self.tokens,
            "failed_scores": self.failed_scores,
            "failed_episodes": self.failed_episodes,
            "where": where,
            "replica": replica,
        }


# -------------------------------------------------------------------------------------- schedule


class EvalSchedule:
    """Which versions each set is evaluated at: version 0 (``at_start``), then the first version an evaluator
    meets in every bucket ``[b * every, (b + 1) * every)``, b >= 1, of that set's ``every``. One claim per set
    and bucket across the run (Redis ``SET NX``, kept across restarts), so two replicas never evaluate the
    same one; a round abandoned or cut short is not retried in its bucket (a budget too small for the sets
    would otherwise delay every version)."""

    def __init__(
        self,
        every: Mapping[str, int],
        at_start: bool,
        client: redis.Redis | None = None,
        run_id: str = "",
        owner: str = "",
    ) -> None:
        bad = {name: e for name, e in every.items() if e < 1}
        if not every or bad:
            raise ValueError(f"every set needs an interval >= 1 (versions), got {dict(every)}")
        self.every, self.at_start = dict(every), at_start
        self.client, self.run_id, self.owner = client, run_id, owner
        self._decided: set[tuple[str, int]] = set()  # (set, bucket) claimed or seen claimed by this process

    def _open(self, version: int) -> Iterator[tuple[str, int, str]]:
        """(set, bucket, claim key) of the sets whose bucket at ``version`` this process has not decided."""
        for name, every in self.every.items():
            bucket = version // every
            if (name, bucket) not in self._decided and (bucket >= 1 or (version == 0 and self.at_start)):
                yield name, bucket, f"vcpo:{self.run_id}:eval:claim:{name}:{bucket}"

    def claim(self, version: int) -> list[str]:
        """The sets to evaluate at ``version`` here (now claimed for it), in the order they were given."""
        due = []
        for name, bucket, key in list(self._open(version)):
            self._decided.add((name, bucket))
            if self.client is None or self.client.set(key, f"{self.owner}@{version}", nx=True):
                due.append(name)
        return due

    def wants(self, version: int) -> bool:
        """Whether ``version`` may still be due for some set (claims nothing): the dedicated evaluator fetches
        only such versions. Once False for a version it stays False (buckets are only ever claimed)."""
        for name, bucket, key in list(self._open(version)):
            if self.client is None or not self.client.exists(key):
                return True
            self._decided.add((name, bucket))  # claimed before (e.g. by this evaluator before a restart)
        return False


# --------------------------------------------------------------------------------------- metrics


class EvalMetrics:
    def __init__(self, metrics: Metrics) -> None:
        s = ["set"]
        self.accuracy = metrics.gauge(
            "vcpo_eval_accuracy",
            "Held-out accuracy at the newest evaluated version (metric: mean_at_n or pass_at_n)",
            ["set", "metric"],
        )
        self.reward = metrics.gauge("vcpo_eval_reward_mean", "Mean reward of the newest evaluation", s)
        self.version = metrics.gauge("vcpo_eval_policy_version", "Policy version of the newest evaluation", s)
        self.train_seconds = metrics.gauge(
            "vcpo_eval_train_seconds", "Training wall time when the newest evaluated version was published", s
        )
        self.gpu_hours = metrics.gauge(
            "vcpo_eval_gpu_hours", "GPU-hours of the run when the newest evaluated version was published", s
        )
        self.rounds = metrics.counter(
            "vcpo_eval_rounds_total", "Evaluation rounds (every set at one version), by outcome", ["outcome"]
        )
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        self.failed_scores = metrics.counter(
            "vcpo_eval_failed_scores_total",
            "Evaluation responses whose scorer failed (scored as failures)",
            s,
        )
        self.failed_episodes = metrics.counter(
            "vcpo_eval_failed_episodes_total",
            "Evaluation samples whose environment failed or timed out (scored 0; environment sets)",
            s,
        )
        self.round_seconds = metrics.histogram(
            "vcpo_eval_round_seconds",
            "Time of an evaluation round, generation and scoring",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
        )
        self.hold_seconds = metrics.counter(
            "vcpo_eval_hold_seconds_total",
            "Time newer versions waited to be loaded while an evaluation round was generating (shared)",
        )
        self.tokens = metrics.counter("vcpo_eval_generated_tokens_total", "Tokens generated for evaluation")


class EvalRecorder:
    """Where results go: the run's Redis list (for the metrics log), gauges, the log."""

    def __init__(
        self, metrics: EvalMetrics | None, client: redis.Redis | None, run_id: str, where: str, replica: str
    ) -> None:
        self.metrics, self.client, self.run_id = metrics, client, run_id
        self.where, self.replica = where, replica
        self.clock = RunClock(client, run_id) if client is not None else None

    def record(self, results: Sequence[SetResult]) -> list[dict[str, Any]]:
        records = []
        for r in results:
            seconds, gpu_hours = self.clock.at(r.version) if self.clock is not None else (None, None)
            rec = r.record(self.where, self.replica, seconds, gpu_hours)
            records.append(rec)
            if self.client is not None:
                self.client.rpush(eval_results_key(self.run_id), json.dumps(rec))
            if self.metrics is not None:
                m = self.metrics
                m.accuracy.labels(r.set, "mean_at_n").set(r.mean_at_n)
                m.accuracy.labels(r.set, "pass_at_n").set(r.pass_at_n)
                m.reward.labels(r.set).set(r.reward_mean)
                m.version.labels(r.set).set(r.version)
                if seconds is not None:
                    m.train_seconds.labels(r.set).set(seconds)
                if gpu_hours is not None:
                    m.gpu_hours.labels(r.set).set(gpu_hours)
                m.failed_scores.labels(r.set).inc(r.failed_scores)
                m.failed_episodes.labels(r.set).inc(r.failed_episodes)
            log.info(
                "evaluation at version %d: %s mean@%d %.3f pass@%d %.3f (%d tasks, %.1fs)",
                r.version,
                r.set,
                r.n,
                r.mean_at_n,
                r.n,
                r.pass_at_n,
                r.tasks,
                r.eval_seconds,
            )
        return records


# ------------------------------------------------------------------------------------------ rounds


@dataclass
class Response:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: str
    key: tuple[int, int, int]  # (set index, task index, sample index)
    prompt: list[int]
    sampling: Sampling


@dataclass
class _Episodes:
    """One task of an environment set: its n samples as one group of episodes, run by the agent loop."""

    key: tuple[int, int]  # (set index, task index)
    group: Group


@dataclass
class EvalRound:
    version: int
    pending: deque[_Request | _Episodes]
    sets: list[int]  # indices of the evaluator's sets in this round
    started: float = field(default_factory=time.monotonic)
    in_flight: dict[str, _Request] = field(default_factory=dict)
    episodes: dict[str, _Episodes] = field(default_factory=dict)  # group id -> a task's episodes under way
    responses: dict[tuple[int, int, int], Response | EpisodeResponse] = field(default_factory=dict)
    failed: dict[tuple[int, int], str] = field(default_factory=dict)  # tasks whose environment failed: why

    @property
    def generated(self) -> bool:
        return not self.pending and not self.in_flight and not self.episodes

    def running(self) -> int:
        """Samples being generated: requests in the engine, and the n of each group of episodes under way."""
        return len(self.in_flight) + sum(e.group.n for e in self.episodes.values())

    def outstanding(self) -> int:
        """Samples not generated yet (an episode group counts its n)."""
        return sum(x.group.n if isinstance(x, _Episodes) else 1 for x in self.pending) + self.running()


class Evaluator:
    """Runs evaluation rounds in a generation engine it shares (shared) or owns (dedicated, the command)."""

    def __init__(
        self,
        engine: GenerationEngine,
        sets: list[EvalSet],
        score_many: ScoreMany,
        recorder: EvalRecorder | None = None,
        schedule: EvalSchedule | None = None,
        *,
        encoder: PromptEncoder | None = None,
        max_in_flight: int = 64,
        max_delay_s: float = 30.0,
        metrics: EvalMetrics | None = None,
        agent: AgentLoop | None = None,
    ) -> None:
        if not sets:
            raise ValueError("an evaluator needs at least one evaluation set")
        for s in sets:
            if not s.environment:
                continue
            handle = agent.registry.get(s.environment) if agent is not None else None
            if handle is None:
                raise ValueError(
                    f"evaluation set {s.name!r}: environment {s.environment!r} is not registered"
                )
            if s.n > handle.spec.max_concurrency:
                raise ValueError(
                    f"evaluation set {s.name!r}: n = {s.n} exceeds environment {s.environment!r}'s "
                    f"max_concurrency = {handle.spec.max_concurrency} (a task's n episodes run at once)"
                )
        self.agent = agent  # runs the episodes of environment sets (its own: closed with the evaluator)
        self.engine, self.sets, self.score_many = engine, sets, score_many
        self.recorder, self.schedule, self.encoder = recorder, schedule, encoder
        self.max_in_flight, self.max_delay_s, self.metrics = max_in_flight, max_delay_s, metrics
        self.round: EvalRound | None = None
        self.last: EvalRound | None = None  # the latest round generated (tests read its responses)
        self.results: list[SetResult] = []  # of the latest round scored
        self.rounds: dict[str, int] = {outcome: 0 for outcome in ROUND_OUTCOMES}
        self._scoring: Future[list[SetResult]] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score")
        self._hold_since: float | None = None
        self._last_hold = 0.0
        self.held_s = 0.0  # newer versions waited this long for rounds to finish generating (shared)
        self._serial = 0

    # ------------------------------------------------------------------ state
    @property
    def generating(self) -> bool:
        """A round is in the engine: the engine must keep serving its version."""
        return self.round is not None

    @property
    def busy(self) -> bool:
        return self.round is not None or self._scoring is not None

    def owns(self, request_id: str) -> bool:
        return request_id.startswith(REQUEST_PREFIX)

    # ------------------------------------------------------------------ the round
    def offer(self, version: int) -> bool:
        """The engine now serves ``version``: start a round of the sets the schedule says are due (if not busy)."""
        if self.busy or self.schedule is None:
            return False
        due = self.schedule.claim(version)
        if due:
            self.begin(version, due)
        return bool(due)

    def begin(self, version: int, names: Sequence[str] | None = None) -> None:
        """Start a round at ``version`` of the sets named (all of them by default)."""
        if self.busy:
            raise RuntimeError(f"an evaluation round is still running; cannot begin one at version {version}")
        if self.engine.loaded_version != version:
            raise RuntimeError(f"the engine serves version {self.engine.loaded_version}, not {version}")
        chosen = [i for i, s in enumerate(self.sets) if names is None or s.name in names]
        self._serial += 1
        pending: deque[_Request | _Episodes] = deque()
        responses: dict[tuple[int, int, int], Response | EpisodeResponse] = {}
        for si in chosen:
            s = self.sets[si]
            for ti, prompt in enumerate(s.prompts):
                sampling = s.sampling
                if self.encoder is not None:
                    budget = self.encoder.response_budget(len(prompt))
                    if budget < sampling.max_tokens:
                        sampling = dataclasses.replace(sampling, max_tokens=budget)
                if s.environment:  # the agent loop fills the group's responses in place
                    group_id = f"{REQUEST_PREFIX}{self._serial}/v{version}/{s.name}/{ti}"
                    group = Group(
                        group_id, s.tasks[ti], list(prompt), version, sampling, s.n, multi_turn=True
                    )
                    for k, response in enumerate(group.responses.values()):
                        responses[(si, ti, k)] = response
                    pending.append(_Episodes((si, ti), group))
                    continue
                for k in range(s.n):
                    rid = f"{REQUEST_PREFIX}{self._serial}/v{version}/{s.name}/{ti}/{k}"
                    pending.append(_Request(rid, (si, ti, k), prompt, sampling))
        self.round = EvalRound(version, pending, chosen, responses=responses)
        log.info(
            "evaluation at version %d: %d samples over %d set(s)",
            version,
            self.round.outstanding(),
            len(chosen),
        )
        self._top_up()

    def _top_up(self) -> None:
        r = self.round
        assert r is not None
        while r.pending and r.running() < self.max_in_flight:
            item = r.pending[0]
            if isinstance(item, _Episodes):
                assert self.agent is not None
                handle = self.agent.registry.get(item.group.task.environment)
                if handle is None:
                    r.pending.popleft()
                    r.failed[item.key] = f"environment {item.group.task.environment!r} is not registered"
                    continue
                if not handle.can_start(item.group.n):  # its sessions are taken or its breaker is open
                    break
                r.pending.popleft()
                self.agent.start(item.group, handle)
                r.episodes[item.group.group_id] = item
                continue
            r.pending.popleft()
            self.engine.add(item.request_id, item.prompt, item.sampling)
            r.in_flight[item.request_id] = item
            r.responses[item.key] = Response()

    def absorb(self, delta: TokenDelta) -> None:
        r = self.round
        if r is not None and self.agent is not None and self.agent.owns(delta.request_id):
            self.agent.absorb(delta, r.version)  # a turn of an episode
            if self.metrics is not None:
                self.metrics.tokens.inc(len(delta.token_ids))
            return
        req = r.in_flight.get(delta.request_id) if r is not None else None
        if r is None or req is None:
            return  # a request of an abandoned round
        response = r.responses[req.key]
        response.tokens.extend(delta.token_ids)
        response.logprobs.extend(delta.logprobs)
        if self.metrics is not None:
            self.metrics.tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            response.finish_reason = delta.finish_reason
            del r.in_flight[delta.request_id]

    def pump(self) -> list[SetResult]:
        """Keep the round's requests flowing; hand a generated round to scoring; record scored results."""
        r = self.round
        if r is not None and r.episodes:
            self._collect_episodes(r)
        if r is not None:
            if self.engine.loaded_version != r.version:  # cannot happen while callers honour holds()
                self.abandon(f"the engine moved to version {self.engine.loaded_version}")
            elif r.generated:
                self.round, self.last, self._hold_since = None, r, None
                self._scoring = self._executor.submit(self._score, r)
            else:
                self._top_up()
        if self._scoring is not None and self._scoring.done():
            future, self._scoring = self._scoring, None
            try:
                results = future.result()
            except Exception:
                log.exception("scoring an evaluation round failed; its results are lost")
                self._count("abandoned")
                return []
            self.results = results
            self._count("done")
            if self.metrics is not None:
                self.metrics.round_seconds.observe(max(x.eval_seconds for x in results))
            if self.recorder is not None:
                self.recorder.record(results)
            return results
        return []

    def _collect_episodes(self, r: EvalRound) -> None:
        """Environment answers in; groups whose episodes all ended (or whose environment failed) out."""
        assert self.agent is not None
        finished, failed = self.agent.poll()
        for group in finished:
            r.episodes.pop(group.group_id, None)
        for group, why in failed:
            item = r.episodes.pop(group.group_id, None)
            if item is not None:
                r.failed[item.key] = why
                log.warning(
                    "evaluation at version %d: task %s failed in its environment: %s",
                    r.version,
                    group.task.task_id,
                    why,
                )

    def holds(self) -> bool:
        """Whether a newer version that is ready must wait (shared mode): while a round is generating, for at
        most ``max_delay_s``; past that the round is abandoned and the answer is False."""
        if self.round is None:
            self._hold_since = None
            return False
        now = time.monotonic()
        if self._hold_since is None:
            self._hold_since = now
        else:
            self.held_s += now - self._last_hold
            if self.metrics is not None:
                self.metrics.hold_seconds.inc(now - self._last_hold)
        self._last_hold = now
        held = now - self._hold_since
        if held <= self.max_delay_s:
            return True
        self.abandon(f"a newer version waited {held:.1f}s (max_delay_s = {self.max_delay_s:g})")
        return False

    def abandon(self, why: str, outcome: str = "abandoned") -> None:
        """Stop the round in the engine; its version's evaluation is not retried."""
        r = self.round
        if r is None:
            return
        self.engine.abort(list(r.in_flight))
        if self.agent is not None:
            for item in r.episodes.values():
                self.agent.abort(item.group)  # its turns stop, its sessions close
        self.round, self._hold_since = None, None
        self._count(outcome)
        log.warning("evaluation at version %d %s: %s", r.version, outcome, why)

    def _count(self, outcome: str) -> None:
        self.rounds[outcome] += 1
        if self.metrics is not None:
            self.metrics.rounds.labels(outcome).inc()

    def _score(self, r: EvalRound) -> list[SetResult]:
        jobs: list[tuple[str, ScoreInput]] = []
        keys: list[tuple[int, int, int]] = []
        for key, response in sorted(r.responses.items()):
            if key[:2] in r.failed:  # its environment failed: scored 0, counted
                continue
            s = self.sets[key[0]]
            task = s.tasks[key[1]]
            env_reward = response.environment_reward if isinstance(response, EpisodeResponse) else None
            item = ScoreInput(
                response=self.engine.decode(response.tokens),
                reference=task.reference,
                task_id=task.task_id,
                metadata=dict(task.metadata),
                payload_json=task.payload_json,
                environment_reward=env_reward,
            )
            jobs.append((s.scorer_of(task, env_reward), item))
            keys.append(key)
        outcomes = self.score_many(jobs) if jobs else []
        seconds = time.monotonic() - r.started
        results = []
        for si in r.sets:
            s = self.sets[si]
            rewards: list[list[float]] = [[0.0] * s.n for _ in s.tasks]
            failed = 0
            for key, outcome in zip(keys, outcomes, strict=True):
                if key[0] == si:
                    rewards[key[1]][key[2]] = outcome.value
                    failed += outcome.failed
            mean_at_n, pass_at_n, reward_mean = accuracy(rewards, s.correct_at)
            tokens = sum(len(v.tokens) for k, v in r.responses.items() if k[0] == si)
            failed_episodes = s.n * sum(1 for key in r.failed if key[0] == si)
            results.append(
                SetResult(
                    s.name,
                    r.version,
                    s.n,
                    len(s.tasks),
                    mean_at_n,
                    pass_at_n,
                    reward_mean,
                    failed,
                    seconds,
                    tokens,
                    rewards,
                    failed_episodes,
                )
            )
        return results

    # ------------------------------------------------------------------ standalone
    def run(
        self,
        version: int,
        stop: threading.Event | None = None,
        names: Sequence[str] | None = None,
        progress: Callable[[int, int], None] | None = None,
        progress_every_s: float = 10.0,
    ) -> list[SetResult]:
        """One whole round in an engine this evaluator owns (dedicated, the eval command); [] if stopped while
        generating (a round already generated is scored and recorded first). ``progress(done, total)``
        responses is called every ``progress_every_s`` while it generates."""
        self.begin(version, names)
        assert self.round is not None
        total, last = self.round.outstanding(), time.monotonic()
        results: list[SetResult] = []
        while self.busy:
            r = self.round
            if progress is not None and r is not None and time.monotonic() - last >= progress_every_s:
                last = time.monotonic()
                progress(total - r.outstanding(), total)
            if stop is not None and stop.is_set() and r is not None:
                self.abandon("stopped", outcome="shutdown")
                return []  # a stop while the round is being scored waits for its (recorded) results
            if self.engine.has_unfinished():
                for delta in self.engine.step():
                    self.absorb(delta)
            else:
                time.sleep(0.005)
            results = self.pump() or results
        return results

    def close(self) -> None:
        self.abandon("the service is stopping", outcome="shutdown")
        if self.agent is not None:
            self.agent.close()
        self._executor.shutdown(wait=True)
        if self._scoring is not None:  # scored before the stop: still recorded
            self.pump()


class EvalRunner:
    """The dedicated evaluator's loop: follow the published versions, load and evaluate only the due ones."""

    def __init__(self, engine: GenerationEngine, sync: WeightSync, evaluator: Evaluator) -> None:
        if evaluator.schedule is None:
            raise ValueError("the dedicated evaluator needs a schedule")
        self.engine, self.sync, self.evaluator = engine, sync, evaluator
        self.evaluated: list[int] = []
        # the first version it had in hand or passed over as not due: it follows the versions (the launcher
        # waits for this before the samplers start, so version 0 is not missed)
        self.first_version: int | None = None

    def run(self, stop: threading.Event) -> None:
        schedule = self.evaluator.schedule
        assert schedule is not None
        self.sync.start()
        try:
            while not stop.is_set():
                version = self.sync.ready()
                if self.first_version is None:
                    self.first_version = version if version is not None else self.sync.follower.declined
                due = schedule.claim(version) if version is not None else []
                if version is not None and due:
                    try:
                        self.sync.apply(version)
                    except Exception:
                        log.exception("version %d could not be loaded; it is not evaluated", version)
                        continue
                    if self.evaluator.run(version, stop, due):
                        self.evaluated.append(version)
                else:
                    stop.wait(0.05)
        finally:
            self.sync.stop()
            self.evaluator.close()
