"""Environments on their own: the gRPC client against servers in other processes, the built-in Python
interpreter, the example calculator, and the agent loop's SimpleTIR turn (code block → sandbox → output)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.common.prompts import PromptEncoder
from services.sampler.agent import AgentLoop
from services.sampler.engine import Sampling, TokenDelta
from services.sampler.environments.base import EnvironmentFailure
from services.sampler.environments.grpc_env import GrpcEnvironment, parse_endpoint
from services.sampler.environments.parsers import make_parser
from services.sampler.environments.python_env import PythonEnvironment
from services.sampler.environments.registry import EnvironmentRegistry
from services.sampler.groups import Group
from vcpo.v1 import environment_pb2, environment_pb2_grpc, registry_pb2, rollout_pb2

ROOT = Path(__file__).resolve().parent.parent


def serve(*command: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening on "), line
    return proc, line.split()[-1]


@pytest.fixture
def servers() -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(*command: str) -> str:
        proc, endpoint = serve(*command)
        started.append(proc)
        return endpoint

    yield start
    for proc in started:  # only the processes this test started
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def action(text: str = "move", tool: str = "", arguments: str = "") -> environment_pb2.Action:
    return environment_pb2.Action(text=text, tool_name=tool, arguments_json=arguments)


def test_parse_endpoint() -> None:
    assert parse_endpoint("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_endpoint("[::1]:7") == ("[::1]", 7)
    for bad, why in (
        ("nohost", "not host:port"),
        (":80", "not host:port"),
        ("h:0", "1..65535"),
        ("h:x", "1..65535"),
        ("::1:80", "brackets"),
        ("http://127.0.0.1:50070", "without a scheme or a path"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_endpoint(bad)


def test_grpc_environment_round_trip_and_failures(servers: Any, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    env = GrpcEnvironment("s", servers("tests/envs/scripted_env.py", "--mode", "normal", "--log", str(log)))
    assert env.healthy(5)
    task = rollout_pb2.Task(task_id="t1", prompt="hi")
    assert env.reset("s1", task, 5).observation.text == ""
    first = env.step("s1", action("abc"), 5)
    assert (first.observation.text, first.reward, first.done) == ("obs 1: got 3 chars", 0.0, False)
    second = env.step("s1", action("abcd"), 5)
    assert (second.reward, second.done) == (1.0, True)
    env.close("s1", 5)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["method"] for c in calls] == ["reset", "step", "step", "close"] and calls[2]["action"] == "abcd"
    env.shutdown()  # after it, nothing touches the channel (a stub made on a closed one crashes the process)
    assert not env.healthy(1)
    with pytest.raises(EnvironmentFailure, match="shut down") as info:
        env.step("s1", action(), 5)
    assert info.value.reason == "unavailable"
    env.shutdown()

    hang = GrpcEnvironment("h", servers("tests/envs/scripted_env.py", "--mode", "hang"))
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFailure) as info:
        hang.step("s", action(), 1.0)
    assert info.value.reason == "timeout" and time.monotonic() - t0 < 3
    crash = GrpcEnvironment("c", servers("tests/envs/scripted_env.py", "--mode", "crash"))
    with pytest.raises(EnvironmentFailure) as info:
        crash.step("s", action(), 5)
    assert info.value.reason == "error" and "INTERNAL" in str(info.value)
    assert "RuntimeError: the scripted environment crashed" in str(info.value)
    die = GrpcEnvironment("d", servers("tests/envs/scripted_env.py", "--mode", "die"))
    with pytest.raises(EnvironmentFailure) as info:
        die.step("s", action(), 5)
    assert info.value.reason == "unavailable"  # the server went away mid-call
    assert not die.healthy(1) and not GrpcEnvironment("x", "127.0.0.1:1").healthy(1)


class _NoHealth(environment_pb2_grpc.EnvironmentServicer):
    """An environment server that serves vcpo.v1.Environment but not grpc.health.v1, and answers Step with
    an observation of the size asked for."""

    def Step(self, request: Any, context: Any) -> environment_pb2.StepResponse:
        size = int(request.action.text)
        return environment_pb2.StepResponse(observation=environment_pb2.Observation(text="x" * size))


def test_a_server_without_health_and_a_reply_over_the_limit_are_explained() -> None:
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    environment_pb2_grpc.add_EnvironmentServicer_to_server(_NoHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = GrpcEnvironment("bare", f"127.0.0.1:{port}", max_message_bytes=4096)
    try:
        problem = env.health_problem(5)
        assert problem is not None and not env.healthy(5)
        assert (
            f"the server at 127.0.0.1:{port} answered UNIMPLEMENTED to grpc.health.v1.Health/Check" in problem
        )
        assert "must serve grpc.health.v1.Health" in problem and "grpc-health-check in Node.js" in problem
        assert env.step("s", action("100"), 5).observation.text == "x" * 100
        with pytest.raises(EnvironmentFailure) as info:
            env.step("s", action("10000"), 5)
        assert "RESOURCE_EXHAUSTED" in str(info.value)
        assert "the limit is sampler.env_max_message_bytes = 4096 bytes" in str(info.value)
    finally:
        env.shutdown()
        server.stop(0)


def test_python_environment_runs_code_and_explains_bad_calls() -> None:
    env = PythonEnvironment("py", wall_seconds=2)
    reset = env.reset("s", rollout_pb2.Task(task_id="t"), 5)
    assert [t.name for t in reset.tools] == ["python"]
    assert json.loads(reset.tools[0].parameters_json_schema)["required"] == ["code"]
    ok = env.step("s", action(tool="python", arguments=json.dumps({"code": "print(2 + 3)"})), 10)
    assert ok.observation.text == "5" and ok.reward == 0.0 and not ok.done and ok.info["status"] == "ok"
    long = env.step(
        "s", action(tool="python", arguments=json.dumps({"code": "print('a' * 3000 + 'END')"})), 10
    )
    assert long.observation.text == "[... 1003 characters cut]\n" + "a" * 1997 + "END"  # the end is kept
    silent = env.step("s", action(tool="python", arguments=json.dumps({"code": "x = 2 + 3"})), 10)
    assert silent.observation.text == "(no output: print what you want to see)"
    boom = env.step("s", action(tool="python", arguments=json.dumps({"code": "1 / 0"})), 10)
    assert "ZeroDivisionError" in boom.observation.text and "[error" in boom.observation.text
    t0 = time.monotonic()
    loop = env.step("s", action(tool="python", arguments=json.dumps({"code": "while True: pass"})), 10)
    assert time.monotonic() - t0 < 4 and loop.info["status"] == "timeout"
    assert loop.observation.text == "[timeout: still running after 2s (wall clock)]"
    near = env.step("s", action(tool="python", arguments=json.dumps({"code": "while True: pass"})), 2)
    assert near.observation.text == "[timeout: still running after 1s (wall clock)]"  # inside the deadline
    for bad in (action(tool="bash", arguments="{}"), action(tool="python", arguments="{not json")):
        reply = env.step("s", bad, 10)
        assert 'call the "python" tool with arguments {"code": "<program>"}' in reply.observation.text
    env.close("s", 5)
    with pytest.raises(EnvironmentFailure, match="unknown session 's'"):
        env.step("s", action(tool="python", arguments='{"code": "print(1)"}'), 5)


def test_builtin_python_served_over_grpc_and_the_example_calculator(servers: Any) -> None:
    py = GrpcEnvironment("py", servers("-m", "services.sampler.environments.server", "--builtin", "python"))
    assert py.healthy(5)
    py.reset("a", rollout_pb2.Task(), 5)
    assert (
        py.step("a", action(tool="python", arguments='{"code": "print(6 * 7)"}'), 15).observation.text == "42"
    )
    calc = GrpcEnvironment("calc", servers("examples/calculator_env.py", "--port", "0", "--max-calls", "2"))
    assert calc.healthy(5)
    assert [t.name for t in calc.reset("b", rollout_pb2.Task(), 5).tools] == ["calculator"]
    first = calc.step("b", action(tool="calculator", arguments='{"expression": "2*(3+4)"}'), 5)
    assert (first.observation.text, first.done) == ("14", False)
    second = calc.step("b", action(tool="calculator", arguments='{"expression": "__import__(\'os\')"}'), 5)
    assert second.observation.text.startswith("error: not arithmetic") and second.done  # --max-calls 2


class ScriptedEngine:
    """Plays one scripted text per turn, a token per step, as an engine would (the logic under test is the
    agent loop's, not generation)."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer, self.turns = tokenizer, [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.active: dict[str, list[int]] = {}
        self.prompts: list[list[int]] = []

    def add(self, request_id: str, prompt_tokens: list[int], sampling: Sampling) -> None:
        self.prompts.append(list(prompt_tokens))
        self.active[request_id] = list(self.turns[len(self.prompts) - 1])

    def step(self) -> list[TokenDelta]:
        out = []
        for request_id, left in list(self.active.items()):
            token = left.pop(0)
            done = not left
            out.append(
                TokenDelta(request_id, [token], [-0.5], "", "stop" if done else None, detokenized=False)
            )
            if done:
                del self.active[request_id]
        return out

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.active.pop(request_id, None)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


def test_agent_loop_runs_a_simpletir_turn_through_the_sandbox(
    redis_client: redis.Redis, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    call_turn = "Let me check.\n```python\nprint(2 + 3)\n```"
    engine = ScriptedEngine(tokenizer, [call_turn + "\nnever reached", "So the answer is 5."])
    registry = EnvironmentRegistry(redis_client, "t", "sampler-0", 1)
    registry.register(registry_pb2.EnvironmentSpec(name="py", builtin="python", scorer="math"))
    handle = registry.get("py")
    assert handle is not None
    encoder = PromptEncoder(tokenizer, 512, 64)
    agent = AgentLoop(engine, registry, encoder)  # type: ignore[arg-type]
    task = rollout_pb2.Task(task_id="t", prompt="What is 2+3?", environment="py")
    group = Group("g", task, encoder.encode(task), 0, Sampling(max_tokens=64), 1, multi_turn=True)
    agent.start(group, handle)
    deadline = time.monotonic() + 30
    finished: list[Group] = []
    while not finished and time.monotonic() < deadline:
        finished, failed = agent.poll()
        assert not failed
        for delta in engine.step():
            if agent.owns(delta.request_id):
                agent.absorb(delta, 0)
        time.sleep(0.01)
    agent.close()
    assert finished == [group]
    response = next(iter(group.responses.values()))
    assert group.prompt_tokens == encoder.encode(
        task,
        [
            {
                "type": "function",
                "function": {
                    "name": "python",
                    "description": "Run a Python program (standard library only) and read what it prints.",
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string"}},
                        "required": ["code"],
                    },
                },
            }
        ],
    )
    text = tokenizer.decode(response.tokens, skip_special_tokens=True)
    assert text == call_turn + "\n```output\n5\n```\n" + "So the answer is 5."  # stopped right at the call
    observation = tokenizer.encode(
        make_parser("fenced_code").format_observation("5"), add_special_tokens=False
    )
    first = response.mask.index(False)
    assert response.tokens[first : first + len(observation)] == observation
    assert response.mask == [True] * first + [False] * len(observation) + [True] * (
        len(response.tokens) - first - len(observation)
    )
    assert response.logprobs[first : first + len(observation)] == [0.0] * len(observation)
    # the second turn continued from the exact ids: prompt + first turn + observation
    assert engine.prompts[1] == group.prompt_tokens + response.tokens[: first + len(observation)]
    proto = response.to_proto(engine.decode)
    assert (proto.num_turns, proto.finish_reason, proto.reward.value) == (2, "stop", 0.0)
