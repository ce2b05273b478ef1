"""Shared evaluation rounds split into shards among the sampler replicas (services/evaluator/shards.py), on a
real Redis, and the start-up rule that a shared round can finish inside its hold (services/evaluator/capacity.py),
applied to every shipped preset."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from deploy.config import SystemConfig
from services.common.clock import eval_results_key
from services.common.config import load_config
from services.evaluator.capacity import check_round, plan_round
from services.evaluator.evaluator import Evaluator
from services.evaluator.metrics import EvalRecorder, SetResult
from services.evaluator.schedule import EvalSchedule
from services.evaluator.shards import ShardBoard, pack
from services.sampler.config import EvaluationConfig, SamplerConfig
from services.sampler.engine import Sampling
from tests.test_evaluation import CharEncoder, FakeEngine, exact, fake_set

PRESET_DIR = Path(__file__).parent.parent / "deploy" / "presets"
RUN = "t"


class SampleEngine(FakeEngine):
    """FakeEngine whose answer depends on the sample too: sample k of a task answers right (its one-token
    reference) when k + the task's letter is not a multiple of 3, else ``length`` x's; so mean@n and pass@n
    differ from task to task, and wrong answers take several engine steps."""

    def __init__(self, answers: dict[str, str], length: int = 3) -> None:
        super().__init__({})
        self.references, self.length = answers, length

    def add(self, request_id: str, prompt_tokens: list[int], sampling: Sampling) -> None:
        letter, k = chr(prompt_tokens[0]), int(request_id.rsplit("/", 1)[1])
        right = (k + ord(letter)) % 3 != 0
        text = self.references[letter] if right else "x" * self.length
        self.added.append(request_id)
        self.active[request_id] = [ord(c) for c in text]
        self.most_at_once = max(self.most_at_once, len(self.active))


LETTERS = "abcdefghijklmnop"
ANSWERS = {c: str(i % 10) for i, c in enumerate(LETTERS)}


def sets() -> list[Any]:
    """Two sets of different n over the same letters (each task's sample k answers as SampleEngine says)."""
    return [
        fake_set("first", {c: ANSWERS[c] for c in LETTERS[:10]}, n=3),
        fake_set("second", {c: ANSWERS[c] for c in LETTERS[10:]}, n=4),
    ]


def unsharded(version: int) -> list[SetResult]:
    """The round generated whole in one engine: what every sharded run of it must record."""
    return Evaluator(SampleEngine(ANSWERS), sets(), exact, max_in_flight=5).run(version)  # type: ignore[arg-type]


def replica(client: redis.Redis, name: str, version: int, **board: Any) -> tuple[Evaluator, SampleEngine]:
    engine = SampleEngine(ANSWERS)
    engine.loaded_version = version
    evaluator = Evaluator(
        engine,  # type: ignore[arg-type]
        sets(),
        exact,
        EvalRecorder(None, client, RUN, "shared", name),
        EvalSchedule({"first": 5, "second": 5}, True, client, RUN, name),
        max_in_flight=5,
        board=ShardBoard(client, RUN, name, **{"shard_samples": 7, "lease_s": 5.0, "poll_s": 0.02, **board}),
    )
    return evaluator, engine


def tick(evaluator: Evaluator, engine: SampleEngine) -> None:
    """One turn of a replica's loop as the sampler runs it: an engine step, the deltas in, the pump."""
    for delta in engine.step():
        evaluator.absorb(delta)
    evaluator.pump()


def records(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(eval_results_key(RUN), 0, -1)]


def figures(r: dict[str, Any] | SetResult) -> tuple[Any, ...]:
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k)
    return tuple(get(k) for k in ("set", "version", "n", "tasks", "mean_at_n", "pass_at_n", "reward_mean"))


def generated(engine: SampleEngine) -> set[tuple[str, str, str]]:
    """(set, task, sample) of every request the engine was given."""
    return {tuple(rid.split("/")[-3:]) for rid in engine.added}  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- sharding


