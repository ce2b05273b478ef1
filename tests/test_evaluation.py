"""Held-out evaluation: the schedule, the round logic, exactness at a version on the real engine, the sampler
running it beside training (nothing of it reaches `rollouts`), the metrics log the launcher writes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from deploy.config import SystemConfig
from deploy.metrics_log import MetricsLog
from deploy.progress import entries_added
from services.common.clock import RunClock, eval_results_key
from services.common.config import ConfigError, load_config
from services.evaluator.evaluator import REQUEST_PREFIX, Evaluator
from services.evaluator.metrics import EvalRecorder, accuracy
from services.evaluator.schedule import EvalSchedule
from services.evaluator.sets import EvalSet
from services.reward.pool import Outcome
from services.reward.scorers import ScoreInput
from services.sampler.config import EvaluationConfig
from services.sampler.engine import Sampling, TokenDelta
from services.sampler.environments.base import Environment
from vcpo.v1 import rollout_pb2

# ----------------------------------------------------------------------------------------- the logic


def test_accuracy_is_mean_at_n_and_pass_at_n() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    mean_at_n, pass_at_n, reward_mean = accuracy(rewards, correct_at=1.0)
    assert mean_at_n == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert pass_at_n == pytest.approx(2 / 3)
    assert reward_mean == pytest.approx(6 / 12)
    assert accuracy([[0.6, 0.2]], correct_at=0.5)[:2] == (0.5, 1.0)  # partial rewards against a threshold
    with pytest.raises(ValueError, match="at least one task"):
        accuracy([], 1.0)


def test_the_schedule_gives_each_bucket_of_versions_to_one_evaluator(redis_client: redis.Redis) -> None:
    a = EvalSchedule({"s": 10}, True, redis_client, "t", "sampler-0")
    b = EvalSchedule({"s": 10}, True, redis_client, "t", "sampler-1")
    assert a.claim(0) == ["s"] and b.claim(0) == []  # version 0 (at_start): one of them
    assert a.claim(3) == b.claim(7) == []  # the rest of bucket 0 is not due
    assert b.claim(12) == ["s"] and a.claim(13) == []  # the first version either meets in bucket 1
    assert b.claim(14) == []  # decided here already
    assert a.claim(25) == ["s"]
    assert redis_client.get("vcpo:t:eval:claim:s:1") == b"sampler-1@12"
    late = EvalSchedule({"s": 10}, True, redis_client, "t", "sampler-2")  # e.g. a restarted replica
    assert late.claim(0) == late.claim(19) == [] and late.claim(30) == ["s"]
    quiet = EvalSchedule({"s": 10}, False, None)
    assert quiet.claim(0) == [] and quiet.claim(10) == ["s"] and quiet.claim(11) == []
    # each set at its own interval: version 10 is due for both, 15 for the every-5 set only
    two = EvalSchedule({"often": 5, "rarely": 10}, True, None)
    assert two.claim(0) == ["often", "rarely"] and two.claim(5) == ["often"]
    assert two.claim(10) == ["often", "rarely"] and two.claim(16) == ["often"] and two.claim(19) == []
    with pytest.raises(ValueError, match="interval >= 1"):
        EvalSchedule({"s": 0}, True)


def test_the_schedule_wants_only_versions_some_set_may_still_be_due_at(redis_client: redis.Redis) -> None:
    a = EvalSchedule({"often": 5, "rarely": 10}, False, redis_client, "w", "evaluator")
    assert not a.wants(0) and not a.wants(4)  # no at_start: bucket 0 is never due
    assert a.wants(5) and a.wants(5)  # asking claims nothing
    assert a.claim(5) == ["often"]
    assert not a.wants(7) and a.wants(10)  # [5, 10) is done for "often", "rarely" waits for 10
    assert a.claim(12) == ["often", "rarely"] and not a.wants(14) and a.wants(15)
    # a restarted evaluator reads the claims made before it: nothing to fetch until the next bucket
    again = EvalSchedule({"often": 5, "rarely": 10}, False, redis_client, "w", "evaluator")
    assert not again.wants(13) and again.wants(15) and again.claim(15) == ["often"]
    assert EvalSchedule({"s": 10}, True, None).wants(0)


def test_evaluation_config_is_checked() -> None:
    good = {"sets": [{"name": "gsm8k", "dataset": "data/gsm8k_test.jsonl", "n": 8}]}
    assert EvaluationConfig.model_validate(good).sets[0].n == 8
    with pytest.raises(ValueError, match="must match"):
        EvaluationConfig.model_validate({"sets": [{"name": "GSM 8k", "dataset": "x.jsonl"}]})
    with pytest.raises(ValueError, match="used twice"):
        EvaluationConfig.model_validate({"sets": [{"name": "a", "dataset": "x.jsonl"}] * 2})
    with pytest.raises(ValueError, match="placement"):
        EvaluationConfig.model_validate({"placement": "elsewhere"})
    cfg = load_config(SystemConfig, overrides=[("evaluation.every", 7, "--set")])
    assert cfg.evaluation.every == 7  # [evaluation] is a known section of a run file
    with pytest.raises(
        ConfigError, match=r"environment 'python' is not one of \[\[sampler\.environments\]\]"
    ):
        load_config(
            SystemConfig,
            ["deploy/presets/local.toml"],
            overrides=[
                ("evaluation.sets", [{"name": "tir", "dataset": "x.jsonl", "environment": "python"}], "-")
            ],
        )
    with pytest.raises(ConfigError, match=r"'evaluation\.sets' is a list"):
        load_config(
            SystemConfig,
            ["deploy/presets/local.toml"],
            overrides=[("evaluation.sets.0.n", 2, "--set evaluation.sets.0.n=2")],
        )


def test_sets_load_like_training_data_and_bad_ones_are_named(tmp_path: Path) -> None:
    from services.common.prompts import PromptEncoder
    from services.common.tiny_model import build_tokenizer
    from services.evaluator.sets import load_eval_sets
    from services.sampler.config import SamplerServiceConfig

    rows = [{"id": f"q{i}", "question": f"What is {i}+1?", "gold": str(i + 1), "level": i} for i in range(5)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = PromptEncoder(build_tokenizer(), max_model_len=256, max_tokens=16)

    def sets(**spec: Any) -> Any:
        spec = {"name": "val", "dataset": str(tmp_path / "val.jsonl"), **spec}
        cfg = SamplerServiceConfig.model_validate(
            {
                "sampler": {"max_tokens": 16},
                "evaluation": {"sets": [spec]},
                "reward": {"default_scorer": "math"},
            }
        )
        return load_eval_sets(cfg, encoder)

    (val,) = sets(prompt_field="question", answer_field="gold", limit=3, n=2, temperature=0.0, top_p=0.5)
    assert [(t.task_id, t.prompt, t.reference, t.split) for t in val.tasks] == [
        (f"q{i}", f"What is {i}+1?", str(i + 1), "test") for i in range(3)
    ]
    assert val.tasks[0].metadata["level"] == "0" and val.scorer == "math" and val.n == 2
    assert val.sampling.temperature == 0.0 and val.sampling.top_p == 1.0  # greedy ignores top_p
    assert val.prompts == [encoder.encode(t) for t in val.tasks]
    with pytest.raises(ValueError, match=r"evaluation set 'val': .*no 'prompt' field.*question"):
        sets()  # the sampler's default prompt_field
    with pytest.raises(
        ValueError, match=r"evaluation set 'val': dataset file .*missing.jsonl' does not exist"
    ):
        sets(dataset=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"evaluation set 'val': .*has no tasks"):
        sets(dataset=str(tmp_path / "empty.jsonl"))


def test_sets_take_each_tasks_scorer_from_its_source_unless_the_set_names_one(tmp_path: Path) -> None:
    """sampler.scorer_by_source applies to evaluation sets as to training data: each task is scored by the rule
    its data_source picks; a set that names its own scorer judges all its tasks with it (and needs no table)."""
    from services.common.prompts import PromptEncoder
    from services.common.tiny_model import build_tokenizer
    from services.evaluator.sets import load_eval_sets
    from services.sampler.config import SamplerServiceConfig

    rows = [
        {"prompt": f"What is {i}+1?", "data_source": src, "reward_model": {"ground_truth": str(i + 1)}}
        for i, src in enumerate(["openai/gsm8k", "math-500", "unmapped"])
    ]
    (tmp_path / "mapped.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = PromptEncoder(build_tokenizer(), max_model_len=256, max_tokens=16)

    def sets(name: str, **spec: Any) -> Any:
        cfg = SamplerServiceConfig.model_validate(
            {
                "sampler": {
                    "max_tokens": 16,
                    "answer_field": "reward_model.ground_truth",
                    "scorer_by_source": {"openai/gsm8k": "gsm8k", "math-500": "math_verl"},
                },
                "evaluation": {"sets": [{"name": "val", "dataset": str(tmp_path / name), **spec}]},
            }
        )
        return load_eval_sets(cfg, encoder)

    (val,) = sets("mapped.jsonl")
    assert [t.scorer for t in val.tasks] == ["gsm8k", "math_verl"] and [t.reference for t in val.tasks] == [
        "1",
        "2",
    ]
    assert [val.scorer_of(t, None) for t in val.tasks] == ["gsm8k", "math_verl"]
    (own,) = sets(
        "mixed.jsonl", scorer="exact_match"
    )  # the unmapped row is fine: the set's scorer judges all
    assert {t.scorer for t in own.tasks} == {""} and {own.scorer_of(t, None) for t in own.tasks} == {
        "exact_match"
    }
    with pytest.raises(ValueError, match=r"evaluation set 'val': .*data_source 'unmapped' has no scorer"):
        sets("mixed.jsonl")


class FakeEngine:
    """Answers every request with a scripted response, one token per step (the logic under test is the
    evaluator's)."""

    def __init__(self, answers: dict[str, list[int]]) -> None:
        self.answers = answers  # prompt text -> tokens of the response
        self.loaded_version: int | None = 5
        self.active: dict[str, list[int]] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.most_at_once = 0

    def add(self, request_id: str, prompt_tokens: list[int], sampling: Sampling) -> None:
        self.added.append(request_id)
        self.active[request_id] = list(self.answers[chr(prompt_tokens[0])])
        self.most_at_once = max(self.most_at_once, len(self.active))

    def step(self) -> list[TokenDelta]:
        out = []
        for request_id, left in list(self.active.items()):
            token = left.pop(0)
            out.append(
                TokenDelta(request_id, [token], [-0.1], "", None if left else "stop", detokenized=False)
            )
            if not left:
                del self.active[request_id]
        return out

    def has_unfinished(self) -> bool:
        return bool(self.active)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.active.pop(request_id, None)

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(t) for t in tokens)


