"""The run's registered environments: specs shared by every sampler replica, and each one's health here.

    RegisterEnvironment ─► validate_spec (defaults filled, bad values named) ─► health check of the endpoint
        ─► Redis hash ``vcpo:<run>:environments`` (name -> EnvironmentSpec bytes): every replica sees it
    EnvironmentRegistry.get(name) ─► Handle: the spec, a live Environment, its parser, its circuit breaker
        (re-read from Redis every ``refresh_s``, and at once for a name not known here)

What it decides:

- Defaults for what a spec leaves at zero (timeouts, concurrency, turns, weight, parser); a value that cannot
  work (concurrency below the group size, a negative timeout, an unknown built-in or parser, an endpoint
  that does not parse or does not answer health checks) is refused with a message naming it.
- ``max_concurrency`` is episodes open at once against the environment *per sampler replica*; a group needs
  ``n`` of them at once (its episodes run side by side), so a group starts only when ``n`` are free.
- The circuit breaker: ``failures_to_open`` groups failing in a row pause the environment for ``cooldown_s``
  (doubling while it keeps failing, up to ``max_cooldown_s``); then one trial group is let through: success
  closes it, failure opens it again. A paused environment's tasks wait; the other environments keep going.
- Counters that every replica adds to (episodes completed, errors, the last error) live in Redis beside the
  spec, so any replica's ``EnvironmentStatus`` answers for the whole system; what is running or queued is
  published by each replica with a timestamp and summed over the replicas heard from lately.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import redis

from services.common.tls import ClientTls
from services.sampler.environments.base import Environment
from services.sampler.environments.parsers import DEFAULT_PARSER, PARSERS, ToolParser, make_parser
from vcpo.v1 import registry_pb2

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_RESET_TIMEOUT_S = 30.0
DEFAULT_STEP_TIMEOUT_S = 60.0
DEFAULT_MAX_TURNS = 8
HEALTH_TIMEOUT_S = 5.0
REPLICA_FRESH_S = 30.0  # a replica's running/queued figures count while this recent


class SpecError(ValueError):
    """A registration that cannot work; the message names the field and the value."""


class Unreachable(SpecError):
    """The spec is well formed but nothing answers at its endpoint."""


def validate_spec(
    spec: registry_pb2.EnvironmentSpec, group_size: int, scorers: Collection[str] | None = None
) -> registry_pb2.EnvironmentSpec:
    """A copy of ``spec`` with defaults filled in; SpecError naming what is wrong. ``scorers``: the names a
    ``scorer`` may take (None: not checked)."""
    from services.sampler.environments.builtin import BUILTINS
    from services.sampler.environments.grpc_env import parse_endpoint

    out = registry_pb2.EnvironmentSpec()
    out.CopyFrom(spec)
    if not NAME_PATTERN.match(out.name):
        raise SpecError(
            f"name {out.name!r}: 1-64 letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    backend = out.WhichOneof("backend")
    if backend is None:
        raise SpecError(
            f"environment {out.name!r}: give an endpoint (host:port) or a builtin {sorted(BUILTINS)}"
        )
    if backend == "builtin" and out.builtin not in BUILTINS:
        raise SpecError(
            f"environment {out.name!r}: unknown builtin {out.builtin!r}; one of {sorted(BUILTINS)}"
        )
    if backend == "endpoint":
        try:
            parse_endpoint(out.endpoint)
        except ValueError as exc:
            raise SpecError(f"environment {out.name!r}: bad endpoint: {exc}") from None
    for name, default in (
        ("reset_timeout_seconds", DEFAULT_RESET_TIMEOUT_S),
        ("step_timeout_seconds", DEFAULT_STEP_TIMEOUT_S),
    ):
        value = getattr(out, name)
        if not math.isfinite(value) or value < 0:
            raise SpecError(
                f"environment {out.name!r}: {name} must be a positive number of seconds, got {value}"
            )
        if value == 0:
            setattr(out, name, default)
    if out.max_concurrency == 0:
        out.max_concurrency = 4 * group_size
    if out.max_concurrency < group_size:
        raise SpecError(
            f"environment {out.name!r}: max_concurrency {out.max_concurrency} is below the group size n = "
            f"{group_size}: a group runs its {group_size} episodes at once"
        )
    if not math.isfinite(out.weight) or out.weight < 0:
        raise SpecError(f"environment {out.name!r}: weight must be >= 0, got {out.weight}")
    if out.weight == 0:
        out.weight = 1.0
    if out.max_turns == 0:
        out.max_turns = DEFAULT_MAX_TURNS
    if out.scorer and scorers is not None and out.scorer not in scorers:
        raise SpecError(
            f"environment {out.name!r}: unknown scorer {out.scorer!r}; registered scorers: "
            f"{', '.join(sorted(scorers))}"
        )
    if not out.tool_parser:
        out.tool_parser = DEFAULT_PARSER
    if out.tool_parser not in PARSERS:
        raise SpecError(
            f"environment {out.name!r}: unknown tool_parser {out.tool_parser!r}; one of {sorted(PARSERS)}"
        )
    return out


def make_environment(
    spec: registry_pb2.EnvironmentSpec, max_message_bytes: int, tls: ClientTls | None = None
) -> Environment:
    """The environment a spec names: a built-in, or a client of its endpoint (over TLS when ``spec.tls``,
    trusting and presenting what ``tls`` says; with its ``auth_token`` on every call)."""
    from services.common.tls import channel_credentials
    from services.sampler.environments.builtin import BUILTINS
    from services.sampler.environments.grpc_env import GrpcEnvironment

    if spec.WhichOneof("backend") == "builtin":
        return BUILTINS[spec.builtin](spec.name)
    credentials = channel_credentials(tls or ClientTls()) if spec.tls else None
    return GrpcEnvironment(
        spec.name,
        spec.endpoint,
        max_message_bytes=max_message_bytes,
        credentials=credentials,
        token=spec.auth_token,
    )


def public(spec: registry_pb2.EnvironmentSpec) -> registry_pb2.EnvironmentSpec:
    """``spec`` as calls return it: its auth token masked."""
    out = registry_pb2.EnvironmentSpec()
    out.CopyFrom(spec)
    if out.auth_token:
        out.auth_token = "***"
    return out


class CircuitBreaker:
    """closed ─(failures_to_open in a row)─► open ─(cooldown)─► half_open: one trial ─► closed | open."""

    def __init__(
        self,
        failures_to_open: int = 3,
        cooldown_s: float = 30.0,
        max_cooldown_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures_to_open, self.base_cooldown_s, self.max_cooldown_s = (
            failures_to_open,
            cooldown_s,
            max_cooldown_s,
        )
        self.clock = clock
        self.state = "closed"
        self.failures = 0  # in a row
        self.cooldown_s = cooldown_s
        self.opened_at = 0.0
        self.trial_out = False
        self.times_opened = 0

    def allow(self) -> bool:
        """Whether a group may start now (in half_open: only the one trial)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self.state, self.trial_out = "half_open", False
        if self.state == "closed":
            return True
        return self.state == "half_open" and not self.trial_out

    def started(self) -> None:
        if self.state == "half_open":
            self.trial_out = True

    def success(self) -> None:
        self.state, self.failures, self.cooldown_s, self.trial_out = "closed", 0, self.base_cooldown_s, False

    def failure(self) -> bool:
        """Count a failed group; True when this opened the breaker."""
        self.failures += 1
        if self.state == "half_open":
            self.cooldown_s = min(self.max_cooldown_s, self.cooldown_s * 2)
        elif self.state == "open" or self.failures < self.failures_to_open:
            return False
        self.state, self.opened_at, self.trial_out = "open", self.clock(), False
        self.times_opened += 1
        return True

    @property
    def paused_for_s(self) -> float:
        return max(0.0, self.cooldown_s - (self.clock() - self.opened_at)) if self.state == "open" else 0.0


