"""The evaluator: runs evaluation rounds in a generation engine, beside training or on its own.

    begin(v, sets) ─► n requests per task with the set's own sampling, at most max_in_flight in the engine
                      (a set with an environment: each task's n samples are one group of episodes in an agent
                      loop of the evaluator's own: training's turns, tool calls, masked observations)
    engine.step() ─► absorb(delta) ─► each response's tokens and log-probs
    pump(): all generated ─► scoring thread (rounds.tally_round) ─► SetResult per set (rounds.set_results)
            ─► EvalRecorder (a shared round: each shard's tallies to Redis first; shards.py)

In a sampler replica's engine (shared placement) it is the replica's co-tenant
(:class:`services.sampler.cotenant.Cotenant`): the loop hands it the deltas of its requests, offers it each
version it loads and asks it whether a newer version must wait (:meth:`Evaluator.holds`). There a round is the
work of every replica serving its version: with a :class:`~services.evaluator.shards.ShardBoard` the evaluator
takes shards of it while its engine has room, hands in each shard's tallies, and the replica whose shard
completes the round records it. In an engine of its own (the dedicated evaluator, the eval command)
:meth:`Evaluator.run` drives one whole round.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from services.common.prompts import PromptEncoder
from services.evaluator.metrics import ROUND_OUTCOMES, EvalMetrics, EvalRecorder, SetResult
from services.evaluator.rounds import (
    EvalRound,
    Response,
    SampleRequest,
    ScoreMany,
    TaskEpisodes,
    TaskTally,
    set_results,
    tally_round,
)
from services.evaluator.schedule import EvalSchedule
from services.evaluator.sets import EvalSet
from services.evaluator.shards import ShardBoard
from services.sampler.agent import AgentLoop
from services.sampler.engine import GenerationEngine, TokenDelta
from services.sampler.groups import Group

log = logging.getLogger(__name__)

REQUEST_PREFIX = "eval/"
"""Every evaluation request id starts with it (a training request id never does)."""


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
        on_close: Callable[[], None] | None = None,
        board: ShardBoard | None = None,
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
        if max_in_flight < 1:
            raise ValueError(f"an evaluator needs at least one request in flight, got {max_in_flight}")
        self.max_in_flight, self.max_delay_s, self.metrics = max_in_flight, max_delay_s, metrics
        self.board = board  # shared rounds: split into shards among the replicas serving their version
        # request and episode ids: a shared round's name the replica too, so that a shard another replica takes
        # again never reuses the ids (or environment sessions) of the one that gave it up
        self._ids = f"{REQUEST_PREFIX}{board.owner}/" if board is not None else REQUEST_PREFIX
        self.round: EvalRound | None = None
        self.last: EvalRound | None = None  # the latest round generated (tests read its responses)
        self.results: list[SetResult] = []  # of the latest round scored
        self.rounds: dict[str, int] = {outcome: 0 for outcome in ROUND_OUTCOMES}
        # generated rounds being scored: in a shared round a replica may take more shards meanwhile
        self._scoring: list[tuple[EvalRound, Future[tuple[dict[tuple[int, int], TaskTally], float]]]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score")
        self._hold_since: float | None = None
        self._last_hold = 0.0
        self.held_s = 0.0  # newer versions waited this long for rounds to finish generating (shared)
        self._serial = 0
        self._on_close = on_close  # releases what it was built with (its scoring pool)
        self._closed = False

    # ------------------------------------------------------------------ state
    @property
    def generating(self) -> bool:
        """A round is in the engine: the engine must keep serving its version."""
        return self.round is not None

    @property
    def busy(self) -> bool:
        return self.round is not None or bool(self._scoring)

    def owns(self, request_id: str) -> bool:
        return request_id.startswith(REQUEST_PREFIX)

    def figures(self) -> dict[str, float]:
        """For the replica's status: rounds by outcome (the launcher's progress line shows those abandoned)."""
        return {f"evaluation_rounds_{k}": float(v) for k, v in self.rounds.items()}

    def summary(self) -> dict[str, Any]:
        return {"evaluation_rounds": dict(self.rounds), "evaluation_hold_s": self.held_s}

    # ------------------------------------------------------------------ the round
    def offer(self, version: int) -> bool:
        """The engine now serves ``version``: start a round of the sets the schedule says are due (if not busy;
        in a shared round, the first shard this replica can take of it, even while it scores an earlier one)."""
        if self.schedule is None:
            return False
        if self.board is None:
            if self.busy:
                return False
            due = self.schedule.claim(version)
            if due:
                self.begin(version, due)
            return bool(due)
        if self.round is not None:  # cannot happen while the loop honours holds()
            return False
        due = self.schedule.due(version)
        if not due:
            self.board.leave()
            return False
        self.board.join(version, [i for i, s in enumerate(self.sets) if s.name in due], self.sets)
        return self._take_shard()

    def begin(self, version: int, names: Sequence[str] | None = None) -> None:
        """Start a round at ``version`` of the sets named (all of them by default)."""
        if self.busy:
            raise RuntimeError(f"an evaluation round is still running; cannot begin one at version {version}")
        chosen = [i for i, s in enumerate(self.sets) if names is None or s.name in names]
        self._begin(version, chosen, [(si, ti) for si in chosen for ti in range(len(self.sets[si].tasks))])

    def _begin(self, version: int, chosen: list[int], tasks: list[tuple[int, int]]) -> EvalRound:
        if self.engine.loaded_version != version:
            raise RuntimeError(f"the engine serves version {self.engine.loaded_version}, not {version}")
        self._serial += 1
        r = self.round = EvalRound(version, deque(), chosen)
        r.pending.extend(self._requests(r, tasks))
        log.info("evaluation at version %d: %d samples over %d set(s)", version, r.outstanding(), len(chosen))
        self._top_up()
        return r

    def _requests(self, r: EvalRound, tasks: list[tuple[int, int]]) -> Iterator[SampleRequest | TaskEpisodes]:
        """What the engine is asked for ``tasks`` of round ``r``, whose responses it registers."""
        for si, ti in tasks:
            s, prompt = self.sets[si], self.sets[si].prompts[ti]
            sampling = s.sampling
            if self.encoder is not None:
                budget = self.encoder.response_budget(len(prompt))
                if budget < sampling.max_tokens:
                    sampling = dataclasses.replace(sampling, max_tokens=budget)
            if s.environment:  # the agent loop fills the group's responses in place
                group_id = f"{self._ids}{self._serial}/v{r.version}/{s.name}/{ti}"
                group = Group(group_id, s.tasks[ti], list(prompt), r.version, sampling, s.n, multi_turn=True)
                for k, response in enumerate(group.responses.values()):
                    r.responses[(si, ti, k)] = response
                yield TaskEpisodes((si, ti), group)
                continue
            for k in range(s.n):
                rid = f"{self._ids}{self._serial}/v{r.version}/{s.name}/{ti}/{k}"
                yield SampleRequest(rid, (si, ti, k), prompt, sampling)

    def _take_shard(self) -> bool:
        """A shard of the shared round at the loaded version into this engine: the round generating here gets
        its tasks (or one starts with them); False when no shard is free."""
        assert self.board is not None
        taken = self.board.take(self.engine.loaded_version)
        if taken is None:
            return False
        shard, tasks = taken
        layout = self.board.joined
        assert layout is not None  # take() hands out shards of the joined round only
        r = self.round
        if r is None:
            r = self._begin(layout.version, list(layout.sets), tasks)
        else:
            r.pending.extend(self._requests(r, tasks))
        r.shards[shard] = tasks
        return True

    def _top_up(self) -> None:
        r = self.round
        assert r is not None
        while r.pending and r.running() < self.max_in_flight:
            item = r.pending[0]
            if isinstance(item, TaskEpisodes):
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
            else:
                # a shared round: more shards while the engine has room and this replica's are all started
                while self.board is not None and not r.pending and r.running() < self.max_in_flight:
                    if not self._take_shard():
                        break
                if r.generated:
                    self.round, self.last, self._hold_since = None, r, None
                    self._scoring.append((r, self._executor.submit(self._score, r)))
                else:
                    self._top_up()
        elif self.board is not None and self.board.joined is not None:
            self._take_shard()  # a shard given back, or whose replica died, at the version this engine serves
        if self.board is not None:
            self.board.renew()
        return self._scored()

    def _scored(self) -> list[SetResult]:
        """Rounds scored since the last call: their results (a shared round's once its last shard is in)."""
        recorded: list[SetResult] = []
        for item in [x for x in self._scoring if x[1].done()]:
            self._scoring.remove(item)
            r, future = item
            try:
                tallies, seconds = future.result()
            except Exception:
                log.exception("scoring an evaluation round failed; its results are lost")
                self._count("abandoned")
                if self.board is not None:
                    self.board.release(r.version, list(r.shards))  # another replica may generate them again
                continue
            self._count("done")
            if self.board is None:
                results = set_results(tallies, self.sets, r.sets, r.version, seconds)
            else:
                by_shard = {shard: {t: tallies[t] for t in tasks} for shard, tasks in r.shards.items()}
                whole = self.board.submit(r.version, by_shard)
                if whole is None:
                    continue  # other shards are still out: the replica that completes the round records it
                layout, everything = whole
                results = set_results(
                    everything, self.sets, list(layout.sets), r.version, time.time() - layout.started
                )
            self.results = recorded = results
            if self.metrics is not None:
                self.metrics.round_seconds.observe(max(x.eval_seconds for x in results))
            if self.recorder is not None:
                self.recorder.record(results)
        return recorded

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
        if self.board is not None:  # the shards go back: a replica still serving the version may take them
            self.board.release(r.version, list(r.shards))
        self.round, self._hold_since = None, None
        self._count(outcome)
        log.warning("evaluation at version %d %s: %s", r.version, outcome, why)

    def _count(self, outcome: str) -> None:
        self.rounds[outcome] += 1
        if self.metrics is not None:
            self.metrics.rounds.labels(outcome).inc()

    def _score(self, r: EvalRound) -> tuple[dict[tuple[int, int], TaskTally], float]:
        tallies = tally_round(r, self.sets, self.score_many, self.engine.decode)
        return tallies, time.monotonic() - r.started

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
        """Abandon a round still generating, record one being scored, release the agent loop and scorers;
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.abandon("the service is stopping", outcome="shutdown")
        if self.agent is not None:
            self.agent.close()
        self._executor.shutdown(wait=True)
        if self._scoring:  # scored before the stop: still recorded (a shared round's shards handed in)
            self._scored()
        if self.board is not None:
            self.board.leave()
        if self._on_close is not None:
            self._on_close()