def exact(jobs: list[tuple[str, ScoreInput]]) -> list[Outcome]:
    return [Outcome(name, float(item.response == item.reference)) for name, item in jobs]


def fake_set(name: str, answers: dict[str, str], n: int = 3) -> EvalSet:
    tasks = [rollout_pb2.Task(task_id=f"{name}:{p}", prompt=p, reference=ref) for p, ref in answers.items()]
    return EvalSet(name, tasks, [[ord(p)] for p in answers], "exact_match", n, Sampling(max_tokens=8))


def test_a_round_of_some_sets_scores_only_those() -> None:
    engine = FakeEngine({"a": [ord("7")], "c": [ord("2")]})
    sets = [fake_set("s1", {"a": "7"}), fake_set("s2", {"c": "1"}, n=2)]
    evaluator = Evaluator(engine, sets, exact, schedule=EvalSchedule({"s1": 5, "s2": 10}, False))  # type: ignore[arg-type]
    engine.loaded_version = 5
    assert evaluator.offer(5)
    results: list[Any] = []  # offer began the round: drive it as the sampler does
    while evaluator.busy:
        for delta in engine.step():
            evaluator.absorb(delta)
        results = evaluator.pump() or results
    assert [(r.set, r.mean_at_n) for r in results] == [("s1", 1.0)]
    assert all("/s1/" in r for r in engine.added)
    engine.loaded_version = 10
    assert evaluator.offer(10)
    while evaluator.busy:
        for delta in engine.step():
            evaluator.absorb(delta)
        results = evaluator.pump() or results
    assert [(r.set, r.mean_at_n) for r in results] == [("s1", 1.0), ("s2", 0.0)]