def test_pack_cuts_whole_tasks_into_shards_of_at_most_the_size() -> None:
    assert pack([3] * 10 + [4] * 6, 7) == [0, 2, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16]
    assert pack([16, 4, 4], 8) == [0, 1, 3]  # a task larger than a shard is a shard of its own
    with pytest.raises(ValueError, match=r"evaluation\.shard_samples"):
        pack([1], 0)


def test_replicas_serving_the_version_share_a_round_and_record_the_unsharded_accuracy_once(
    redis_client: redis.Redis,
) -> None:
    whole = unsharded(5)
    assert {r.mean_at_n for r in whole} != {r.pass_at_n for r in whole}  # the figures tell samples apart
    replicas = [replica(redis_client, f"sampler-{i}", 5) for i in range(3)]
    assert all(
        evaluator.offer(5) for evaluator, _ in replicas
    )  # every replica takes part, not the claimer only
    deadline = time.monotonic() + 30
    while any(evaluator.busy for evaluator, _ in replicas) and time.monotonic() < deadline:
        for evaluator, engine in replicas:
            tick(evaluator, engine)
    assert not any(evaluator.busy for evaluator, _ in replicas)
    recorded = records(redis_client)
    assert [figures(r) for r in recorded] == [figures(r) for r in whole]  # once, as if generated whole
    assert [r["tokens"] for r in recorded] == [r.tokens for r in whole]
    (recorder,) = [e for e, _ in replicas if e.results]
    assert [r.per_task for r in recorder.results] == [r.per_task for r in whole]
    parts = [generated(engine) for _, engine in replicas]
    assert all(parts) and sum(len(p) for p in parts) == 10 * 3 + 6 * 4  # each sample generated once
    assert set().union(*parts) == {
        (s.name, str(t), str(k)) for s in sets() for t in range(len(s.tasks)) for k in range(s.n)
    }
    assert all(engine.most_at_once <= 5 for _, engine in replicas)
    # a replica that comes to the version later (or restarts) finds nothing left and records nothing again
    late, engine = replica(redis_client, "sampler-3", 5)
    assert not late.offer(5) and late.board is not None and late.board.joined is None
    assert len(records(redis_client)) == 2


def test_a_shard_whose_replica_dies_is_taken_again_and_the_round_still_records_its_accuracy(
    redis_client: redis.Redis,
) -> None:
    whole = unsharded(5)
    (a, a_engine), (b, b_engine) = (
        replica(redis_client, n, 5, lease_s=2.0) for n in ("sampler-0", "sampler-1")
    )
    assert a.offer(5) and b.offer(5)
    assert a.round is not None and list(a.round.shards) == [0]  # its engine is full with shard 0
    tick(a, a_engine)  # a generates part of its shard...
    assert a_engine.active  # ...and dies: its loop never runs again (no renewals, nothing given back)
    deadline = time.monotonic() + 30
    while b.busy and time.monotonic() < deadline:  # b generates every other shard
        tick(b, b_engine)
    assert records(redis_client) == []  # shard 0 is still out: the round is not recorded without it
    assert not any(t[0] == "first" and t[1] in ("0", "1") for t in generated(b_engine))
    while not records(redis_client) and time.monotonic() < deadline:  # a's lease lapses: b takes shard 0
        tick(b, b_engine)
        time.sleep(0.01)
    assert [figures(r) for r in records(redis_client)] == [figures(r) for r in whole]
    assert {("first", "0", "0"), ("first", "1", "2")} <= generated(b_engine)
    assert [r.per_task for r in b.results] == [r.per_task for r in whole]


