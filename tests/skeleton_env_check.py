"""The checks the Go and TypeScript skeleton environments (examples/go, examples/typescript) both pass.

Each skeleton is a `guess` game: the task hides a whole number (payload_json {"target": n}, else one from its
task_id), each call answers "higher", "lower" or "correct", a correct guess ends the episode with reward 1 and
the --max-calls-th guess ends it with reward 0. They are driven here through the sampler's own client, made from
a registration as the registry makes it (services/sampler/environments/registry.make_environment): health, the
tool schema, the game, errors as observations, sessions side by side, Close of an unknown session, a bearer
token and TLS. The server is a subprocess of ours; only its PID is ever stopped.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from services.common.tls import ClientTls
from services.sampler.environments.base import Environment, EnvironmentFailure
from services.sampler.environments.registry import make_environment
from vcpo.v1 import environment_pb2, registry_pb2, rollout_pb2

MAX_CALLS = 4


@contextmanager
def serving(command: list[str], cwd: Path, *flags: str) -> Iterator[str]:
    """Run a skeleton server with ``flags`` (and --port 0); yield its endpoint from its "listening on" line."""
    # stderr to a file, not a pipe: what the server logs never blocks it
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            [*command, "--port", "0", "--max-calls", str(MAX_CALLS), *flags],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("listening on 127.0.0.1:"):
                proc.kill()
                proc.wait(10)
                errors.seek(0)
                raise AssertionError(f"{command} did not start: {line!r} {errors.read()}")
            yield line.split()[-1]
        finally:
            proc.terminate()  # SIGTERM: a graceful stop of at most 2 s
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


def client(endpoint: str, token: str = "", ca_file: str = "") -> Environment:
    spec = registry_pb2.EnvironmentSpec(name="guess", endpoint=endpoint, tls=bool(ca_file), auth_token=token)
    return make_environment(spec, 4 << 20, tls=ClientTls(ca_file=ca_file) if ca_file else None)


def guess(number: object, tool: str = "guess") -> environment_pb2.Action:
    return environment_pb2.Action(tool_name=tool, arguments_json=json.dumps({"number": number}))


def task(task_id: str, target: int | None = None) -> rollout_pb2.Task:
    payload = json.dumps({"target": target}) if target is not None else ""
    return rollout_pb2.Task(task_id=task_id, prompt="Guess my number.", payload_json=payload)


def check_the_game(endpoint: str) -> None:
    env = client(endpoint)
    try:
        assert env.health_problem(5) is None  # SERVING for vcpo.v1.Environment
        reply = env.reset("g/0", task("t1", target=37), 5)
        assert [t.name for t in reply.tools] == ["guess"]
        schema = json.loads(reply.tools[0].parameters_json_schema)
        assert schema["properties"]["number"]["type"] == "integer" and schema["required"] == ["number"]
        env.reset("g/1", task("t1", target=80), 5)  # a second session at once: its own target
        answers = [
            (env.step("g/0", guess(50), 5), "lower"),
            (env.step("g/1", guess(50), 5), "higher"),
            (env.step("g/0", guess(1, tool="abacus"), 5), 'error: unknown tool "abacus"'),
            (env.step("g/0", environment_pb2.Action(text="<tool_call>{oops</tool_call>"), 5), "error: "),
        ]
        for step, expected in answers:
            assert step.observation.text.startswith(expected), (step, expected)
            assert (step.done, step.reward) == (False, 0.0)
        bad = env.step("g/1", environment_pb2.Action(tool_name="guess", arguments_json='{"number": "x"}'), 5)
        assert bad.observation.text.startswith("error: the arguments") and not bad.done
        right = env.step("g/0", guess(37), 5)
        assert (right.observation.text, right.done, right.reward) == ("correct", True, 1.0)
        for _ in range(MAX_CALLS - 2):  # g/1 has made 2 calls: the 4th ends the episode unsolved
            last = env.step("g/1", guess(1), 5)
        assert (last.observation.text, last.done, last.reward) == ("higher", True, 0.0)
        with pytest.raises(EnvironmentFailure, match='NOT_FOUND: unknown session "nobody"'):
            env.step("nobody", guess(1), 5)
        for session in ("g/0", "g/1", "never-reset"):
            env.close(session, 5)  # an unknown session closes without an error
        with pytest.raises(EnvironmentFailure, match="NOT_FOUND"):
            env.step("g/0", guess(1), 5)  # closed: gone
        without_payload = env.reset("g/2", task("t2"), 5)  # a target from the task id, 1 to 100
        assert [t.name for t in without_payload.tools] == ["guess"]
        with pytest.raises(EnvironmentFailure, match="INVALID_ARGUMENT"):
            env.reset("g/3", rollout_pb2.Task(task_id="t3", payload_json='{"goal": 1}'), 5)
    finally:
        env.shutdown()


def check_the_token(endpoint: str, token: str) -> None:
    anonymous, wrong, right = client(endpoint), client(endpoint, "guess-what"), client(endpoint, token)
    try:
        assert anonymous.health_problem(5) is None  # health needs no token
        for refused in (anonymous, wrong):
            with pytest.raises(EnvironmentFailure, match="UNAUTHENTICATED"):
                refused.reset("a/0", task("t", 5), 5)
        right.reset("a/0", task("t", 5), 5)
        assert right.step("a/0", guess(5), 5).observation.text == "correct"
    finally:
        for env in (anonymous, wrong, right):
            env.shutdown()


def check_tls(endpoint: str, ca_file: str) -> None:
    trusting, plain = client(endpoint, ca_file=ca_file), client(endpoint)
    try:
        assert trusting.health_problem(5) is None
        trusting.reset("tls/0", task("t", 9), 5)
        assert trusting.step("tls/0", guess(9), 5).observation.text == "correct"
        assert plain.health_problem(2) is not None  # plaintext reaches nothing
    finally:
        trusting.shutdown()
        plain.shutdown()


def check_skeleton(
    start: Callable[..., AbstractContextManager[str]], tmp_path: Path, pki: dict[str, str]
) -> None:
    """All three checks against ``start(*flags)``, a context manager yielding the endpoint (see serving)."""
    with start() as endpoint:
        check_the_game(endpoint)
    token_file = tmp_path / "env_token"
    token_file.write_text("s3cret\n")  # a trailing newline, as editors leave it
    with start("--token-file", str(token_file)) as endpoint:
        check_the_token(endpoint, "s3cret")
    tls = ("--tls-cert", pki["server"] + ".pem", "--tls-key", pki["server"] + ".key")
    with start(*tls) as endpoint:
        check_tls(endpoint, pki["ca"] + ".pem")
