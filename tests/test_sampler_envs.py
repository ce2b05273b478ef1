"""Multi-turn episodes with the real vLLM engine against environments served from separate processes.

The environment is ``tests/envs/scripted_env.py`` (a real gRPC server in its own process); the sampler is the
real service on the session's engine (tests/sampler_stack.py), with Redis and a weight broker. Checked: the
registry API (and its token), the episode's tokens, masks and behaviour log-probs against the Hugging Face
forward pass, and that a hanging or crashing environment fails only its own groups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.auth import bearer
from services.sampler.environments.parsers import make_parser
from tests.sampler_helpers import assert_logprobs_match, hf_model, version_weights
from tests.sampler_stack import Stack, check_example_client, rollouts, wait_until
from vcpo.v1 import registry_pb2, rollout_pb2

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


class EnvProcess:
    """tests/envs/scripted_env.py in a subprocess of ours (we kill only the PID we started)."""

    def __init__(self, mode: str, log: Path, steps: int = 2) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "envs" / "scripted_env.py"),
                "--port",
                "0",
                "--mode",
                mode,
                "--steps",
                str(steps),
                "--log",
                str(log),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), line
        self.endpoint = line.split()[-1]

    def calls(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def env_process(tmp_path: Path) -> Iterator[Callable[..., EnvProcess]]:
    started: list[EnvProcess] = []

    def start(mode: str = "normal", steps: int = 2) -> EnvProcess:
        started.append(EnvProcess(mode, tmp_path / f"env-{len(started)}.jsonl", steps))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def register(stack: Stack, **fields: Any) -> registry_pb2.RegisterEnvironmentResponse:
    spec = registry_pb2.EnvironmentSpec(**fields)
    request = registry_pb2.RegisterEnvironmentRequest(spec=spec)
    return stack.registry().RegisterEnvironment(request, timeout=15, metadata=stack.auth)


def submit(stack: Stack, environment: str, count: int, prefix: str) -> registry_pb2.SubmitTasksResponse:
    tasks = [rollout_pb2.Task(task_id=f"{prefix}{i}", prompt=f"Play round {i}.") for i in range(count)]
    requests = iter(registry_pb2.SubmitTasksRequest(environment=environment, task=t) for t in tasks)
    return stack.registry().SubmitTasks(requests, timeout=15, metadata=stack.auth)


def episode_calls(calls: list[dict[str, Any]], session: str) -> list[dict[str, Any]]:
    """The session's step calls, after checking it was a whole two-step episode: reset, step, step, close."""
    mine = [c for c in calls if c["session_id"] == session]
    assert [c["method"] for c in mine] == ["reset", "step", "step", "close"], session
    return [c for c in mine if c["method"] == "step"]


def full_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """Log-prob of every response token given everything before it, in one forward pass."""
    import torch

    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()