def test_a_round_scores_every_set_and_keeps_at_most_max_in_flight_requests_in_the_engine() -> None:
    engine = FakeEngine({"a": [ord("7")], "b": [ord("9"), ord("9")], "c": [ord("1")]})
    sets = [fake_set("s1", {"a": "7", "b": "8"}), fake_set("s2", {"c": "1"}, n=2)]
    recorder = EvalRecorder(None, None, "t", "command", "test")
    evaluator = Evaluator(engine, sets, exact, recorder, max_in_flight=2)  # type: ignore[arg-type]
    results = evaluator.run(5)
    assert [(r.set, r.version, r.tasks, r.n) for r in results] == [("s1", 5, 2, 3), ("s2", 5, 1, 2)]
    assert (results[0].mean_at_n, results[0].pass_at_n) == (0.5, 0.5)  # "a" right, "b" answered 99
    assert (results[1].mean_at_n, results[1].pass_at_n) == (1.0, 1.0)
    assert results[0].tokens == 3 * 1 + 3 * 2
    assert engine.most_at_once == 2 and len(engine.added) == 3 * 2 + 2
    assert all(r.startswith(REQUEST_PREFIX) for r in engine.added) and not evaluator.busy
    assert evaluator.rounds["done"] == 1


def test_a_stop_while_a_round_is_scored_keeps_its_results_and_a_stop_while_generating_does_not() -> None:
    stop = threading.Event()

    def stop_then_score(jobs: list[tuple[str, ScoreInput]]) -> list[Outcome]:
        stop.set()  # the service is asked to stop while the scorers work...
        time.sleep(0.2)  # ...and the round's loop sees it before they are done
        return exact(jobs)

    engine = FakeEngine({"a": [ord("7")]})
    evaluator = Evaluator(engine, [fake_set("s", {"a": "7"})], stop_then_score)  # type: ignore[arg-type]
    results = evaluator.run(5, stop)
    # generated before the stop: scored, returned (the dedicated evaluator lists the version as evaluated)
    assert [(r.set, r.version, r.mean_at_n) for r in results] == [("s", 5, 1.0)]
    assert evaluator.rounds == {"done": 1, "abandoned": 0, "shutdown": 0} and not evaluator.busy
    engine = FakeEngine({"a": [ord("7")] * 50})
    evaluator = Evaluator(engine, [fake_set("s", {"a": "7"})], exact)  # type: ignore[arg-type]
    assert evaluator.run(5, stop) == []  # stopped while generating: abandoned, nothing scored
    assert evaluator.rounds == {"done": 0, "abandoned": 0, "shutdown": 1} and not engine.active