@dataclass
class Handle:
    """One registered environment as this replica runs it."""

    spec: registry_pb2.EnvironmentSpec
    env: Environment
    parser: ToolParser
    breaker: CircuitBreaker
    open_sessions: int = 0
    queued: int = 0  # tasks for it waiting in this replica's feed
    last_error: str = ""
    retired: list[Environment] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def can_start(self, n: int) -> bool:
        return self.open_sessions + n <= self.spec.max_concurrency and self.breaker.allow()


class EnvironmentRegistry:
    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        replica_id: str,
        group_size: int,
        *,
        max_message_bytes: int = 4 << 20,
        refresh_s: float = 2.0,
        breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
        make_env: Callable[[registry_pb2.EnvironmentSpec, int], Environment] = make_environment,
        scorers: Collection[str] | None = None,
    ) -> None:
        self.client, self.replica_id, self.group_size = client, replica_id, group_size
        self.key = f"vcpo:{run_id}:environments"
        self.stats_key = f"vcpo:{run_id}:environments:stats"
        self.live_key = f"vcpo:{run_id}:environments:live"
        self.draining_key = f"vcpo:{run_id}:environments:draining"
        self.max_message_bytes, self.refresh_s = max_message_bytes, refresh_s
        self._breaker, self._make_env = breaker, make_env
        self.scorers = scorers  # the names a spec's or a submitted task's scorer may take; None: unchecked
        self.handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._refreshed = 0.0

    # ------------------------------------------------------------------ registration (gRPC thread)
    def register(self, spec: registry_pb2.EnvironmentSpec) -> tuple[registry_pb2.EnvironmentSpec, bool]:
        """Validate, check the backend answers, store for every replica; (the stored spec, created?)."""
        spec = validate_spec(spec, self.group_size, self.scorers)
        env = self._make_env(spec, self.max_message_bytes)
        try:
            problem = env.health_problem(HEALTH_TIMEOUT_S)
            if problem is not None:
                problem = problem or (
                    f"nothing at endpoint {spec.endpoint!r} answered gRPC health checks within "
                    f"{HEALTH_TIMEOUT_S:g}s (is a vcpo.v1.Environment server listening there?)"
                )
                raise Unreachable(f"environment {spec.name!r}: {problem}")
        finally:
            env.shutdown()
        pipe = self.client.pipeline()
        pipe.hset(self.key, spec.name, spec.SerializeToString())
        pipe.hdel(self.draining_key, spec.name)  # registering a draining environment makes it active again
        created = bool(pipe.execute()[0])
        log.info("environment %s %s: %s", spec.name, "registered" if created else "updated", _describe(spec))
        self.refresh(force=True)
        return spec, created

    # ------------------------------------------------------------------ unregistering (gRPC thread)
    def unregister(self, name: str) -> tuple[str, int]:
        """Stop accepting tasks for ``name`` and remove it once its admitted tasks are done; (state,
        outstanding). KeyError if it is not registered."""
        if not self.client.hexists(self.key, name):
            raise KeyError(name)
        self.client.hset(self.draining_key, name, str(time.time()))
        outstanding = self.outstanding(name)
        log.info("environment %s unregistered: draining %d outstanding task(s)", name, outstanding)
        removed = name in self.finish_drains()
        return ("removed" if removed else "draining"), outstanding

    def draining(self) -> set[str]:
        """The environments that take no more tasks and are finishing the ones they admitted."""
        raw: Any = self.client.hkeys(self.draining_key)
        return {n.decode() for n in raw}

    def admitted(self, name: str, count: int) -> None:
        """``count`` submitted tasks of ``name`` are on the tasks stream."""
        self.client.hincrby(self.stats_key, f"{name}:admitted", count)

    def settled(self, name: str) -> None:
        """A submitted task of ``name`` is done: its group is on the rollouts stream, or it was dead-lettered."""
        self.client.hincrby(self.stats_key, f"{name}:settled", 1)

    def outstanding(self, name: str) -> int:
        admitted, settled = self.client.hmget(self.stats_key, f"{name}:admitted", f"{name}:settled")
        return max(0, int(admitted or 0) - int(settled or 0))

    def finish_drains(self) -> set[str]:
        """Remove the draining environments with nothing outstanding; their names."""
        removed = set()
        for name in self.draining():
            if self.outstanding(name) == 0:
                pipe = self.client.pipeline()
                pipe.hdel(self.key, name)
                pipe.hdel(self.draining_key, name)
                if pipe.execute()[0]:
                    log.info("environment %s drained: its registration is removed", name)
                removed.add(name)
        return removed

    def specs(self) -> list[registry_pb2.EnvironmentSpec]:
        out = []
        raw: Any
        for _name, raw in sorted(self.client.hgetall(self.key).items()):
            spec = registry_pb2.EnvironmentSpec()
            spec.ParseFromString(raw)
            out.append(spec)
        return out

    def known(self, name: str) -> bool:
        return self.get(name) is not None

    # ------------------------------------------------------------------ the loop's view
    def get(self, name: str) -> Handle | None:
        """The environment's handle, re-reading the registrations if it is not known here yet."""
        handle = self.handles.get(name)
        if handle is None:
            self.refresh(force=True)
            handle = self.handles.get(name)
        return handle

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < self.refresh_s:
            return
        self._refreshed = now
        self.finish_drains()
        specs = {s.name: s for s in self.specs()}
        with self._lock:
            for name in [n for n, h in self.handles.items() if n not in specs and h.open_sessions == 0]:
                gone = self.handles.pop(name)  # unregistered and drained: nothing of it runs here
                for env in [gone.env, *gone.retired]:
                    env.shutdown()
            for name, spec in specs.items():
                handle = self.handles.get(name)
                if handle is not None and handle.spec == spec:
                    continue
                env = self._make_env(spec, self.max_message_bytes)
                if handle is None:
                    self.handles[name] = Handle(spec, env, make_parser(spec.tool_parser), self._breaker())
                else:  # updated: new episodes use the new backend; running ones finish on the old one
                    handle.retired.append(handle.env)
                    handle.spec, handle.env, handle.parser = spec, env, make_parser(spec.tool_parser)

    # ------------------------------------------------------------------ counters
    def completed(self, name: str, episodes: int) -> None:
        self.client.hincrby(self.stats_key, f"{name}:episodes_completed", episodes)

    def failed(self, handle: Handle, message: str) -> bool:
        """Count a failed group; True when it paused the environment here."""
        handle.last_error = message
        pipe = self.client.pipeline()
        pipe.hincrby(self.stats_key, f"{handle.name}:errors", 1)
        pipe.hset(self.stats_key, f"{handle.name}:last_error", message[:500])
        pipe.execute()
        opened = handle.breaker.failure()
        if opened:
            log.error(
                "environment %s paused for %.0fs after %d failed groups in a row: %s",
                handle.name,
                handle.breaker.cooldown_s,
                handle.breaker.failures,
                message,
            )
        return opened

    def publish_live(self) -> None:
        """This replica's running and queued figures and breaker states, for EnvironmentStatus anywhere."""
        live = {
            name: {
                "running": h.open_sessions,
                "queued": h.queued,
                "breaker": h.breaker.state,
                "paused_for_s": round(h.breaker.paused_for_s, 1),
            }
            for name, h in self.handles.items()
        }
        self.client.hset(self.live_key, self.replica_id, json.dumps({"time": time.time(), "envs": live}))

    def status(self, name: str) -> registry_pb2.EnvironmentStatusResponse | None:
        spec = next((s for s in self.specs() if s.name == name), None)
        if spec is None:
            return None
        raw_stats: Any = self.client.hgetall(self.stats_key)
        stats = {k.decode(): v.decode() for k, v in raw_stats.items()}
        running = queued = 0
        paused: list[str] = []
        raw_live: Any = self.client.hgetall(self.live_key)
        for replica, raw in raw_live.items():
            record: dict[str, Any] = json.loads(raw)
            if time.time() - record["time"] > REPLICA_FRESH_S:
                continue
            figures = record["envs"].get(name)
            if figures:
                running += figures["running"]
                queued += figures["queued"]
                if figures["breaker"] != "closed":
                    paused.append(f"{replica.decode()}: {figures['breaker']}")
        last_error = stats.get(f"{name}:last_error", "")
        if paused:
            last_error = f"paused by the circuit breaker ({', '.join(paused)}); last error: {last_error}"
        return registry_pb2.EnvironmentStatusResponse(
            spec=public(spec),
            state="draining" if self.client.hexists(self.draining_key, name) else "active",
            tasks_outstanding=self.outstanding(name),
            healthy=not paused,
            tasks_queued=queued,
            episodes_running=running,
            episodes_completed=int(stats.get(f"{name}:episodes_completed", 0)),
            errors=int(stats.get(f"{name}:errors", 0)),
            last_error=last_error,
        )

    def close(self) -> None:
        with self._lock:
            for handle in self.handles.values():
                for env in [handle.env, *handle.retired]:
                    env.shutdown()
            self.handles.clear()
        self.client.hdel(self.live_key, self.replica_id)


def _describe(spec: registry_pb2.EnvironmentSpec) -> str:
    backend = (
        f"endpoint {spec.endpoint}" if spec.WhichOneof("backend") == "endpoint" else f"builtin {spec.builtin}"
    )
    return (
        f"{backend}, parser {spec.tool_parser}, max_concurrency {spec.max_concurrency}, max_turns "
        f"{spec.max_turns}, timeouts reset {spec.reset_timeout_seconds:g}s step {spec.step_timeout_seconds:g}s"
    )