def test_a_replica_that_moves_on_gives_its_shards_back_at_once(redis_client: redis.Redis) -> None:
    (a, a_engine), (b, b_engine) = (
        replica(redis_client, n, 5, lease_s=60.0) for n in ("sampler-0", "sampler-1")
    )
    assert a.offer(5)
    tick(a, a_engine)
    a_engine.loaded_version = 6  # a newer version was loaded past the hold: a's part is abandoned...
    a.pump()
    assert a.rounds["abandoned"] == 1 and not a.busy
    assert b.offer(5)  # ...and its shard is free at once (no lease to wait out), so b generates the round
    deadline = time.monotonic() + 30
    while not records(redis_client) and time.monotonic() < deadline:
        tick(b, b_engine)
    assert [figures(r) for r in records(redis_client)] == [figures(r) for r in unsharded(5)]
    assert a.board is not None and a.board.held == {}


# ------------------------------------------------------------------------------------ the start-up rule


def gsm8k_like(**evaluation: Any) -> tuple[SamplerConfig, EvaluationConfig]:
    """The 1.5B GSM8K preset's shape: 4 one-GPU replicas, responses up to 2048 tokens, 1319 tasks x 4."""
    sampler = SamplerConfig(replicas=4, n=8, max_tokens=2048, max_model_len=3072, gpus_per_replica=1)
    sets = [{"name": "gsm8k_test", "dataset": "/data/vcpo/gsm8k/test.parquet", "n": 4}]
    return sampler, EvaluationConfig.model_validate({"every": 20, "sets": sets, **evaluation})


def test_the_start_up_refuses_a_shared_round_that_cannot_finish_in_its_hold_and_names_the_figures() -> None:
    sampler, evaluation = gsm8k_like(max_delay_s=60, max_requests_in_flight=64)  # the preset's former figures
    with pytest.raises(ValueError) as refused:
        check_round(sampler, evaluation, {"gsm8k_test": 1319})
    message = str(refused.value)
    for figure in (
        "5276 samples (gsm8k_test: 1319 x 4)",  # samples per round
        "83 shard(s) of at most 64 samples",
        "over 4 engine(s): up to 1344 samples per engine",  # the per-replica share
        "evaluation.max_requests_in_flight = 64",  # requests in flight, beside training's
        "1024 x 64 / (64 + 1024)",
        "2048 tokens at 25 tokens/s per sequence",  # the assumed throughput
        "evaluation.max_delay_s = 60 s",  # the hold
        "raise evaluation.max_delay_s to at least 1885",
    ):
        assert figure in message, (figure, message)
    # the same round with the engine's batch and a hold of its worst case: accepted
    plan = check_round(*gsm8k_like(max_delay_s=180, max_requests_in_flight=2048), {"gsm8k_test": 1319})
    assert plan is not None and plan.waves == 2 and plan.seconds == pytest.approx(2 * 2048 / 25)
    # nothing waits for a dedicated evaluator: never refused
    check_round(*gsm8k_like(max_delay_s=1, placement="dedicated", gpus=1), {"gsm8k_test": 1319})
    # an environment set whose sessions training takes all of cannot run at all
    sampler = SamplerConfig(
        n=16,
        dataset_environment="python",
        environments=[{"name": "python", "builtin": "python", "max_concurrency": 256}],
        max_requests_in_flight=256,
        gpus_per_replica=1,
    )
    evaluation = EvaluationConfig.model_validate(
        {"sets": [{"name": "tir", "dataset": "x.parquet", "environment": "python"}], "max_delay_s": 1e6}
    )
    with pytest.raises(ValueError, match=r"256 sessions per replica .* leave 0 beside training's 256"):
        check_round(sampler, evaluation, {"tir": 30})