def test_multi_turn_episodes_line_up_token_for_token(
    make_stack: Callable[..., Stack], env_process: Callable[..., EnvProcess]
) -> None:
    env = env_process("normal", steps=2)
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2, max_tokens=12)
    reply = register(
        stack,
        name="game",
        endpoint=env.endpoint,
        tool_parser="turn",
        max_turns=4,
        scorer="environment",
        step_timeout_seconds=10,
    )
    assert reply.name == "game" and reply.created
    listed = stack.registry().ListEnvironments(registry_pb2.ListEnvironmentsRequest(), metadata=stack.auth)
    assert [(e.name, e.max_concurrency, e.endpoint) for e in listed.environments] == [
        ("game", 8, env.endpoint)
    ]
    accepted = submit(stack, "game", 2, "round")
    assert (accepted.accepted, accepted.rejected) == (2, 0)
    stack.learner.publish(0)
    stack.start()
    groups = wait_until(lambda: len(g := rollouts(stack)) >= 2 and g, what="2 multi-turn groups")

    model = hf_model(stack.model_dir, version_weights(stack.model_dir, 0))
    tokenizer = stack.service.engine.tokenizer
    parser = make_parser("turn")
    calls = env.calls()
    for group in groups:
        assert group.task.environment == "game" and group.task.scorer == "environment"
        assert group.policy_version_start == 0 and len(group.trajectories) == 2
        for i, traj in enumerate(group.trajectories):
            session = f"{group.group_id}/{i}"
            steps = episode_calls(calls, session)
            assert traj.num_turns == 2 and traj.finish_reason == "stop"  # the env said done at its 2nd step
            assert traj.reward.value == 1.0 and traj.reward.scorer == "environment"
            tokens, mask = list(traj.response_tokens), list(traj.loss_mask)
            assert len(tokens) == len(mask) == len(traj.behaviour_logprobs)
            # generated turn, observation, generated turn: the observation is exactly what the env said,
            # tokenized as the model was given it, and masked out of the loss
            first = mask.index(False)
            obs_end = mask.index(True, first)
            assert all(mask[:first]) and not any(mask[first:obs_end]) and all(mask[obs_end:])
            observation = parser.format_observation(steps[0]["observation"])
            assert tokens[first:obs_end] == tokenizer.encode(observation, add_special_tokens=False)
            assert all(lp == 0.0 for lp in traj.behaviour_logprobs[first:obs_end])
            # the env saw each turn's text as the model wrote it
            assert steps[0]["action"] == tokenizer.decode(tokens[:first], skip_special_tokens=True)
            assert steps[1]["action"] == tokenizer.decode(tokens[obs_end:], skip_special_tokens=True)
            # behaviour log-probs of every generated token, on the whole episode as one sequence
            expected = full_logprobs(model, list(group.prompt_tokens), tokens)
            generated = [j for j, m in enumerate(mask) if m]
            assert_logprobs_match(
                [traj.behaviour_logprobs[j] for j in generated], [expected[j] for j in generated]
            )
    status = stack.registry().EnvironmentStatus(
        registry_pb2.EnvironmentStatusRequest(name="game"), metadata=stack.auth
    )
    assert status.healthy and status.episodes_completed >= 4 and status.errors == 0
    metrics = stack.service.registry.exposition().decode()
    assert 'vcpo_sampler_env_episodes_total{environment="game",replica="sampler-0"}' in metrics


def test_the_last_turn_within_max_turns_reaches_the_environment(
    make_stack: Callable[..., Stack], env_process: Callable[..., EnvProcess]
) -> None:
    """max_turns = 2 against an environment that would end an episode only at its 3rd step: both of the
    model's turns reach Step (the environment judges the last one too), the 2nd step's observation is not
    shown to the model, and the episode ends as tool_budget."""
    env = env_process("normal", steps=3)
    stack = make_stack(k=4, groups_per_step=1, dataset="", n=2, max_tokens=12)
    register(
        stack,
        name="judged",
        endpoint=env.endpoint,
        tool_parser="turn",
        max_turns=2,
        scorer="environment",
        step_timeout_seconds=10,
    )
    assert submit(stack, "judged", 1, "last").accepted == 1
    stack.learner.publish(0)
    stack.start()
    (group,) = wait_until(lambda: rollouts(stack), what="the group")
    sessions = [f"{group.group_id}/{i}" for i in range(len(group.trajectories))]
    closes = lambda: {c["session_id"] for c in env.calls() if c["method"] == "close"}  # noqa: E731
    wait_until(lambda: closes() >= set(sessions), what="the sessions closed")
    tokenizer = stack.service.engine.tokenizer
    for session, traj in zip(sessions, group.trajectories, strict=True):
        steps = episode_calls(env.calls(), session)  # reset, step, step, close: the 2nd turn was judged
        assert traj.num_turns == 2 and traj.finish_reason == "tool_budget"
        assert traj.reward.value == 0.0  # the environment rewards only the step that ends an episode
        mask, tokens = list(traj.loss_mask), list(traj.response_tokens)
        first = mask.index(False)
        second = mask.index(True, first)
        assert all(mask[second:])  # turn, observation, turn: nothing observed after the last turn
        assert steps[1]["action"] == tokenizer.decode(tokens[second:], skip_special_tokens=True)


