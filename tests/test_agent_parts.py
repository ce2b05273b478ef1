"""The agent loop's parts on their own: tool parsers, the circuit breaker, spec validation, the registry in
Redis, weighted choice across environments in the task feed, and token authentication on a real gRPC server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from services.common.auth import TokenAuthInterceptor, bearer, resolve_api_token
from services.common.observability import grpc_server
from services.sampler.environments.base import Environment
from services.sampler.environments.parsers import make_parser
from services.sampler.environments.registry import (
    CircuitBreaker,
    EnvironmentRegistry,
    SpecError,
    validate_spec,
)
from services.sampler.feed import PreparedTask, TaskFeed
from vcpo.v1 import environment_pb2, registry_pb2, registry_pb2_grpc, rollout_pb2

# ---------------------------------------------------------------------------------------------- parsers


def test_fenced_code_parser_finds_a_complete_block_only() -> None:
    parser = make_parser("fenced_code")
    assert parser.find_call("Let me compute.\n```python\nprint(2 + 3)\n") is None  # not closed yet
    call = parser.find_call("Let me compute.\n```python\nprint(2 + 3)\n```\nand then")
    assert call is not None and call.tool_name == "python"
    assert json.loads(call.arguments_json) == {"code": "print(2 + 3)\n"}
    assert call.text == "Let me compute.\n```python\nprint(2 + 3)\n```"  # up to the end of the call
    assert parser.find_call("```\nnot python\n```") is None
    assert parser.format_observation("5") == "\n```output\n5\n```\n"


def test_json_parser_reads_hermes_tool_calls_and_passes_malformed_ones_on() -> None:
    parser = make_parser("json")
    text = 'ok <tool_call>{"name": "calculator", "arguments": {"expression": "2*7"}}</tool_call>'
    call = parser.find_call(text)
    assert call is not None and call.tool_name == "calculator"
    assert json.loads(call.arguments_json) == {"expression": "2*7"}
    string_args = parser.find_call('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert string_args is not None and json.loads(string_args.arguments_json) == {"x": 1}
    broken = parser.find_call("<tool_call>{not json</tool_call>")
    assert broken is not None and broken.tool_name == "" and broken.text.endswith("</tool_call>")
    assert parser.find_call("<tool_call>{") is None
    assert "<tool_response>" in parser.format_observation("14")


def test_turn_parser_makes_every_turn_an_action_and_unknown_parsers_are_named() -> None:
    parser = make_parser("turn")
    assert parser.every_turn_is_an_action and parser.find_call("anything") is None
    with pytest.raises(ValueError, match=r"unknown tool_parser 'xml'.*'fenced_code', 'json', 'turn'"):
        make_parser("xml")


# ---------------------------------------------------------------------------------------------- breaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_circuit_breaker_opens_after_failures_in_a_row_and_lets_one_trial_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures_to_open=3, cooldown_s=10, max_cooldown_s=25, clock=clock)
    assert breaker.allow()
    assert not breaker.failure() and not breaker.failure()
    breaker.success()  # a success in between resets the count
    assert not breaker.failure() and not breaker.failure()
    assert breaker.failure() and breaker.state == "open" and not breaker.allow()
    clock.now = 9.9
    assert not breaker.allow() and breaker.paused_for_s == pytest.approx(0.1)
    clock.now = 10.0
    assert breaker.allow() and breaker.state == "half_open"
    breaker.started()
    assert not breaker.allow()  # one trial at a time
    assert breaker.failure() and breaker.state == "open" and breaker.cooldown_s == 20  # doubled
    clock.now = 30.0
    assert breaker.allow()
    breaker.started()
    assert breaker.failure() and breaker.cooldown_s == 25  # capped
    clock.now = 55.0
    assert breaker.allow()
    breaker.started()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.cooldown_s == 10


# ---------------------------------------------------------------------------------------------- specs


def spec(**fields: Any) -> registry_pb2.EnvironmentSpec:
    return registry_pb2.EnvironmentSpec(**{"name": "calc", "builtin": "python", **fields})


def test_validate_spec_fills_defaults() -> None:
    out = validate_spec(spec(), group_size=4)
    assert (out.max_concurrency, out.max_turns, out.tool_parser, out.weight) == (16, 8, "fenced_code", 1.0)
    assert (out.reset_timeout_seconds, out.step_timeout_seconds) == (30.0, 60.0)
    kept = validate_spec(spec(max_concurrency=4, step_timeout_seconds=2.5, tool_parser="json"), group_size=4)
    assert (kept.max_concurrency, kept.step_timeout_seconds, kept.tool_parser) == (4, 2.5, "json")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": ""}, r"name '': 1-64 letters"),
        ({"name": "a b"}, r"name 'a b'"),
        ({"builtin": "bash"}, r"unknown builtin 'bash'; one of \['python'\]"),
        ({"endpoint": "nohost"}, r"bad endpoint"),
        ({"max_concurrency": 3}, r"max_concurrency 3 is below the group size n = 4"),
        ({"step_timeout_seconds": -1}, r"step_timeout_seconds must be a positive number of seconds, got -1"),
        ({"weight": -0.5}, r"weight must be >= 0, got -0.5"),
        ({"tool_parser": "xml"}, r"unknown tool_parser 'xml'"),
        ({"scorer": "mth"}, r"unknown scorer 'mth'; registered scorers: environment, math"),
    ],
)
def test_validate_spec_names_what_is_wrong(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec(spec(**fields), group_size=4, scorers={"math", "environment"})


def test_a_spec_without_a_backend_is_refused() -> None:
    with pytest.raises(SpecError, match=r"give an endpoint \(host:port\) or a builtin"):
        validate_spec(registry_pb2.EnvironmentSpec(name="x"), group_size=1)


class NullEnvironment(Environment):
    def __init__(self, name: str, healthy: bool = True) -> None:
        self.name, self._healthy, self.shut = name, healthy, False

    def reset(self, session_id: str, task: rollout_pb2.Task, timeout_s: float) -> Any:
        return environment_pb2.ResetResponse()

    def step(self, session_id: str, action: environment_pb2.Action, timeout_s: float) -> Any:
        return environment_pb2.StepResponse(done=True)

    def close(self, session_id: str, timeout_s: float) -> None:
        pass

    def healthy(self, timeout_s: float) -> bool:
        return self._healthy

    def shutdown(self) -> None:
        self.shut = True


def test_registry_shares_specs_through_redis_and_counts_for_every_replica(redis_client: redis.Redis) -> None:
    made: list[NullEnvironment] = []

    def make(s: registry_pb2.EnvironmentSpec, max_bytes: int) -> Environment:
        made.append(NullEnvironment(s.name, healthy=s.endpoint != "127.0.0.1:1"))
        return made[-1]

    one = EnvironmentRegistry(redis_client, "t", "sampler-0", 4, make_env=make)
    two = EnvironmentRegistry(redis_client, "t", "sampler-1", 4, make_env=make)
    stored, created = one.register(spec(name="calc", endpoint="127.0.0.1:5000", weight=2))
    assert created and stored.max_concurrency == 16 and made[0].shut  # the health-check client is closed
    assert not one.register(spec(name="calc", endpoint="127.0.0.1:5000", weight=3))[1]  # an update
    assert two.known("calc") and two.get("calc").spec.weight == 3  # type: ignore[union-attr]
    assert not two.known("other")
    with pytest.raises(SpecError, match=r"nothing at endpoint '127.0.0.1:1' answered gRPC health checks"):
        one.register(spec(name="down", endpoint="127.0.0.1:1"))
    assert [s.name for s in two.specs()] == ["calc"]

    handle = two.get("calc")
    assert handle is not None and handle.can_start(4)
    handle.open_sessions, handle.queued = 13, 5
    assert not handle.can_start(4)  # 13 + 4 > 16
    two.completed("calc", 4)
    one.completed("calc", 4)
    assert not two.failed(handle, "environment 'calc': timeout: step did not return within 1s")
    two.publish_live()
    status = one.status("calc")
    assert status is not None
    assert (status.episodes_completed, status.errors, status.episodes_running, status.tasks_queued) == (
        8,
        1,
        13,
        5,
    )
    assert status.healthy and "timeout" in status.last_error
    two.failed(handle, "boom")
    two.failed(handle, "boom again")  # the third in a row: paused here
    two.publish_live()
    paused = one.status("calc")
    assert paused is not None and not paused.healthy
    assert (
        "paused by the circuit breaker (sampler-1: open)" in paused.last_error
        and "boom again" in paused.last_error
    )
    assert one.status("nope") is None
    two.close()
    assert one.status("calc").healthy  # type: ignore[union-attr]  # the closed replica no longer counts


def test_an_unregistered_environment_drains_its_admitted_tasks_then_is_removed_everywhere(
    redis_client: redis.Redis,
) -> None:
    made: list[NullEnvironment] = []

    def make(s: registry_pb2.EnvironmentSpec, max_bytes: int) -> Environment:
        made.append(NullEnvironment(s.name))
        return made[-1]

    one = EnvironmentRegistry(redis_client, "drain", "sampler-0", 2, make_env=make)
    two = EnvironmentRegistry(redis_client, "drain", "sampler-1", 2, make_env=make)
    one.register(spec(name="game", endpoint="127.0.0.1:5000"))
    assert two.known("game")
    with pytest.raises(KeyError):
        one.unregister("nope")
    one.admitted("game", 3)
    assert one.unregister("game") == ("draining", 3)
    status = two.status("game")
    assert status is not None and (status.state, status.tasks_outstanding) == ("draining", 3)
    assert one.draining() == {"game"}
    one.settled("game")
    two.settled("game")
    two.refresh(force=True)
    assert two.known("game") and two.status("game").state == "draining"  # type: ignore[union-attr]
    one.settled("game")  # the last admitted task is done: the next refresh anywhere removes it
    two.refresh(force=True)
    assert two.status("game") is None and "game" not in two.handles and one.draining() == set()
    one.refresh(force=True)
    assert "game" not in one.handles and all(env.shut for env in made)
    # registered again, it is active; a drain with nothing outstanding removes it at once
    one.register(spec(name="game", endpoint="127.0.0.1:5000"))
    assert one.status("game").state == "active"  # type: ignore[union-attr]
    assert one.unregister("game") == ("removed", 0) and one.status("game") is None


# ---------------------------------------------------------------------------------------------- feed


class Encoder:
    max_model_len, max_tokens = 256, 16

    def encode(self, task: rollout_pb2.Task, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    def response_budget(self, prompt_len: int) -> int:
        return 16


class Stream:
    reclaim_idle_ms = 60_000

    def __init__(self, tasks: list[rollout_pb2.Task]) -> None:
        self.tasks, self.rejected, self.acked = list(tasks), [], []  # type: ignore[var-annotated]

    def read(self, count: int = 1, block_ms: int | None = None) -> list[Any]:
        from services.common.streams.specs import Entry

        out, self.tasks = self.tasks[:count], self.tasks[count:]
        return [Entry(f"{i}-{t.task_id}", 0, t) for i, t in enumerate(out)]

    def reclaim(self, count: int = 100) -> list[Any]:
        return []

    def touch(self, ids: Any) -> list[str]:
        return list(ids)

    def ack(self, ids: Any) -> int:
        self.acked += ids
        return len(ids)

    def reject(self, entry: Any, kind: str, reason: str) -> None:
        self.rejected.append((entry.message.task_id, kind, reason))


def feed_of(tasks: list[rollout_pb2.Task], weights: dict[str, float], **kw: Any) -> tuple[TaskFeed, Stream]:
    stream = Stream(tasks)
    feed = TaskFeed(
        Encoder(),
        None,
        stream,
        environment_known=lambda n: n in weights,  # type: ignore[arg-type]
        weight=weights.__getitem__,
        **kw,
    )
    return feed, stream


def test_feed_shares_tasks_across_environments_by_weight_and_holds_back_what_cannot_start() -> None:
    tasks = [
        rollout_pb2.Task(task_id=f"{env}{i}", prompt="p", environment=env)
        for i in range(40)
        for env in ("a", "b")
    ]
    feed, _ = feed_of(tasks, {"a": 3.0, "b": 1.0})
    picked = [feed.next().task.environment for _ in range(40)]  # type: ignore[union-attr]
    assert picked.count("a") == 30 and picked.count("b") == 10  # 3 : 1
    paused = {"a"}
    others = [feed.next(lambda t: t.environment not in paused) for _ in range(5)]
    assert [p.task.environment for p in others if p] == ["b"] * 5  # a paused: b goes on alone
    assert feed.waiting_count("a") > 0


def test_feed_dead_letters_a_task_its_environment_failed_too_often() -> None:
    feed, stream = feed_of(
        [rollout_pb2.Task(task_id="t", prompt="p", environment="a")], {"a": 1.0}, max_attempts=2
    )
    prepared = feed.next()
    assert isinstance(prepared, PreparedTask)
    feed.retry(prepared, "environment 'a': timeout: step did not return within 1s")
    again = feed.next()
    assert again is prepared
    feed.retry(prepared, "environment 'a': error: boom")
    assert feed.next() is None
    assert stream.rejected == [
        (
            "t",
            "environment_failed",
            "task 't': its environment 'a' failed it 2 times; last: environment 'a': error: boom",
        )
    ]
    assert feed.errors == {"environment_failed": 1}


def test_feed_refuses_unknown_environments_and_bad_payloads() -> None:
    feed, stream = feed_of(
        [
            rollout_pb2.Task(task_id="u", prompt="p", environment="nope"),
            rollout_pb2.Task(task_id="j", prompt="p", environment="a", payload_json="{oops"),
        ],
        {"a": 1.0},
    )
    assert feed.next() is None
    kinds = [(task_id, kind) for task_id, kind, _ in stream.rejected]
    assert kinds == [("u", "unknown_environment"), ("j", "bad_payload")]


# ---------------------------------------------------------------------------------------------- auth


class Registry(registry_pb2_grpc.EnvironmentRegistryServicer):
    def ListEnvironments(self, request: Any, context: Any) -> registry_pb2.ListEnvironmentsResponse:
        return registry_pb2.ListEnvironmentsResponse(environments=[registry_pb2.EnvironmentSpec(name="x")])

    def SubmitTasks(self, requests: Iterator[Any], context: Any) -> registry_pb2.SubmitTasksResponse:
        return registry_pb2.SubmitTasksResponse(accepted=sum(1 for _ in requests))


def test_token_auth_refuses_calls_without_the_token(tmp_path: Path) -> None:
    token, source = resolve_api_token("", "", tmp_path)
    assert source == str(tmp_path / "api_token") and len(token) >= 32
    assert (tmp_path / "api_token").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "api_token").read_text() == token  # no trailing newline: a client may read it whole
    assert resolve_api_token("", "", tmp_path) == (token, source)  # every replica reads the same one
    assert resolve_api_token("given", "", tmp_path) == ("given", "configuration")
    (tmp_path / "mine").write_text("written-by-hand\n")  # a file a person wrote, newline and all
    assert resolve_api_token("", str(tmp_path / "mine"), tmp_path) == (
        "written-by-hand",
        str(tmp_path / "mine"),
    )
    refused: list[str] = []

    def add(server: grpc.Server) -> list[str]:
        registry_pb2_grpc.add_EnvironmentRegistryServicer_to_server(Registry(), server)
        return ["vcpo.v1.EnvironmentRegistry"]

    server = grpc_server(
        add, interceptors=[TokenAuthInterceptor(token, {"vcpo.v1.EnvironmentRegistry"}, refused.append)]
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = registry_pb2_grpc.EnvironmentRegistryStub(channel)
            request = registry_pb2.ListEnvironmentsRequest()
            assert [e.name for e in stub.ListEnvironments(request, metadata=bearer(token)).environments] == [
                "x"
            ]
            for metadata, why in ((None, "no authorization metadata"), (bearer("wrong"), "a wrong token")):
                with pytest.raises(grpc.RpcError) as info:
                    stub.ListEnvironments(request, metadata=metadata, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert why in info.value.details() and "authorization: Bearer <token>" in info.value.details()
            tasks = [registry_pb2.SubmitTasksRequest() for _ in range(3)]
            assert stub.SubmitTasks(iter(tasks), metadata=bearer(token)).accepted == 3
            with pytest.raises(grpc.RpcError) as info:  # a client stream is refused as cleanly
                stub.SubmitTasks(iter(tasks), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = grpc.insecure_channel(f"127.0.0.1:{server.port}")
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            reply = health_pb2_grpc.HealthStub(health).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            health.close()
    finally:
        server.stop(0)
    assert len(refused) == 3 and refused[0] == "/vcpo.v1.EnvironmentRegistry/ListEnvironments"
    with pytest.raises(ValueError, match="empty API token"):
        TokenAuthInterceptor("", {"x"})