def tail_add_evaluator(redis_client: redis.Redis, max_delay_s: float) -> Any:
    """The shared evaluator a replica's start builds (build.make_evaluator) for builtin:tail_add's 200 held-out
    tasks x 4, answers of up to 32 tokens, on an engine whose batch limit is 256 (a CPU engine's)."""
    from services.common.observability import Metrics
    from services.evaluator.build import make_evaluator
    from services.sampler.config import SamplerServiceConfig

    held = {"name": "held", "dataset": "builtin:tail_add", "split": "test", "n": 4, "scorer": "math"}
    cfg = SamplerServiceConfig.model_validate(
        {"sampler": {"max_tokens": 32}, "evaluation": {"sets": [held], "max_delay_s": max_delay_s}}
    )
    engine = FakeEngine({})
    engine.batch_limit = 256  # type: ignore[attr-defined]
    return make_evaluator(cfg, engine, CharEncoder(), Metrics("t"), redis_client, "sampler-0", "shared")  # type: ignore[arg-type]


def test_the_evaluator_refuses_to_start_where_its_round_cannot_finish(redis_client: redis.Redis) -> None:
    """The rule at its call site, the shared evaluator's start, with the sets' real sizes and the engine's
    batch limit: 7 waves of 128 of the 832 samples of a replica, 32 tokens at 20 tokens/s, exceed a 1 s hold."""
    with pytest.raises(ValueError, match=r"800 samples .* up to 832 samples per engine.*max_delay_s = 1 s"):
        tail_add_evaluator(redis_client, max_delay_s=1)


@pytest.mark.slow
def test_a_shared_evaluator_sizes_its_requests_in_flight_to_the_engine(redis_client: redis.Redis) -> None:
    """A hold that covers the worst case (7 x 32 / 20 = 11.2 s): it starts, with as many requests in flight as
    the engine batches (evaluation.max_requests_in_flight = 0), sharing its rounds through a shard board."""
    evaluator = tail_add_evaluator(redis_client, max_delay_s=12)
    try:
        assert evaluator.max_in_flight == 256 and evaluator.board is not None
    finally:
        evaluator.close()


# ------------------------------------------------------------------------------------ the shipped presets

# The published held-out files the GPU presets name (not on this machine): their numbers of tasks
PUBLISHED_TASKS = {
    "/data/vcpo/math-500/math-500.parquet": 500,  # MATH-500
    "/data/vcpo/aime/aime25_with_tool.parquet": 30,  # AIME 2025, I and II
    "/data/vcpo/gsm8k/test.parquet": 1319,  # GSM8K's test split
    # the same sets as the Helm chart's ci/ values files name them, on the release's shared volume
    "/data/eval/math500.jsonl": 500,  # MATH-500
    "/data/eval/aime2025.jsonl": 30,  # AIME 2025, I and II
}
PRESETS = sorted(PRESET_DIR.glob("**/*.toml"))


def layers(preset: Path) -> list[Path]:
    """A preset, on the preset its header says it is layered on (``--config deploy/presets/<base>.toml``)."""
    root = PRESET_DIR.parent.parent
    named = re.findall(r"--config (deploy/presets/\S+\.toml)", preset.read_text())
    bases = [root / p for p in named if root / p != preset]
    return [*bases[:1], preset]


def task_counts(cfg: SystemConfig) -> dict[str, int]:
    from services.common.datasets import load_dataset

    counts = {}
    for spec in cfg.evaluation.sets:
        if spec.dataset.startswith("builtin:"):
            count = len(load_dataset(spec.dataset, "prompt", "answer", split=spec.split))
        else:
            assert spec.dataset in PUBLISHED_TASKS, f"add the number of tasks of {spec.dataset} to the table"
            count = PUBLISHED_TASKS[spec.dataset]
        counts[spec.name] = min(count, spec.limit) if spec.limit else count
    return counts


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(PRESET_DIR)))
def test_every_preset_records_accuracy_on_its_own_hardware_by_the_start_up_rule(preset: Path) -> None:
    cfg = load_config(SystemConfig, layers(preset), env={})
    plan = check_round(
        cfg.sampler, cfg.evaluation, task_counts(cfg)
    )  # refused: a ValueError with the figures
    if cfg.evaluation.sets:
        assert plan is not None and plan.running > 0 and plan.fits, plan
        assert plan_round(cfg.sampler, cfg.evaluation, task_counts(cfg)) == plan