def test_an_unregistered_environment_finishes_its_admitted_tasks_then_is_gone(
    make_stack: Callable[..., Stack], env_process: Callable[..., EnvProcess]
) -> None:
    """UnregisterEnvironment: tasks already admitted run to the end and reach the learner (none lost), new ones
    are refused by name, and once none is outstanding the environment is gone from every call."""
    env = env_process("normal", steps=1)
    stack = make_stack(k=4, groups_per_step=1, dataset="", n=2, max_tokens=8)
    stub = stack.registry()
    register(stack, name="leaving", endpoint=env.endpoint, tool_parser="turn", scorer="environment")
    assert submit(stack, "leaving", 3, "admitted").accepted == 3
    reply = stub.UnregisterEnvironment(
        registry_pb2.UnregisterEnvironmentRequest(name="leaving"), metadata=stack.auth, timeout=10
    )
    assert (reply.state, reply.tasks_outstanding) == ("draining", 3)
    late = submit(stack, "leaving", 1, "late")
    assert (late.accepted, late.rejected) == (0, 1) and late.errors[0].endswith("[environment_draining]")
    status = stub.EnvironmentStatus(
        registry_pb2.EnvironmentStatusRequest(name="leaving"), metadata=stack.auth
    )
    assert (status.state, status.tasks_outstanding) == ("draining", 3)
    stack.learner.publish(0)
    stack.start()
    groups = wait_until(lambda: len(g := rollouts(stack)) >= 3 and g, what="the 3 admitted tasks' groups")
    assert sorted(g.task.task_id for g in groups) == ["admitted0", "admitted1", "admitted2"]

    def gone() -> bool:
        try:
            stub.EnvironmentStatus(registry_pb2.EnvironmentStatusRequest(name="leaving"), metadata=stack.auth)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND
        return False

    wait_until(gone, what="the drained environment removed")
    listed = stub.ListEnvironments(registry_pb2.ListEnvironmentsRequest(), metadata=stack.auth)
    assert [e.name for e in listed.environments] == []
    with pytest.raises(grpc.RpcError) as info:
        stub.UnregisterEnvironment(
            registry_pb2.UnregisterEnvironmentRequest(name="leaving"), metadata=stack.auth
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'leaving'" in info.value.details()
    assert len(rollouts(stack)) == 3  # nothing more was sampled for it


def test_registry_calls_need_the_token_and_bad_registrations_are_named(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2)
    stub = stack.registry()
    for metadata in (None, bearer("not-the-token")):
        with pytest.raises(grpc.RpcError) as info:
            stub.ListEnvironments(registry_pb2.ListEnvironmentsRequest(), metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.SubmitTasks(
            iter([registry_pb2.SubmitTasksRequest(task=rollout_pb2.Task(prompt="hi"))]), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stack.client.xlen(stack.specs["tasks"].key) == 0  # nothing got in
    metrics = stack.service.registry.exposition().decode()
    assert 'vcpo_sampler_unauthenticated_total{replica="sampler-0"} 3.0' in metrics
    huge = rollout_pb2.Task(task_id="huge", prompt="x" * (5 << 20))  # past sampler.max_request_bytes (4 MiB)
    with pytest.raises(grpc.RpcError) as info:
        stub.SubmitTasks(iter([registry_pb2.SubmitTasksRequest(task=huge)]), timeout=10, metadata=stack.auth)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stack.client.xlen(stack.specs["tasks"].key) == 0
    with pytest.raises(grpc.RpcError) as info:
        register(stack, name="far", endpoint="127.0.0.1:1")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nothing at endpoint '127.0.0.1:1' answered gRPC health checks" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        register(stack, name="small", builtin="python", max_concurrency=1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_concurrency 1 is below the group size n = 2" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.EnvironmentStatus(registry_pb2.EnvironmentStatusRequest(name="nope"), metadata=stack.auth)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # a scorer nobody registered is refused at registration, naming the registered ones
    with pytest.raises(grpc.RpcError) as info:
        register(stack, name="typo", builtin="python", scorer="exact_mtach")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown scorer 'exact_mtach'; registered scorers: " in info.value.details()
    assert "exact_match" in info.value.details() and "environment" in info.value.details()
    # and so are submitted tasks with an unknown scorer or a split other than train, each named
    tasks = [
        rollout_pb2.Task(task_id="s", prompt="hi", scorer="nope"),
        rollout_pb2.Task(task_id="t", prompt="hi", split="test"),
        rollout_pb2.Task(task_id="ok", prompt="hi", scorer="math", split="train"),
    ]
    requests = iter(registry_pb2.SubmitTasksRequest(task=t) for t in tasks)
    reply = stub.SubmitTasks(requests, timeout=10, metadata=stack.auth)
    assert (reply.accepted, reply.rejected) == (1, 2)
    assert "task #0: task 's': unknown scorer 'nope'; registered scorers: " in reply.errors[0]
    assert reply.errors[0].endswith("[unknown_scorer]")
    assert "task #1: task 't': split 'test': submitted tasks are trained on" in reply.errors[1]
    assert reply.errors[1].endswith("[bad_split]")


def test_a_hanging_and_a_crashing_environment_fail_only_their_own_groups(
    make_stack: Callable[..., Stack], env_process: Callable[..., EnvProcess]
) -> None:
    good, hang, crash = env_process("normal", steps=1), env_process("hang"), env_process("crash")
    stack = make_stack(
        k=8,
        groups_per_step=2,
        dataset="",
        n=2,
        max_tokens=8,
        env_failures_to_open=2,
        env_cooldown_s=300,
        env_max_attempts=2,
    )
    for name, env in (("good", good), ("hang", hang), ("crash", crash)):
        register(
            stack,
            name=name,
            endpoint=env.endpoint,
            tool_parser="turn",
            scorer="environment",
            step_timeout_seconds=1,
            max_concurrency=2,
        )
    for name in ("hang", "crash", "good"):
        assert submit(stack, name, 3, name).accepted == 3
    stack.learner.publish(0)
    stack.start()
    # the good environment's groups come through while the hanging one's calls wait for their deadline
    wait_until(lambda: sum(g.task.environment == "good" for g in rollouts(stack)) >= 3, 90, "good groups")
    status = wait_until(
        lambda: (
            not (
                s := stack.registry().EnvironmentStatus(
                    registry_pb2.EnvironmentStatusRequest(name="crash"), metadata=stack.auth
                )
            ).healthy
            and s
        ),
        60,
        "the crashing environment paused",
    )
    assert status.errors >= 2 and "paused by the circuit breaker" in status.last_error
    assert "RuntimeError" in status.last_error or "INTERNAL" in status.last_error
    hung = wait_until(
        lambda: (
            (
                s := stack.registry().EnvironmentStatus(
                    registry_pb2.EnvironmentStatusRequest(name="hang"), metadata=stack.auth
                )
            ).errors
            >= 2
            and s
        ),
        60,
        "the hanging environment's timeouts",
    )
    assert "timeout" in hung.last_error
    assert {g.task.environment for g in rollouts(stack)} == {"good"}  # nothing half-done was written
    metrics = stack.service.registry.exposition().decode()
    assert (
        'vcpo_sampler_env_failed_groups_total{environment="hang",reason="timeout",replica="sampler-0"}'
        in metrics
    )
    assert 'vcpo_sampler_env_paused{environment="crash",replica="sampler-0"} 1.0' in metrics
    # a task failed env_max_attempts times is dead-lettered with why, not retried forever
    dead = wait_until(lambda: stack.client.xrange(stack.specs["tasks"].dead_letter_key), 60, "dead letters")
    kinds = {f[b"dead_kind"].decode() for _, f in dead}
    assert kinds == {"environment_failed"}


def test_the_example_client_registers_the_example_environment_and_its_tasks_run(
    make_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2, max_tokens=8)
    env = subprocess.Popen(
        [sys.executable, "examples/calculator_env.py", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert env.stdout is not None
        endpoint = env.stdout.readline().split()[-1]

        def submit(token_file: Path, *flags: str) -> subprocess.CompletedProcess[str]:
            """No --sampler: the client finds the sampler's free port from the run directory, and the run's
            own token there (--token-file only for another one)."""
            run_dir = Path(stack.run.run_dir)
            token = [] if token_file == run_dir / "api_token" else ["--token-file", str(token_file)]
            return subprocess.run(
                [
                    sys.executable,
                    "examples/submit_tasks.py",
                    "--run-dir",
                    str(run_dir),
                    *token,
                    "--env-endpoint",
                    endpoint,
                    *flags,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120 if flags else 60,  # the tasks' run, or only the refused registration
            )

        check_example_client(stack, submit, tmp_path)
    finally:
        env.kill()
        env.wait(10)
        if env.stdout is not None:
            env.stdout.close()


def test_held_out_episodes_run_beside_training_and_never_become_groups(
    make_stack: Callable[..., Stack], env_process: Callable[..., EnvProcess], tmp_path: Path
) -> None:
    """An evaluation set with an environment (shared placement): each held-out task's samples are episodes
    in the sampler's engine, with exact log-probs and masked observations; nothing reaches `rollouts`."""
    from services.common.clock import eval_results_key

    env = env_process("normal", steps=2)
    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(json.dumps({"prompt": f"Play held-out round {i}.", "answer": ""}) + "\n" for i in range(2))
    )
    game = {
        "name": "game",
        "endpoint": env.endpoint,
        "tool_parser": "turn",
        "max_turns": 4,
        "scorer": "environment",
        "step_timeout_seconds": 10,
    }
    evaluation = {
        "every": 100,
        "sets": [
            {
                "name": "game-held",
                "dataset": str(held),
                "environment": "game",
                "n": 2,
                "temperature": 1.0,
                "top_p": 1.0,
            }
        ],
    }
    stack = make_stack(
        k=4, groups_per_step=2, dataset="", n=2, max_tokens=12, environments=[game], evaluation=evaluation
    )
    key = eval_results_key("t")
    stack.learner.publish(0)
    stack.start()
    records = wait_until(lambda: stack.client.lrange(key, 0, -1), what="the version-0 evaluation")
    stack.stop.set()
    stack.thread.join(timeout=30)
    record = json.loads(records[0])
    assert (record["set"], record["version"], record["tasks"], record["n"], record["where"]) == (
        "game-held",
        0,
        2,
        2,
        "shared",
    )
    # the environment ends every episode at its 2nd step with reward 1.0: scored by it, as training would be
    assert (record["mean_at_n"], record["failed_episodes"], record["failed_scores"]) == (1.0, 0, 0)

    evaluator = stack.service.evaluator
    assert evaluator is not None and evaluator.last is not None
    model = hf_model(stack.model_dir, version_weights(stack.model_dir, 0))
    tokenizer = stack.service.engine.tokenizer
    parser = make_parser("turn")
    calls = env.calls()
    sessions = {c["session_id"] for c in calls}
    assert len(sessions) == 4 and all(s.startswith("eval/") for s in sessions)  # 2 tasks x n = 2
    for (_, ti, k), response in evaluator.last.responses.items():
        session = next(s for s in sessions if s.endswith(f"/{ti}/{k}"))
        steps = episode_calls(calls, session)
        assert response.turns == 2 and response.environment_reward == 1.0
        tokens, mask = response.tokens, response.mask
        first = mask.index(False)
        obs_end = mask.index(True, first)
        observation = parser.format_observation(steps[0]["observation"])
        assert tokens[first:obs_end] == tokenizer.encode(observation, add_special_tokens=False)
        assert steps[1]["action"] == tokenizer.decode(tokens[obs_end:], skip_special_tokens=True)
        prompt = evaluator.sets[0].prompts[ti]
        expected = full_logprobs(model, prompt, tokens)
        generated = [j for j, m in enumerate(mask) if m]
        assert_logprobs_match([response.logprobs[j] for j in generated], [expected[j] for j in generated])
    assert stack.client.xlen(stack.specs["rollouts"].key) == 0 and stack.service.sampler.emitted == 0


def test_the_eval_command_runs_environment_sets_with_a_registry_of_its_own(
    vllm_engine: Any,
    tiny_model_dir: Path,
    env_process: Callable[..., EnvProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`deploy.eval` on a set with an environment: no run Redis needed (it starts its own for the registry)."""
    import services.evaluator.offline as service
    from deploy.eval import main

    env = env_process("normal", steps=2)
    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(json.dumps({"prompt": f"Play round {i}.", "answer": ""}) + "\n" for i in range(3))
    )
    run_file = tmp_path / "run.toml"
    run_file.write_text(f"""
[run]
model = "{tiny_model_dir}"
run_dir = "{tmp_path / "run"}"
[sampler]
max_model_len = 256
max_tokens = 12
[[sampler.environments]]
name = "game"
endpoint = "{env.endpoint}"
tool_parser = "turn"
max_turns = 4
step_timeout_seconds = 10
[[evaluation.sets]]
name = "game-held"
dataset = "{held}"
environment = "game"
n = 2
""")
    # the session's engine stands in for the one the command would build (and must not be closed)
    monkeypatch.setattr(service, "make_engine", lambda cfg, replica, model="": vllm_engine)
    monkeypatch.setattr(vllm_engine, "close", lambda: None)
    out = tmp_path / "result.json"
    assert main(["--config", str(run_file), "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())["sets"]
    assert (record["set"], record["tasks"], record["n"], record["where"]) == ("game-held", 3, 2, "command")
    # no scorer named anywhere: the environment's reward (1.0 at its 2nd step) scores each episode
    assert (record["mean_at_n"], record["failed_episodes"], record["failed_scores"]) == (1.0, 0, 0)
    calls = env.calls()
    sessions = {c["session_id"] for c in calls}
    assert len(sessions) == 3 * 2 and all(s.startswith("eval/") for s in sessions)
    assert sorted(c["method"] for c in calls).count("close") == 6  # every session closed
