"""The Node.js example (examples/node/) speaks the protocol as the Python one does, from another language.

Its environment server is checked from Python through the sampler's own client (GrpcEnvironment): health,
Reset's tool schema (byte for byte the Python example's), Step's values (the same as the Python example's
``evaluate`` over a table of expressions), errors as observations, the episode ending past ``--max-calls``.
Then the whole route: the Node client registers the Node server with a real sampler (tests/sampler_stack.py,
on the session's vLLM engine) and submits tasks that come back as groups, as the Python example's test does.
``npm ci`` runs once per module, into examples/node/node_modules (ignored by examples/node/.gitignore).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.sampler.environments.base import EnvironmentFailure
from services.sampler.environments.grpc_env import GrpcEnvironment
from tests.sampler_stack import Stack, check_example_client
from tests.test_first_try import check_no_run
from tests.test_tls import _certificates
from vcpo.v1 import environment_pb2, rollout_pb2

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "examples" / "node"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm"
    ),
]

# Python's answer is the reference; every one of these is an integer, a float, or an error in both
EXPRESSIONS = [
    "17 * 23",
    "1234 + 4321",
    "2 ** 10",
    "99 * 99",
    "2 ** 100",
    "(2 ** 100) ** 10 // 3",
    "7 / 2",
    "4 / 2",
    "-7 // 2",
    "-7 % 3",
    "7 % -3",
    "7.5 // 2",
    "-7.5 % 2",
    "5.5 // -2",
    "0 / -5",
    "-2 ** 2",
    "2 ** -1",
    "2 ** 3 ** 2",
    "10 ** -5",
    "(2 ** 100) ** 3 / 7 ** 50",
    "1 / ((2 ** 100) ** 10 * 2 ** 74)",
    "0.1 + 0.2",
    "1e16",
    "1e15 * 1.0",
    "0.00001",
    "0.0001 * 1",
    "-0.0",
    "1e308 * 10",
    "1_000 + 0x1F + 0o17 + 0b11",
    "((((1))))",
    "+-+-1",
    "(1 +\n2)",
    "1 / 0",
    "1 // 0",
    "1 % 0",
    "1.0 / 0",
    "1.0 // 0",
    "1.0 % 0",
    "0 ** -1",
    "1e300 ** 2",
    "3 ** 101",
    "(2 ** 100) ** 41",
    "2 ** 4000 * 2 ** 100",
    "x + 1",
    "abs(1)",
    "1 if 1 else 2",
    "~1",
    "1j",
    "01",
    "2x",
    "",
    "   ",
    "1 2",
    "(1",
    "1)",
    "1 +\n2",
    "1" * 1001,
]


def python_example() -> Any:
    """examples/calculator_env.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("calculator_env", ROOT / "examples" / "calculator_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python_answer(module: Any, expression: str) -> str:
    try:
        return str(module.evaluate(expression))
    except (ValueError, KeyError, TypeError, SyntaxError, ArithmeticError, RecursionError) as exc:
        return f"error: {exc}"


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """examples/node's dependencies, installed once from its package-lock.json."""
    done = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return NODE_DIR / "node_modules"


class NodeEnv:
    """examples/node/calculator_env.js in a subprocess of ours (we kill only the PID we started)."""

    def __init__(self, max_calls: int) -> None:
        self.proc = subprocess.Popen(
            ["node", "calculator_env.js", "--port", "0", "--max-calls", str(max_calls)],
            cwd=NODE_DIR,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening on 127.0.0.1:"):
            self.stop()
            raise AssertionError(f"calculator_env.js did not start: {line!r}")
        self.endpoint = line.split()[-1]

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: it shuts down with a grace period
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def node_env(node_modules: Path) -> Iterator[Callable[..., NodeEnv]]:
    started: list[NodeEnv] = []

    def start(max_calls: int = 4) -> NodeEnv:
        started.append(NodeEnv(max_calls))
        return started[-1]

    yield start
    for env in started:
        env.stop()


def calculator(expression: str) -> environment_pb2.Action:
    return environment_pb2.Action(
        tool_name="calculator", arguments_json=json.dumps({"expression": expression})
    )


def test_the_node_environment_answers_the_protocol(node_env: Callable[..., NodeEnv]) -> None:
    server = node_env(max_calls=3)
    env = GrpcEnvironment("calculator", server.endpoint)
    try:
        assert env.health_problem(5) is None  # SERVING for vcpo.v1.Environment (and for the server)
        reply = env.reset("s1", rollout_pb2.Task(task_id="t", prompt="What is 17 * 23?"), 5)
        assert list(reply.tools) == [python_example().TOOL]  # the same name, description and schema text
        first = env.step("s1", calculator("17 * 23"), 5)
        assert (first.observation.text, first.done, first.reward) == ("391", False, 0.0)
        bad = env.step("s1", calculator("1 +"), 5)
        assert bad.observation.text.startswith("error: ") and not bad.done  # the model reads why
        last = env.step("s1", environment_pb2.Action(tool_name="abacus", arguments_json="{}"), 5)
        assert last.observation.text == "error: unknown tool 'abacus'; the tool is 'calculator'"
        assert last.done  # the third call of --max-calls 3 ends the episode
        with pytest.raises(EnvironmentFailure, match="NOT_FOUND: unknown session 'nobody'") as failure:
            env.step("nobody", calculator("1"), 5)
        assert failure.value.reason == "error"
        env.close("s1", 5)
        with pytest.raises(EnvironmentFailure, match="NOT_FOUND"):
            env.step("s1", calculator("1"), 5)  # closed: the session is gone
    finally:
        env.shutdown()


def test_the_node_calculator_computes_what_the_python_one_does(node_env: Callable[..., NodeEnv]) -> None:
    module = python_example()
    server = node_env(max_calls=len(EXPRESSIONS) + 1)
    env = GrpcEnvironment("calculator", server.endpoint)
    try:
        env.reset("s", rollout_pb2.Task(task_id="t"), 5)
        for expression in EXPRESSIONS:
            node = env.step("s", calculator(expression), 5).observation.text
            python = python_answer(module, expression)
            if python.startswith("error: "):
                assert node.startswith("error: "), (expression, python, node)
            else:
                assert node == python, expression
    finally:
        env.shutdown()


def submit_tasks(
    stack: Stack, token_file: Path, endpoint: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    """No --sampler: the client finds the sampler's free port from the run directory, and the run's own token
    there (--token-file only for another one)."""
    run_dir = Path(stack.run.run_dir)
    token = [] if token_file == run_dir / "api_token" else ["--token-file", str(token_file)]
    return subprocess.run(
        [
            "node",
            "submit_tasks.js",
            "--run-dir",
            str(run_dir),
            *token,
            "--env-endpoint",
            endpoint,
            *extra,
        ],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_node_client_registers_the_node_environment_and_its_tasks_run(
    make_stack: Callable[..., Stack], node_env: Callable[..., NodeEnv], tmp_path: Path
) -> None:
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2, max_tokens=8)
    server = node_env()
    check_example_client(
        stack, lambda token_file, *flags: submit_tasks(stack, token_file, server.endpoint, *flags), tmp_path
    )


def test_the_node_client_says_what_is_missing_when_its_run_is_not_up(
    node_modules: Path, tmp_path: Path
) -> None:
    check_no_run(["node", "submit_tasks.js"], NODE_DIR, tmp_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _certificates(tmp_path_factory.mktemp("pki"))


def test_the_node_client_reaches_a_sampler_whose_api_requires_client_certificates(
    make_stack: Callable[..., Stack], node_env: Callable[..., NodeEnv], pki: dict[str, str]
) -> None:
    """[sampler.api_tls] with client_ca_file on a real sampler: --tls-ca, --tls-cert and --tls-key register
    and submit; without the client certificate the handshake fails and nothing is registered."""
    tls = {
        "cert_file": pki["server"] + ".pem",
        "key_file": pki["server"] + ".key",
        "client_ca_file": pki["ca"] + ".pem",
    }
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2, max_tokens=8, api_tls=tls)
    server = node_env()
    token_file = Path(stack.run.run_dir) / "api_token"
    ca = ("--tls-ca", pki["ca"] + ".pem")
    client = ("--tls-cert", pki["client"] + ".pem", "--tls-key", pki["client"] + ".key")
    secured = submit_tasks(stack, token_file, server.endpoint, "--tasks", "2", "--watch-s", "0", *ca, *client)
    assert secured.returncode == 0, secured.stderr
    assert "submitted: 2 accepted, 0 rejected" in secured.stdout
    anonymous = submit_tasks(stack, token_file, server.endpoint, "--env-name", "other", "--watch-s", "0", *ca)
    assert anonymous.returncode == 1 and "registration refused: UNAVAILABLE" in anonymous.stderr
