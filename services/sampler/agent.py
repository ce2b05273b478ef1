"""The multi-turn agent loop: each response of a tool-use environment's group is an episode.

    start(group)  n x env.reset (thread pool) ─► all back: the prompt is re-encoded with the tools' schemas
                  ─► each episode: initial observation tokens (if any), then its first turn
    turn          engine request: prompt + every episode token so far (the exact ids: no re-tokenising)
                  after each engine step: parser.find_call(turn text) ─► a complete call ends the turn there
    call          env.step(action) (thread pool, deadline) ─► observation tokens appended (masked out of the
                  loss) ─► next turn;   done / max_turns / token budget ─► the episode ends
                  (the max_turns-th turn's call still goes to Step: the environment judges every turn)
    end           a turn that ends without a call is the final answer; env.close(session) in the background
    failure       a reset or step that fails or outlives its deadline fails the whole group: its requests are
                  stopped, its sessions closed, and the sampler gives the group up (the task is retried)

Nothing here blocks the sampler's loop: environment calls run on a pool of threads and are collected by
:meth:`AgentLoop.poll` once per tick; a hanging environment holds its own groups only. The token budget of an
episode is the smaller of the environment's ``max_episode_tokens`` and what ``max_model_len`` leaves after
the prompt; each turn may add at most ``sampling.max_tokens`` generated tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from services.common.prompts import PromptEncoder
from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.sampler.environments.base import EnvironmentFailure
from services.sampler.environments.registry import EnvironmentRegistry, Handle
from services.sampler.groups import Group, Response
from services.sampler.metrics import SamplerMetrics
from vcpo.v1 import environment_pb2

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 2.0  # past the call's own deadline before the loop stops waiting for its thread


@dataclass
class Episode:
    key: str  # the response's key in its group (group_id/i); also the environment session id
    response: Response
    turn_start: int = 0  # index in response.tokens where the current turn began
    request_id: str | None = None  # the engine request of the current turn
    call: Future[Any] | None = None
    call_kind: str = ""  # "reset" | "step"
    call_started: float = 0.0
    deadline: float = 0.0
    steps: int = 0
    done: bool = False


@dataclass
class EnvGroup:
    group: Group
    handle: Handle
    episodes: dict[str, Episode]
    tools: list[dict[str, Any]] = field(default_factory=list)
    started: bool = False  # the first turns were started (every reset came back)
    failure: str | None = None
    failure_reason: str = ""  # a bounded label: EnvironmentFailure.reason


class AgentLoop:
    def __init__(
        self,
        engine: GenerationEngine,
        registry: EnvironmentRegistry,
        encoder: PromptEncoder,
        metrics: SamplerMetrics | None = None,
        *,
        threads: int = 64,
    ) -> None:
        self.engine, self.registry, self.encoder, self.metrics = engine, registry, encoder, metrics
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="env-call")
        self.groups: dict[str, EnvGroup] = {}
        self.requests: dict[str, tuple[EnvGroup, Episode]] = {}  # engine request id -> its episode
        self.turns = 0
        self.calls: dict[str, int] = {}  # "reset"/"step"/"close" -> calls made
        self.close_errors = 0
        self._closing: set[Future[Any]] = set()  # session closes not yet done
        self._close_wait_s = 0.0  # the longest reset timeout a close was given

    # ------------------------------------------------------------------ start
    def start(self, group: Group, handle: Handle) -> None:
        spec = handle.spec
        handle.open_sessions += group.n
        handle.breaker.started()
        episodes = {key: Episode(key, response) for key, response in group.responses.items()}
        eg = EnvGroup(group, handle, episodes)
        self.groups[group.group_id] = eg
        for ep in episodes.values():
            self._call(ep, "reset", handle.env.reset, ep.key, group.task, spec.reset_timeout_seconds)

    def owns(self, request_id: str) -> bool:
        return request_id in self.requests

    # ------------------------------------------------------------------ tokens from the engine
    def absorb(self, delta: TokenDelta, version: int) -> None:
        eg, ep = self.requests[delta.request_id]
        ep.response.extend(delta, version)
        if eg.failure is not None:
            return
        turn_tokens = ep.response.tokens[ep.turn_start :]
        parser = eg.handle.parser
        call = None
        if delta.token_ids or delta.finish_reason is not None:
            call = (
                parser.find_call(self.engine.decode(turn_tokens))
                if not parser.every_turn_is_an_action
                else None
            )
        if call is not None and delta.finish_reason is None:
            self.engine.abort([delta.request_id])  # the turn ends at its call: nothing past it
        if call is None and delta.finish_reason is None:
            return
        del self.requests[delta.request_id]
        ep.request_id = None
        if call is None and parser.every_turn_is_an_action:
            call = environment_pb2.Action(text=self.engine.decode(turn_tokens))
        if call is None:  # a turn without a call: the model's final answer
            self._end(ep, delta.finish_reason or "stop")
            return
        # every call reaches Step, the last turn's within max_turns too: the environment judges it
        spec = eg.handle.spec
        self._call(ep, "step", eg.handle.env.step, ep.key, call, spec.step_timeout_seconds)

    # ------------------------------------------------------------------ environment answers
    def poll(self) -> tuple[list[Group], list[tuple[Group, str]]]:
        """Collect the environment calls that came back; (groups whose episodes all ended, failed groups)."""
        finished: list[Group] = []
        failed: list[tuple[Group, str]] = []
        now = time.monotonic()
        for eg in list(self.groups.values()):
            for ep in eg.episodes.values():
                if ep.call is None or eg.failure is not None:
                    continue
                if ep.call.done():
                    call, kind = ep.call, ep.call_kind
                    ep.call = None
                    if self.metrics is not None:
                        self.metrics.env_call.labels(self.metrics.replica, eg.handle.name, kind).observe(
                            now - ep.call_started
                        )
                    try:
                        result = call.result()
                    except EnvironmentFailure as exc:
                        eg.failure, eg.failure_reason = str(exc), exc.reason
                    except Exception as exc:  # an in-process environment's own bug
                        eg.failure = f"environment {eg.handle.name!r}: error: {type(exc).__name__}: {exc}"
                        eg.failure_reason = "error"
                    else:
                        self._answered(eg, ep, kind, result)
                elif now > ep.deadline:
                    eg.failure = (
                        f"environment {eg.handle.name!r}: timeout: {ep.call_kind} did not return within "
                        f"{self._timeout(eg, ep.call_kind):g}s"
                    )
                    eg.failure_reason = "timeout"
            if eg.failure is not None:
                self._fail(eg)
                failed.append((eg.group, eg.failure))
            elif eg.started and all(ep.done for ep in eg.episodes.values()):
                self._finish(eg)
                finished.append(eg.group)
        return finished, failed

    def _answered(self, eg: EnvGroup, ep: Episode, kind: str, result: Any) -> None:
        if kind == "reset":
            reply: environment_pb2.ResetResponse = result
            if not eg.tools and reply.tools:
                eg.tools = [_tool_schema(t) for t in reply.tools]
            if reply.observation.text:
                ep.response.append_observation(self._observation_tokens(eg, reply.observation.text))
            if all(e.call is None for e in eg.episodes.values()):  # every reset is back: start the turns
                if eg.tools:
                    eg.group.prompt_tokens = self.encoder.encode(eg.group.task, eg.tools)
                eg.started = True
                for e in eg.episodes.values():
                    self._next_turn(eg, e, first=True)
            return
        step: environment_pb2.StepResponse = result
        ep.steps += 1
        ep.response.environment_reward = (ep.response.environment_reward or 0.0) + step.reward
        if step.done:
            self._end(ep, "stop")
            return
        if ep.response.turns >= eg.handle.spec.max_turns:  # that was the last turn the budget allows
            self._end(ep, "tool_budget")
            return
        tokens = self._observation_tokens(eg, step.observation.text)
        if self._room(eg, ep) < len(tokens) + 1:  # the answer leaves no room for another turn
            self._end(ep, "length")
            return
        ep.response.append_observation(tokens)
        ep.response.turns += 1
        self._next_turn(eg, ep)

    # ------------------------------------------------------------------ turns
    def _room(self, eg: EnvGroup, ep: Episode) -> int:
        """Tokens the episode may still add (generated and observed)."""
        used = len(ep.response.tokens)
        room = self.encoder.max_model_len - len(eg.group.prompt_tokens) - used
        if eg.handle.spec.max_episode_tokens:
            room = min(room, eg.handle.spec.max_episode_tokens - used)
        return room

    def _next_turn(self, eg: EnvGroup, ep: Episode, first: bool = False) -> None:
        room = self._room(eg, ep)
        if room < 1:
            self._end(ep, "length")
            return
        sampling: Sampling = eg.group.sampling
        if room < sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=room)
        ep.turn_start = len(ep.response.tokens)
        ep.request_id = f"{ep.key}#{ep.response.turns}"
        self.requests[ep.request_id] = (eg, ep)
        self.engine.add(ep.request_id, eg.group.prompt_tokens + ep.response.tokens, sampling)
        self.turns += 1

    def _observation_tokens(self, eg: EnvGroup, text: str) -> list[int]:
        formatted = eg.handle.parser.format_observation(text)
        return [int(t) for t in self.encoder.tokenizer.encode(formatted, add_special_tokens=False)]

    def _end(self, ep: Episode, reason: str) -> None:
        ep.done = True
        ep.response.finish_reason = reason

    # ------------------------------------------------------------------ calls
    def _timeout(self, eg: EnvGroup, kind: str) -> float:
        spec = eg.handle.spec
        return spec.reset_timeout_seconds if kind == "reset" else spec.step_timeout_seconds

    def _call(self, ep: Episode, kind: str, fn: Any, *args: Any) -> None:
        timeout = float(args[-1])
        ep.call, ep.call_kind = self.pool.submit(fn, *args), kind
        ep.call_started = time.monotonic()
        ep.deadline = ep.call_started + timeout + DEADLINE_GRACE_S
        self.calls[kind] = self.calls.get(kind, 0) + 1

    # ------------------------------------------------------------------ the end of a group
    def _finish(self, eg: EnvGroup) -> None:
        self._release(eg)
        eg.handle.breaker.success()
        self.registry.completed(eg.handle.name, len(eg.episodes))
        if self.metrics is not None:
            labels = (self.metrics.replica, eg.handle.name)
            self.metrics.env_episodes.labels(*labels).inc(len(eg.episodes))
            for ep in eg.episodes.values():
                self.metrics.env_turns.labels(*labels).observe(ep.response.turns)

    def _fail(self, eg: EnvGroup) -> None:
        self.abort(eg.group)
        self.registry.failed(eg.handle, eg.failure or "failed")
        if self.metrics is not None:
            reason = eg.failure_reason or "error"
            self.metrics.env_failures.labels(self.metrics.replica, eg.handle.name, reason).inc()

    def abort(self, group: Group) -> None:
        """Stop a group's turns and close its sessions (it failed, grew too stale, or the sampler stops)."""
        eg = self.groups.get(group.group_id)
        if eg is None:
            return
        active = [ep.request_id for ep in eg.episodes.values() if ep.request_id is not None]
        self.engine.abort(active)
        for request_id in active:
            self.requests.pop(request_id, None)
        self._release(eg)

    def _release(self, eg: EnvGroup) -> None:
        self.groups.pop(eg.group.group_id, None)
        eg.handle.open_sessions -= len(eg.episodes)
        timeout = eg.handle.spec.reset_timeout_seconds
        self._close_wait_s = max(self._close_wait_s, float(timeout))
        for ep in eg.episodes.values():
            future = self.pool.submit(eg.handle.env.close, ep.key, timeout)
            self._closing.add(future)
            future.add_done_callback(self._closed)
        self.calls["close"] = self.calls.get("close", 0) + len(eg.episodes)

    def _closed(self, future: Future[Any]) -> None:
        self._closing.discard(future)
        if future.cancelled() or future.exception() is not None:
            self.close_errors += 1
            log.debug(
                "closing a session failed: %s", "cancelled" if future.cancelled() else future.exception()
            )

    def close(self) -> None:
        """Abort every group and close its sessions: their queued calls are cancelled, and the closes (queued
        behind any call still running) get one reset timeout to finish before the pool stops; any left are
        cancelled and counted in ``close_errors``, so a stop never waits on a dead environment for long."""
        calls = [ep.call for eg in self.groups.values() for ep in eg.episodes.values() if ep.call is not None]
        for eg in list(self.groups.values()):
            self.abort(eg.group)
        for call in calls:
            call.cancel()  # only a call not yet started: a running one ends by its own timeout
        pending = self._closing.copy()
        if pending:
            wait(pending, timeout=self._close_wait_s + DEADLINE_GRACE_S)
        self.pool.shutdown(wait=False, cancel_futures=True)


def _tool_schema(tool: environment_pb2.ToolSchema) -> dict[str, Any]:
    """A ToolSchema as the OpenAI-style function description chat templates expect."""
    try:
        parameters = json.loads(tool.parameters_json_schema) if tool.parameters_json_schema else {}
    except json.JSONDecodeError:
        parameters = {}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": parameters},
    }
