"""One sampler replica's loop: tasks in, rollout groups with exact behaviour log-probs out, never past the lag bound.

    every tick:
      1. weights   WeightSync.ready() ─► prepare (e.g. the workers' staging file, written while the engine
                   generates) ─► apply between two engine steps
                   pause mode: stop admitting, let in-flight groups finish, then apply
                   in_flight mode: apply now (engine.quiesce() first hands back the tokens an engine core
                   in another process produced ahead of the loop); in-flight responses start a new version
                   segment
      2. admit     while requests in flight + n <= max_requests_in_flight:
                   TaskFeed.next() ─► AdmissionCounter.try_admit(loaded version)   (Redis, all replicas)
                   refused: the task is held, the sampler reports WAITING and why, newer weights are polled
      3. generate  engine.add(n requests per group) ... engine.step() ─► tokens + log-probs per response
      4. emit      a finished group ─► `rollouts` stream (blocks while it is full) ─► TaskFeed.done (ack task)
      5. give up   an in-flight group that no learner step may still use (newest published version minus its
                   start version > k) is aborted, its admission slot released, its task retried

Two gates decide when a group starts, each for its own reason. The lag bound (services/common/admission.py)
is the run's: every group passes ``try_admit`` at the loaded version before it starts, whatever the engine
has room for. The in-flight cap is the engine's: it counts *requests* (responses not finished yet, of every
group in flight; a multi-turn episode counts until it ends), so a response that finishes frees its seat at
once, and a new group starts as soon as ``n`` seats are free, while the last responses of older groups run
on: with long-tailed lengths a cap of whole groups would keep the engine's batch at about 0.4 of what it
can run (benchmarks/sampler.py, ``active_over_cap``). The cap's default is the engine's own batch limit (vLLM's
``max_num_seqs``). A co-tenant's requests (shared evaluation) come on top of it, taking seats as they free.

A co-tenant (cotenant.py; held-out evaluation with ``[evaluation] placement = "shared"``, services/evaluator/)
shares the engine: step 1 offers it each version applied and asks it whether a newer one must wait (an
evaluation round generating at the loaded version holds it back for at most ``max_delay_s``), step 3 hands
it the deltas of the requests it owns; its requests never become groups.

A task of a tool-use environment is admitted only when its environment can take a group (sessions free,
circuit breaker closed); its group's responses are multi-turn episodes run by the agent loop (agent.py),
whose environment calls are collected every tick; a group the environment failed is given up like a stale
one (its task retried, up to the feed's limit). With the agent API (``[agents]``), the tasks without an
environment are admitted when agents claim their episodes (:meth:`Sampler.admit_agents`), and the agents'
requests are served every tick (agents/episodes.py).

What blocks what: a full `rollouts` stream blocks step 4 and so the whole loop (back-pressure); the lag bound
blocks step 2 until newer weights are applied; weight fetches and environment calls run on other threads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Literal

from services.common.admission import Admission, AdmissionCounter
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import agent_groups_key
from services.sampler.agent import AgentLoop
from services.sampler.agents.commands import AgentError, stale_error, stopping_error
from services.sampler.agents.episodes import EpisodeBook
from services.sampler.build import request_cap
from services.sampler.cotenant import Cotenant
from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.sampler.feed import PreparedTask, TaskFeed
from services.sampler.groups import Group
from services.sampler.metrics import SamplerMetrics
from services.sampler.servicer import SamplerState
from services.sampler.weights import WeightSync
from vcpo.v1 import common_pb2, rollout_pb2

log = logging.getLogger(__name__)

State = common_pb2.ServiceStatus


class Sampler:
    def __init__(
        self,
        engine: GenerationEngine,
        feed: TaskFeed,
        admission: AdmissionCounter,
        rollouts: StreamProducer[rollout_pb2.TrajectoryGroup],
        sync: WeightSync,
        metrics: SamplerMetrics,
        *,
        run_id: str,
        replica_id: str,
        n: int,
        sampling: Sampling,
        max_requests_in_flight: int = 0,
        weight_update: Literal["pause", "in_flight"] = "pause",
        agent: AgentLoop | None = None,
        cotenant: Cotenant | None = None,
    ) -> None:
        self.engine, self.feed, self.admission, self.rollouts = engine, feed, admission, rollouts
        self.sync, self.metrics = sync, metrics
        self.run_id, self.replica_id, self.n, self.sampling = run_id, replica_id, n, sampling
        self.max_requests_in_flight = request_cap(engine, max_requests_in_flight, n)
        if weight_update == "in_flight" and not engine.exact_in_flight:
            raise ValueError(
                "sampler.weight_update = 'in_flight' needs an engine that can tell which weights produced "
                f"each token across a swap; {type(engine).__name__} cannot (its engine core runs ahead in "
                "another process and cannot be paused and drained): set sampler.weight_update = 'pause'"
            )
        self.weight_update = weight_update
        self.k = admission.k
        self.agent = agent
        self.cotenant = cotenant  # shares the engine (held-out evaluation, shared placement)
        # with one, agents play the tasks without an environment over the agent API (agents/episodes.py)
        self.book: EpisodeBook | None = None
        self.status = SamplerState()
        self.groups: dict[str, Group] = {}
        self._by_request: dict[str, Group] = {}
        self._held: deque[PreparedTask] = deque()
        self._counter = 0
        # group ids stay unique across restarts of this replica (the ledger counts them one by one)
        self.incarnation = uuid.uuid4().hex[:8]
        self._draining = False
        self._blocked_since: float | None = None
        self.emitted = 0
        self.max_groups = 0  # stop admitting once this many are written or in flight (0: no limit)
        self.aborted: dict[str, int] = {}
        self.busy_s = 0.0  # in engine steps: generating, not waiting for admission or weights
        self._published = 0.0
        self.lags: list[int] = []  # newest known version - policy_version_start of each emitted group

    # ------------------------------------------------------------------ the loop
    def run(self, stop: threading.Event, max_groups: int = 0) -> None:
        """Tick until ``stop`` is set (or ``max_groups`` groups are written); then give back what is in flight."""
        self.max_groups = max_groups
        reclaimed = self.admission.reclaim(self.replica_id)  # what a dead predecessor under this name held
        if reclaimed:
            log.warning(
                "%s: gave back %d admission slot(s) a previous run of this replica still held",
                self.replica_id,
                reclaimed,
            )
        self.sync.start()
        try:
            while not stop.is_set() and not (max_groups and self.emitted >= max_groups):
                self.tick()
        finally:
            self.shutdown()

    def tick(self) -> None:
        self.feed.keep_alive()
        self._update_weights()
        self._admit()
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            deltas = self.engine.step()
            self.busy_s += time.perf_counter() - t0
            self._absorb(deltas)
        else:
            self._idle_wait()
        self._poll_environments()
        if self.cotenant is not None:
            self.cotenant.pump()
        self._give_up_stale()
        self._report()

    def shutdown(self) -> None:
        """Abort in-flight groups and release their admission slots (their stream tasks stay pending)."""
        self.sync.stop()
        self._give_up_all("shutdown", retry=False)
        self._unblock()
        if self.agent is not None:
            self.agent.close()
        if self.book is not None:
            self.book.close()
        if self.cotenant is not None:
            self.cotenant.close()

    # ------------------------------------------------------------------ 1. weights
    def _update_weights(self) -> None:
        self.sync.pump()  # the collective transport receives a broadcast version here, between engine steps
        version = self.sync.ready()
        if version is None:
            return
        try:  # before any pause, and before draining: the engine generates meanwhile
            self.sync.prepare(version)
        except Exception:  # e.g. a full /dev/shm (LoadNotStarted): the version is dropped, nothing paused
            self.metrics.weight_errors.labels(self.replica_id).inc()
            log.exception(
                "version %d was not loaded; still serving version %s", version, self.engine.loaded_version
            )
            return
        if self.sync.ready() != version:  # a newer version began staging meanwhile: it is taken instead
            return
        if self.cotenant is not None and self.cotenant.holds():
            return  # e.g. an evaluation round is generating at the loaded version (for at most max_delay_s)
        if self.weight_update == "pause" and self.groups:
            self._draining = True  # no new groups; apply once the in-flight ones are done
            return
        # tokens an engine core in another process produced ahead of this loop are the loaded version's:
        # take them under it before the swap (in-process engines have none)
        pending = self.engine.quiesce()
        if pending:
            self._absorb(pending)
        try:
            seconds = self.sync.apply(version)
        except Exception:
            self.metrics.weight_errors.labels(self.replica_id).inc()
            log.exception(
                "version %d was not loaded; still serving version %s", version, self.engine.loaded_version
            )
            if self.engine.loaded_version is None:  # a load failed part-way: the weights are no version's
                self._give_up_all("weights_lost", retry=True)
            return
        finally:
            self.engine.resume()
        self._draining = False
        self.metrics.weight_fetch.labels(self.replica_id).observe(self.sync.fetch_seconds)
        self.metrics.weight_load.labels(self.replica_id).observe(seconds)
        self.metrics.weight_versions.labels(self.replica_id, self.sync.last_path).inc()
        self.metrics.version.labels(self.replica_id).set(version)
        self.status.policy_version = version
        if self.cotenant is not None:
            self.cotenant.offer(version)

    # ------------------------------------------------------------------ 2. admission
    def _admit(self) -> None:
        version = self.engine.loaded_version
        if version is None or self._draining:
            return
        active = self.requests_in_flight()
        while active + self.n <= self.max_requests_in_flight:
            if self.max_groups and self.emitted + len(self.groups) >= self.max_groups:
                return
            prepared = self._held.popleft() if self._held else self.feed.next(self._can_start)
            if prepared is None:
                return
            decision = self.admission.try_admit(version, holder=self.replica_id)
            if not decision.admitted:
                self._held.appendleft(prepared)
                self._refused(decision)
                return
            self._unblock()
            self._start(prepared, version)
            active += self.n

    def requests_in_flight(self) -> int:  # the seats the groups in flight hold in the engine
        return sum(group.unfinished for group in self.groups.values())

    def _start(self, prepared: PreparedTask, version: int) -> Group:
        self._counter += 1
        group_id = f"{self.replica_id}.{self.incarnation}-{self._counter}"
        budget = self.feed.encoder.response_budget(len(prepared.prompt_tokens))
        sampling = self.sampling
        if budget < sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=budget)
        environment = prepared.task.environment
        agents = self.book is not None and not environment
        group = Group(
            group_id,
            prepared.task,
            prepared.prompt_tokens,
            version,
            sampling,
            self.n,
            prepared,
            multi_turn=bool(environment) or agents,
        )
        self.groups[group_id] = group
        if environment:
            handle = self.agent.registry.get(environment) if self.agent is not None else None
            if handle is None or self.agent is None:
                raise RuntimeError(f"group {group_id}: environment {environment!r} vanished after admission")
            self.agent.start(group, handle)
        elif not agents:  # agents' groups wait for agents to claim their episodes
            for request_id in group.request_ids:
                self.engine.add(request_id, prepared.prompt_tokens, sampling)
                self._by_request[request_id] = group
        return group

    def admit_agents(self) -> tuple[Group | None, str]:
        """A group of a task for agents, admitted now (for the agent API's claims), or (None, why not)."""
        version, active, cap = (
            self.engine.loaded_version,
            self.requests_in_flight(),
            self.max_requests_in_flight,
        )
        if version is None or self._draining:
            return None, "no policy version is loaded yet" if version is None else "a new version is loading"
        if active + self.n > cap:
            return None, f"{active} requests in flight, at most {cap} (sampler.max_requests_in_flight)"
        if self.max_groups and self.emitted + len(self.groups) >= self.max_groups:
            return None, f"this replica's {self.max_groups} groups are written or in flight"
        prepared = self.feed.next(lambda task: not task.environment)
        if prepared is None:
            return None, "no task is waiting (dataset or tasks stream)"
        decision = self.admission.try_admit(version, holder=self.replica_id)
        if not decision.admitted:
            self.feed.retry(prepared)  # first in line again
            self._refused(decision)
            return None, self.status.detail
        self._unblock()
        return self._start(prepared, version), ""

    def _can_start(self, task: rollout_pb2.Task) -> bool:
        """Whether a task's environment can take a group now (single-turn tasks: unless agents play them)."""
        if not task.environment:
            return self.book is None
        handle = self.agent.registry.get(task.environment) if self.agent is not None else None
        return handle is not None and handle.can_start(self.n)

    def _refused(self, decision: Admission) -> None:
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
            self.metrics.refusals.labels(self.replica_id).inc()
            self.sync.poll_now()
        self.status.state = State.WAITING
        self.status.detail = self.sync.waiting_reason(decision)

    def _unblock(self) -> None:
        if self._blocked_since is not None:
            self._count_blocked()
            self._blocked_since = None

    def _count_blocked(self) -> None:
        """Blocked time into the metric as it goes (an alert on a long block must see it grow)."""
        if self._blocked_since is not None:
            now = time.monotonic()
            self.metrics.blocked.labels(self.replica_id).inc(now - self._blocked_since)
            self._blocked_since = now

    # ------------------------------------------------------------------ 3./4. generate and emit
    def _absorb(self, deltas: list[TokenDelta]) -> None:
        version = self.engine.loaded_version
        tokens = 0
        for delta in deltas:
            if self.cotenant is not None and self.cotenant.owns(delta.request_id):
                self.cotenant.absorb(delta)
                continue
            if version is None:  # the weights are no version's (a load failed part-way): no group is left
                continue
            # a turn of an episode: the agent loop's, or an agent's over the agent API
            loop = self.agent if self.agent is not None and self.agent.owns(delta.request_id) else self.book
            if loop is not None and loop.owns(delta.request_id):
                loop.absorb(delta, version)
                tokens += len(delta.token_ids)
                continue
            group = self._by_request.get(delta.request_id)
            if group is None:  # a request of a group given up in this step
                continue
            group.responses[delta.request_id].extend(delta, version)
            tokens += len(delta.token_ids)
            if delta.finish_reason is not None and group.finished:
                self._emit(group)
        self.metrics.add_tokens(tokens)

    def _emit(self, group: Group) -> None:
        lag = self.lag(group)
        if lag > self.k:  # the learner has moved on while this group finished: it cannot be used
            self._give_up(group, "lag", retry=True)
            return
        self._forget(group)
        message = group.to_proto(self.run_id, self.replica_id, self.engine.decode)
        kind = [agent_groups_key(self.rollouts.spec.key)] if self.book and not group.task.environment else []
        self.rollouts.put(message, message.policy_version_start, write_id=message.group_id, count_in=kind)
        self.admission.settle(self.replica_id)  # after the write: a crash between gives back, never loses
        self.feed.done(group.source)
        self.emitted += 1
        self.lags.append(lag)
        self.metrics.groups.labels(self.replica_id).inc()
        self.metrics.lag.labels(self.replica_id).observe(lag)

    # ------------------------------------------------------------------ 5. give up stale groups
    def lag(self, group: Group) -> int:
        """The least lag any learner step could still consume the group with: newest published - its version."""
        newest = self.sync.newest_known
        return 0 if newest is None else max(0, newest - group.version)

    def _give_up_stale(self) -> None:
        for group in list(self.groups.values()):
            if (lag := self.lag(group)) > self.k:
                self._stop(group, stale_error(group, lag, self.k))
                self._give_up(group, "lag", retry=True)

    def _give_up_all(self, reason: str, retry: bool) -> None:
        """Stop and give up every group in flight: at shutdown, or after a load that failed part-way (the
        engine's weights are then no version's, and no token they produce could be trained on)."""
        error = stopping_error()
        if reason != "shutdown":
            error = AgentError(409, "episode_failed", "a weight load failed part-way; the group was given up")
        for group in list(self.groups.values()):
            self._stop(group, error)
            self._give_up(group, reason, retry=retry)

    def _stop(self, group: Group, error: AgentError) -> None:
        """Stop generating a group (its environment sessions, if any, are closed; its agents get ``error``)."""
        if self.book is not None and group.group_id in self.book.groups:
            self.book.abort(group, error)
        elif group.multi_turn and self.agent is not None:
            self.agent.abort(group)
        else:
            self.engine.abort(group.request_ids)

    def _poll_environments(self) -> None:
        if self.book is not None:
            done, given_up = self.book.pump()
            for group in done:
                self._emit(group)
            for group, reason, failure in given_up:  # a stale group's task is retried without a strike
                self._give_up(group, reason, retry=True, failure=None if reason == "lag" else failure)
        if self.agent is None:
            return
        finished, failed = self.agent.poll()
        for group in finished:
            self._emit(group)
        for group, failure in failed:
            log.warning("group %s failed in its environment: %s", group.group_id, failure)
            self._give_up(group, "environment", retry=True, failure=failure)

    def _give_up(self, group: Group, reason: str, retry: bool, failure: str | None = None) -> None:
        """Drop a group that will not be written: its admission slot goes back, its task is retried or not."""
        self._forget(group)
        self.admission.release(1, holder=self.replica_id)
        self.aborted[reason] = self.aborted.get(reason, 0) + 1
        self.metrics.aborted.labels(self.replica_id, reason).inc()
        log.info(
            "gave up group %s (version %d, task %s): %s",
            group.group_id,
            group.version,
            group.task.task_id,
            reason,
        )
        if retry:
            self.feed.retry(group.source, failure)

    def _forget(self, group: Group) -> None:
        self.groups.pop(group.group_id, None)
        for request_id in group.request_ids:
            self._by_request.pop(request_id, None)

    # ------------------------------------------------------------------ status
    def _idle_wait(self) -> None:
        timeout = 0.01 if self.engine.loaded_version is not None else 0.05
        self.book.idle(timeout) if self.book is not None else time.sleep(timeout)

    def _report_environments(self) -> None:
        """Every 2 s: each environment's queued tasks and breaker here, for EnvironmentStatus and metrics."""
        now = time.monotonic()
        if self.agent is None or now - self._published < 2.0:
            return
        self._published = now
        registry = self.agent.registry
        registry.refresh()
        for name, handle in registry.handles.items():
            handle.queued = self.feed.waiting_count(name)
            paused = handle.breaker.state != "closed"
            self.metrics.env_paused.labels(self.replica_id, name).set(1.0 if paused else 0.0)
        registry.publish_live()

    def _report(self) -> None:
        self._count_blocked()
        self._report_environments()
        rate = self.metrics.refresh()
        self.metrics.in_flight.labels(self.replica_id).set(len(self.groups))
        newest = self.sync.newest_known
        if newest is not None:
            self.metrics.newest.labels(self.replica_id).set(newest)
        if self.engine.loaded_version is None:
            self.status.state = State.STARTING
            self.status.detail = "waiting for the first policy version" + (
                f": {self.sync.error}" if self.sync.error else ""
            )
        elif self._blocked_since is None:
            self.status.state = State.READY
            self.status.detail = (
                f"draining to load version {self.sync.ready()}" if self._draining else "generating"
            )
        self.status.figures = {
            "groups_in_flight": float(len(self.groups)),
            "requests_in_flight": float(self.requests_in_flight()),
            "max_requests_in_flight": float(self.max_requests_in_flight),
            "groups_emitted": float(self.emitted),
            "tokens_per_second": rate,
            "task_errors": float(sum(self.feed.errors.values())),
            "groups_aborted": float(sum(self.aborted.values())),
            **({"agent_episodes_open": float(self.book.episodes_open())} if self.book is not None else {}),
            "busy_seconds": self.busy_s,
            **(self.cotenant.figures() if self.cotenant is not None else {}),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "policy_version": self.engine.loaded_version,
            "groups_emitted": self.emitted,
            "groups_aborted": dict(self.aborted),
            "task_errors": dict(self.feed.errors),
            "max_lag": max(self.lags, default=0),
            "busy_seconds": self.busy_s,
            **(
                {"environment_calls": dict(self.agent.calls), "turns": self.agent.turns} if self.agent else {}
            ),
            **(self.cotenant.summary() if self.cotenant is not None else {}),
        }