def test_a_newer_version_waits_for_a_generating_round_at_most_max_delay_s() -> None:
    engine = FakeEngine({"a": [ord("7")] * 50})
    evaluator = Evaluator(engine, [fake_set("s", {"a": "7"}, n=2)], exact, max_delay_s=0.2)  # type: ignore[arg-type]
    evaluator.schedule = EvalSchedule({"s": 10}, True)
    engine.loaded_version = 0
    assert evaluator.offer(0) and evaluator.generating and not evaluator.offer(0)
    for delta in engine.step():
        evaluator.absorb(delta)
    assert evaluator.holds()  # a newer version is ready: held while the round generates...
    time.sleep(0.25)
    assert not evaluator.holds()  # ...but not past the budget: the round is abandoned, training goes on
    assert not evaluator.generating and evaluator.rounds["abandoned"] == 1 and 0.2 <= evaluator.held_s < 1.0
    assert sorted(engine.aborted) == sorted(engine.added) and not engine.active
    engine.loaded_version = 3
    assert not evaluator.offer(3)  # its bucket is not retried
    engine.loaded_version = 10
    assert evaluator.offer(10)  # the next bucket is
    engine.loaded_version = 11  # the engine moved on under a round (a caller that ignored holds())
    assert evaluator.pump() == [] and evaluator.rounds["abandoned"] == 2


class Guessing(Environment):
    """An in-process environment: each step is the model's guess at the task's reference; a right guess ends
    the episode with reward 1, a wrong one is answered "no" until the second, which ends it with 0. A task
    whose prompt is "c" makes it fail."""

    name = "guess"

    def __init__(self) -> None:
        self.tasks: dict[str, rollout_pb2.Task] = {}
        self.steps: dict[str, int] = {}
        self.closed: list[str] = []

    def reset(self, session_id: str, task: rollout_pb2.Task, timeout_s: float) -> Any:
        from vcpo.v1 import environment_pb2

        self.tasks[session_id] = task
        return environment_pb2.ResetResponse()

    def step(self, session_id: str, action: Any, timeout_s: float) -> Any:
        from services.sampler.environments.base import EnvironmentFailure
        from vcpo.v1 import environment_pb2

        task = self.tasks[session_id]
        if task.prompt == "c":
            raise EnvironmentFailure(self.name, "error", "the guessing game broke")
        self.steps[session_id] = self.steps.get(session_id, 0) + 1
        right = action.text == task.reference
        done = right or self.steps[session_id] >= 2
        return environment_pb2.StepResponse(
            observation=environment_pb2.Observation(text="" if done else "no"), reward=float(right), done=done
        )

    def close(self, session_id: str, timeout_s: float) -> None:
        time.sleep(0.05)  # closes still queued when the evaluator stops: it waits for them, never drops them
        self.closed.append(session_id)

    def healthy(self, timeout_s: float) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class CharEncoder:
    """The prompt encoder for FakeEngine's one-character tokens."""

    max_model_len = 1000

    class tokenizer:
        @staticmethod
        def encode(text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    def encode(self, task: rollout_pb2.Task, tools: Any = None) -> list[int]:
        return [ord(task.prompt[0])]

    def response_budget(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len


def guessing_agent(redis_client: redis.Redis, engine: FakeEngine) -> tuple[Any, Guessing]:
    from services.sampler.agent import AgentLoop
    from services.sampler.environments.parsers import make_parser
    from services.sampler.environments.registry import CircuitBreaker, EnvironmentRegistry
    from vcpo.v1 import registry_pb2

    env = Guessing()
    registry = EnvironmentRegistry(
        redis_client,
        "g",
        "evaluator",
        3,
        make_env=lambda spec, size: env,
        breaker=lambda: CircuitBreaker(100, 1.0),
    )  # type: ignore[arg-type,return-value]
    registry.register(
        registry_pb2.EnvironmentSpec(
            name="guess", endpoint="127.0.0.1:9", tool_parser="turn", max_turns=4, max_concurrency=6
        )
    )
    assert make_parser("turn").every_turn_is_an_action
    return AgentLoop(engine, registry, CharEncoder()), env  # type: ignore[arg-type]


def episode_set(name: str, answers: dict[str, str], n: int = 3) -> EvalSet:
    s = fake_set(name, answers, n)
    for task in s.tasks:
        task.environment = "guess"
    s.scorer, s.environment = "", "guess"  # no scorer named: the environment's reward judges
    return s


def by_environment(jobs: list[tuple[str, ScoreInput]]) -> list[Outcome]:
    return [
        Outcome(
            name, item.environment_reward if name == "environment" else float(item.response == item.reference)
        )
        for name, item in jobs
    ]


def test_a_set_with_an_environment_runs_each_task_as_episodes_and_scores_them_like_training(
    redis_client: redis.Redis,
) -> None:
    engine = FakeEngine({"a": [ord("7")], "b": [ord("9")], "c": [ord("1")], "d": [ord("4")]})
    agent, env = guessing_agent(redis_client, engine)
    sets = [episode_set("game", {"a": "7", "b": "8", "c": "1"}), fake_set("plain", {"d": "4"}, n=2)]
    seen: list[str] = []

    def score(jobs: list[tuple[str, ScoreInput]]) -> list[Outcome]:
        seen.extend(name for name, _ in jobs)
        return by_environment(jobs)

    evaluator = Evaluator(engine, sets, score, agent=agent, max_in_flight=6)  # type: ignore[arg-type]
    results = evaluator.run(5)
    evaluator.close()
    game, plain = results
    # "a": right at once (1.0); "b": wrong twice (0.0); "c": its environment failed (0, counted)
    assert game.per_task == [[1.0] * 3, [0.0] * 3, [0.0] * 3] and game.mean_at_n == pytest.approx(1 / 3)
    assert (game.failed_episodes, game.failed_scores) == (3, 0) and plain.failed_episodes == 0
    assert plain.per_task == [[1.0, 1.0]]
    assert seen == ["environment"] * 6 + ["exact_match"] * 2  # the failed task's samples are not scored
    episodes = evaluator.last.responses  # type: ignore[union-attr]
    wrong = episodes[(0, 1, 0)]
    assert engine.decode(wrong.tokens) == "9\nno\n9" and wrong.turns == 2  # its turns and the observation
    assert wrong.mask == [True, False, False, False, False, True]  # the observation is masked out
    assert all(r.startswith(REQUEST_PREFIX) for r in engine.added)  # routed to the evaluator, never a group
    assert sorted(env.closed) == sorted(
        f"{REQUEST_PREFIX}1/v5/game/{t}/{k}" for t in range(3) for k in range(3)
    )
    assert engine.most_at_once <= 6


def test_an_abandoned_round_stops_its_episodes_and_closes_their_sessions(redis_client: redis.Redis) -> None:
    engine = FakeEngine({"a": [ord("7")] * 40})
    agent, env = guessing_agent(redis_client, engine)
    evaluator = Evaluator(
        engine, [episode_set("game", {"a": "7"}, n=2)], by_environment, agent=agent, max_delay_s=0.1
    )  # type: ignore[arg-type]
    evaluator.begin(5)
    deadline = time.monotonic() + 10
    while not engine.active and time.monotonic() < deadline:  # resets come back, the first turns start
        evaluator.pump()
        time.sleep(0.01)
    assert len(engine.active) == 2
    for delta in engine.step():
        evaluator.absorb(delta)
    assert evaluator.holds()
    time.sleep(0.15)
    assert not evaluator.holds() and evaluator.rounds["abandoned"] == 1
    assert not engine.active and sorted(engine.aborted) == sorted(engine.added)
    deadline = time.monotonic() + 10
    while len(env.closed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(env.closed) == 2 and not agent.groups
    evaluator.close()


def test_an_environment_set_needs_its_environment_and_room_for_its_n_episodes(
    redis_client: redis.Redis,
) -> None:
    engine = FakeEngine({})
    agent, _ = guessing_agent(redis_client, engine)
    with pytest.raises(ValueError, match=r"environment 'guess' is not registered"):
        Evaluator(engine, [episode_set("game", {"a": "7"})], by_environment)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n = 7 exceeds environment 'guess''s max_concurrency = 6"):
        Evaluator(engine, [episode_set("game", {"a": "7"}, n=7)], by_environment, agent=agent)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ the metrics log


def test_the_metrics_log_has_steps_and_evaluations_on_the_training_clock(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    clock = RunClock(redis_client, "t")
    clock.published(0, 1000.0)
    clock.published(1, 1010.0)
    clock.published(2, 1030.0)
    clock.published(0, 2000.0)  # a republish after a restart keeps the first time
    clock.set_gpus(8)
    (tmp_path / "learner").mkdir()
    steps = [
        {
            "step": s,
            "version": s,
            "time": 1000.0 + s,
            "groups": ["g"],
            "lags": [1, 2],
            "reward_mean": 0.5,
            "metrics": {"ess_ratio": 0.9, "lr_scale": 1.0, "grad_norm": 2.0, "loss": 0.1},
        }
        for s in (1, 2)
    ]
    (tmp_path / "learner" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    record = {"kind": "eval", "set": "held", "version": 2, "n": 4, "mean_at_n": 0.25, "pass_at_n": 0.5}
    redis_client.rpush(eval_results_key("t"), json.dumps(record))
    log = MetricsLog(tmp_path, redis_client, "t")
    assert log.poll() == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["kind"], x.get("step")) for x in lines] == [("train", 1), ("train", 2), ("eval", None)]
    assert lines[1]["train_seconds"] == 30.0 and lines[1]["gpu_hours"] == pytest.approx(30 / 3600 * 8)
    assert lines[1]["lag_mean"] == 1.5 and lines[1]["ess_ratio"] == 0.9
    assert log.latest() == {"held": {"version": 2, "n": 4, "mean_at_n": 0.25, "pass_at_n": 0.5}}
    assert log.poll() == 0
    # a resumed run's launcher: writes what is new only
    record2 = dict(record, version=12, mean_at_n=0.5)
    redis_client.rpush(eval_results_key("t"), json.dumps(record2))
    with (tmp_path / "learner" / "steps.jsonl").open("a") as f:
        f.write(json.dumps(dict(steps[1], step=3, version=3)) + "\n")
    again = MetricsLog(tmp_path, redis_client, "t")
    assert again.latest()["held"]["version"] == 2
    assert again.poll() == 2
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["kind"], x.get("step"), x.get("version")) for x in lines[3:]] == [
        ("train", 3, 3),
        ("eval", None, 12),
    ]
    assert lines[3]["train_seconds"] is None  # version 3's publish time is not on the clock


# --------------------------------------------------------------------------- the real engine and sampler

HELD = {"name": "held", "dataset": "builtin:digit_add", "split": "test", "limit": 3, "n": 2, "scorer": "math"}


@pytest.mark.slow
def test_evaluation_at_a_version_samples_from_that_versions_weights(
    vllm_engine: Any, tiny_model_dir: Path
) -> None:
    from services.common.prompts import PromptEncoder
    from services.evaluator.sets import load_eval_sets
    from services.reward.scorers import get_scorer
    from services.sampler.config import SamplerServiceConfig
    from tests.sampler_helpers import (
        assert_logprobs_match,
        hf_logprobs,
        hf_model,
        load_into,
        max_abs_diff,
        version_weights,
    )

    cfg = SamplerServiceConfig.model_validate(
        {
            "run": {"model": str(tiny_model_dir)},
            "sampler": {"max_model_len": 256, "max_tokens": 12},
            "evaluation": {
                "sets": [
                    {
                        "name": "held",
                        "dataset": "builtin:digit_add",
                        "split": "test",
                        "limit": 4,
                        "n": 3,
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "scorer": "math",
                    }
                ]
            },
        }
    )
    weights = version_weights(tiny_model_dir, 7)
    version = load_into(vllm_engine, weights)
    encoder = PromptEncoder(vllm_engine.tokenizer, 256, 12)
    sets = load_eval_sets(cfg, encoder)
    assert [t.task_id for t in sets[0].tasks] == [f"digit_add:test:{i}" for i in range(4)]

    def score(jobs: list[tuple[str, ScoreInput]]) -> list[Outcome]:
        return [Outcome(name, get_scorer(name)(item).value) for name, item in jobs]

    evaluator = Evaluator(vllm_engine, sets, score, encoder=encoder)
    results = evaluator.run(version)
    assert evaluator.last is not None and len(evaluator.last.responses) == 4 * 3
    model = hf_model(tiny_model_dir, weights)
    base = hf_model(tiny_model_dir, version_weights(tiny_model_dir, 0))
    far_from_base = 0.0
    for (_, ti, _), response in evaluator.last.responses.items():
        prompt = sets[0].prompts[ti]
        assert response.tokens and response.finish_reason in ("stop", "length")
        assert_logprobs_match(response.logprobs, hf_logprobs(model, prompt, response.tokens))
        far_from_base = max(
            far_from_base, max_abs_diff(response.logprobs, hf_logprobs(base, prompt, response.tokens))
        )
    assert far_from_base > 1e-2  # the check above tells the versions apart
    # the figures are the scorer's verdicts on these very responses, task by task
    correct = [[0.0] * 3 for _ in range(4)]
    for (_, ti, k), response in evaluator.last.responses.items():
        item = ScoreInput(response=vllm_engine.decode(response.tokens), reference=sets[0].tasks[ti].reference)
        correct[ti][k] = get_scorer("math")(item).value
    assert results[0].per_task == correct
    assert results[0].mean_at_n == pytest.approx(sum(map(sum, correct)) / 12)
    assert results[0].version == version


@pytest.mark.slow
def test_the_sampler_evaluates_due_versions_and_no_evaluation_reaches_the_rollouts_stream(
    make_stack: Callable[..., Any],
) -> None:
    from tests.sampler_stack import wait_until

    stack = make_stack(k=2, groups_per_step=2, evaluation={"every": 2, "sets": [HELD], "max_delay_s": 30})
    key = eval_results_key("t")
    stack.learner.publish(0)
    stack.start()
    records = wait_until(lambda: stack.client.lrange(key, 0, -1), what="the version-0 evaluation")
    first = json.loads(records[0])
    assert (first["set"], first["version"], first["tasks"], first["n"], first["where"]) == (
        "held",
        0,
        3,
        2,
        "shared",
    )
    assert 0.0 <= first["mean_at_n"] <= first["pass_at_n"] <= 1.0
    for _ in range(3):  # the stand-in trains and publishes versions 1, 2, 3
        stack.learner.step()
    records = wait_until(
        lambda: (r := stack.client.lrange(key, 0, -1)) and len(r) >= 2 and r, what="a second evaluation"
    )
    versions = [json.loads(r)["version"] for r in records]
    assert versions[0] == 0 and versions[1] in (2, 3)  # bucket [2, 4): the first version the sampler loads
    consumed = [g for _, g in stack.learner.consumed]
    assert consumed and all(
        g.task.task_id.startswith("arith:") for g in consumed
    )  # the training dataset only
    # the figures the launcher's progress line reads: rounds by outcome (none abandoned within 30 s)
    figures = wait_until(
        lambda: (f := stack.service.sampler.status.figures) and f.get("evaluation_rounds_done", 0) >= 2 and f,
        what="the rounds in the figures",
    )
    assert (figures["evaluation_rounds_abandoned"], figures["evaluation_rounds_shutdown"]) == (0.0, 0.0)
    metrics = stack.service.registry.exposition().decode()
    stack.stop.set()
    stack.thread.join(timeout=30)
    # every entry the rollouts stream ever got is a training group the sampler wrote: evaluation wrote none
    assert entries_added(stack.client, stack.specs["rollouts"].key) == stack.service.sampler.emitted
    assert 'vcpo_eval_accuracy{metric="mean_at_n",set="held"}' in metrics
    assert 'vcpo_eval_rounds_total{outcome="done"}' in metrics


def test_the_eval_command_refuses_bad_arguments_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.eval import main

    local = ["--config", "deploy/presets/local.toml", "--run.run_dir", str(tmp_path)]
    assert main([*local, "--model", "m", "--checkpoint", "c"]) == 2
    assert "give --model or --checkpoint, not both" in capsys.readouterr().err
    assert main([*local, "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main([*local, "--model", str(tmp_path), "--sets", "tail_add_test,gsm9k"]) == 2
    assert "unknown evaluation set(s) gsm9k; the run file has: tail_add_test" in capsys.readouterr().err
    assert main([*local, "--model", str(tmp_path), "--set", "evaluation.sets=[]"]) == 2
    assert "no [[evaluation.sets]]" in capsys.readouterr().err


def test_a_dedicated_evaluator_needs_a_cpu_of_its_own() -> None:
    from deploy.launcher_setup import needed_cpus

    shared = load_config(SystemConfig, ["deploy/presets/local.toml"])
    dedicated = load_config(
        SystemConfig,
        ["deploy/presets/local.toml"],
        overrides=[("evaluation.placement", "dedicated", "--set")],
    )
    assert needed_cpus(dedicated) == needed_cpus(shared) + 1
    assert dedicated.gpus() == 0.0
    gpu = load_config(
        SystemConfig,
        ["deploy/presets/local.toml"],
        overrides=[
            ("evaluation.placement", "dedicated", "-"),
            ("evaluation.gpus", 1, "-"),
            ("learner.gpus_per_rank", 1, "-"),
            ("sampler.gpus_per_replica", 1, "-"),
        ],
    )
    assert gpu.gpus() == 2 * 1 + 1 * 1 + 1  # learner ranks, sampler replicas, the evaluator


def test_a_dedicated_evaluator_on_gpus_needs_as_many_as_a_sampler_engine() -> None:
    tp2 = [
        ("sampler.gpus_per_replica", 2, "-"),
        ("sampler.tensor_parallel_size", 2, "-"),
        ("evaluation.placement", "dedicated", "-"),
    ]
    with pytest.raises(
        ConfigError, match=r"evaluation\.gpus = 1 is less than sampler\.tensor_parallel_size = 2"
    ):
        load_config(
            SystemConfig, ["deploy/presets/local.toml"], overrides=[*tp2, ("evaluation.gpus", 1, "-")]
        )
    ok = load_config(
        SystemConfig, ["deploy/presets/local.toml"], overrides=[*tp2, ("evaluation.gpus", 2, "-")]
    )
    assert ok.evaluation.gpus == 2
    # shared placement, or no sets, asks for no evaluator GPUs at all
    load_config(SystemConfig, ["deploy/presets/local.toml"], overrides=tp2[:2])
    load_config(SystemConfig, ["deploy/presets/local.toml"], overrides=[*tp2, ("evaluation.sets", [], "-")])


def test_a_dedicated_evaluator_is_refused_with_the_collective_transport() -> None:
    """The dedicated evaluator fetches its versions from the broker, which is not in the weight group: under
    the collective transport it holds only what went through it (versions published while a group forms, and
    catch-ups), so the evaluator would evaluate almost nothing, silently. Refused, naming both ways out."""
    dedicated = ("evaluation.placement", "dedicated", "-")
    with pytest.raises(
        ConfigError, match=r'evaluation\.placement = "shared".*weight_broker\.transport = "tcp"'
    ):
        load_config(
            SystemConfig,
            ["deploy/presets/local.toml"],
            overrides=[dedicated, ("weight_broker.transport", "collective", "-")],
        )
    load_config(SystemConfig, ["deploy/presets/local.toml"], overrides=[dedicated])  # tcp: every version
    load_config(
        SystemConfig,
        ["deploy/presets/local.toml"],
        overrides=[("weight_broker.transport", "collective", "-")],
    )


@pytest.mark.slow
def test_a_dedicated_evaluator_follows_the_published_versions_and_evaluates_the_due_ones(
    redis_client: redis.Redis, redis_url: str, tiny_model_dir: Path, tmp_path: Path, vllm_engine: Any
) -> None:
    import threading

    from services.common.config import RunConfig
    from services.evaluator.service import EvaluatorService
    from tests.sampler_helpers import LearnerStandIn, announcing_broker, sampler_config
    from tests.sampler_stack import wait_until

    run = RunConfig(
        run_id="t", k=2, groups_per_step=2, model=str(tiny_model_dir), redis_url=redis_url, run_dir=tmp_path
    )
    broker = announcing_broker(redis_client, run)

    evaluation = {"every": 5, "sets": [HELD], "placement": "dedicated", "metrics_port": 0}
    cfg = sampler_config(run, broker, evaluation, max_tokens=12)
    vllm_engine.loaded_version = None  # it fetches what it evaluates
    service = EvaluatorService(cfg, vllm_engine)
    learner = LearnerStandIn(redis_client, run, broker.client(), tiny_model_dir)
    stop = threading.Event()
    summary: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: summary.update(service.serve(stop)), daemon=True)
    key = eval_results_key("t")
    try:
        RunClock(redis_client, "t").published(0)
        learner.publish(0)
        thread.start()
        wait_until(lambda: redis_client.llen(key) >= 1, what="the version-0 evaluation")
        sync = service.sync
        for version in range(1, 5):  # the rest of bucket [0, 5): nothing due, so nothing is fetched
            learner.publish(version)
        wait_until(lambda: sync.newest_known == 4, what="the evaluator to see version 4")
        sync.poll_now()
        wait_until(lambda: sync.declined == 4, what="the evaluator to pass over version 4")
        assert sync.fetched == 0
        for version in range(5, 8):  # published faster than it evaluates: it skips versions, not buckets
            learner.publish(version)
        wait_until(lambda: redis_client.llen(key) >= 2, what="the evaluation of bucket [5, 10)")
        records = [json.loads(r) for r in redis_client.lrange(key, 0, -1)]
        assert [(r["version"], r["where"], r["replica"]) for r in records] == [
            (0, "dedicated", "evaluator"),
            (records[1]["version"], "dedicated", "evaluator"),
        ]
        assert 5 <= records[1]["version"] <= 7 and vllm_engine.loaded_version == records[1]["version"]
        assert records[0]["train_seconds"] == 0.0  # version 0 starts the training clock
        ends = json.loads((tmp_path / "evaluator" / "evaluator.endpoints.json").read_text())
        assert ends["metrics_url"].startswith("http://")
        assert 'vcpo_eval_policy_version{set="held"}' in service.registry.exposition().decode()
    finally:
        stop.set()
        thread.join(timeout=60)
        service.close()
        broker.stop()
    assert summary["rounds"]["done"] == 2 and len(summary["evaluated_versions"]) == 2
