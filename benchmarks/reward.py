"""Reward service throughput: groups scored per second with 1 and 2 replicas, for math and Countdown.

Each case starts ``R`` reward replica processes (``python -m services.reward``, ``workers`` scoring
processes each) on a local Redis, waits until they are up, then puts ``G`` rollout groups (8 responses each)
on the `rollouts` stream at once and times until all ``G`` scored groups are on `scored`: the whole path
(read, decode, score in worker processes, atomic write+ack) is measured, start-up is not. Math responses
are GSM8K-style reasoning (boxed, "answer is", last-number forms; right and wrong) checked by math-verify;
Countdown responses are equations checked by the AST evaluator. Cases alternate 1, 2, 1, 2, ... replicas
(this machine is shared and noisy: compare ratios from the same run); each figure is the median of the
rounds.

    python benchmarks/reward.py [--quick] [--groups N] [--rounds N] [--workers N]

Prints a table, then as its last line one JSON object: ``groups_per_s`` per case and ``scaling_2_over_1``
per workload (2-replica over 1-replica throughput).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from services.common.redis_server import LocalRedis
from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.reward.config import RewardServiceConfig
from vcpo.v1 import rollout_pb2

ROOT = Path(__file__).resolve().parent.parent
N = 8  # responses per group


def math_group(i: int, rng: random.Random) -> rollout_pb2.TrajectoryGroup:
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 9)
    answer = (a + b) * c
    task = rollout_pb2.Task(
        task_id=f"gsm8k:{i}",
        scorer="math",
        prompt=f"({a}+{b})*{c}?",
        reference=f"First {a}+{b}={a + b}, then times {c}.\n#### {answer:,}",
    )
    group = rollout_pb2.TrajectoryGroup(group_id=f"math-{i}", task=task)
    for j in range(N):
        guess = answer if j % 2 == 0 else answer + rng.randint(1, 50)
        form = j % 4
        endings = (
            f"The answer is \\boxed{{{guess}}}.",
            f"The answer is {guess:,}.",
            f"So {a + b} x {c} = {guess}",
            f"#### {guess}",
        )
        text = f"We add {a} and {b} to get {a + b}. Multiplying by {c} gives {guess}. {endings[form]}"
        group.trajectories.add(text=text, response_tokens=list(range(64)), behaviour_logprobs=[-0.5] * 64)
    return group


def countdown_group(i: int, rng: random.Random) -> rollout_pb2.TrajectoryGroup:
    nums = [rng.randint(1, 20) for _ in range(4)]
    target = (nums[0] + nums[1]) * nums[2] - nums[3]
    task = rollout_pb2.Task(
        task_id=f"countdown:{i}",
        scorer="countdown",
        reference=json.dumps({"target": target, "numbers": nums}),
    )
    group = rollout_pb2.TrajectoryGroup(group_id=f"cd-{i}", task=task)
    for j in range(N):
        eq = f"({nums[0]}+{nums[1]})*{nums[2]}-{nums[3]}"
        if j % 2:  # wrong: uses 100, which is not among the numbers (1..20)
            eq += "+100"
        text = f"Let me try combinations. <answer>{eq}</answer>"
        group.trajectories.add(text=text, response_tokens=list(range(48)), behaviour_logprobs=[-0.5] * 48)
    return group


MAKERS = {"math": math_group, "countdown": countdown_group}


def run_case(
    url: str, run_dir: Path, workload: str, replicas: int, groups: int, workers: int, case: int
) -> float:
    run_id = f"bench-{case}"
    config = run_dir / f"{run_id}.toml"
    config.write_text(
        f'[run]\nrun_id = "{run_id}"\nredis_url = "{url}"\nrun_dir = "{run_dir / run_id}"\n'
        f"[streams]\nblock_ms = 50\nrollouts_maxlen = {groups + 1}\nscored_maxlen = {groups + 1}\n"
        f"[reward]\nworkers = {workers}\ngrpc_port = 0\nmetrics_port = 0\n"
    )
    cfg = RewardServiceConfig.model_validate(
        {
            "run": {"run_id": run_id, "redis_url": url},
            "streams": {"rollouts_maxlen": groups + 1, "scored_maxlen": groups + 1},
        }
    )
    specs = stream_specs(cfg.run, cfg.streams)
    client = redis.Redis.from_url(url)
    StreamConsumer(client, specs["rollouts"], "bench")  # the consumer group exists before the replicas
    command = [sys.executable, "-m", "services.reward", "--config", str(config), "--replica"]
    procs = [
        subprocess.Popen([*command, str(r)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(replicas)
    ]
    try:
        endpoints = [run_dir / run_id / "reward" / f"reward-{r}.endpoints.json" for r in range(replicas)]
        deadline = time.monotonic() + 180
        while not all(p.exists() for p in endpoints):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"a reward replica did not start (case {run_id})")
            time.sleep(0.05)
        rng = random.Random(case)
        batch = [(MAKERS[workload](i, rng), 0) for i in range(groups)]
        StreamProducer(client, specs["rollouts"]).put_many(batch)
        t0 = time.perf_counter()
        while client.xlen(specs["scored"].key) < groups:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a reward replica exited during case {run_id}")
            time.sleep(0.005)
        elapsed = time.perf_counter() - t0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    entries: Any = client.xrange(specs["scored"].key)
    scored = [rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"]) for _, fields in entries]
    rewards = [t.reward.value for g in scored for t in g.trajectories]
    if len({g.group_id for g in scored}) != groups or any(
        t.reward.failed for g in scored for t in g.trajectories
    ):
        raise RuntimeError(f"case {run_id}: groups lost, doubled or failed")
    if abs(statistics.mean(rewards) - 0.5) > 1e-9:  # half the responses are right by construction
        raise RuntimeError(f"case {run_id}: mean reward {statistics.mean(rewards)}, expected 0.5")
    return groups / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small run that takes seconds")
    parser.add_argument("--groups", type=int, default=0, help="groups per case (default 400; quick: 60)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of every case (default 3; quick: 1)")
    parser.add_argument("--workers", type=int, default=1, help="scoring processes per replica")
    args = parser.parse_args()
    groups = args.groups or (60 if args.quick else 400)
    rounds = args.rounds or (1 if args.quick else 3)

    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as server:
        case = 0
        for _ in range(rounds):
            for workload in MAKERS:
                for replicas in (1, 2):
                    case += 1
                    rate = run_case(server.url, Path(tmp), workload, replicas, groups, args.workers, case)
                    figures.setdefault(f"{workload}_{replicas}", []).append(rate)
    rates = {k: statistics.median(v) for k, v in figures.items()}
    print(
        f"{groups} groups x {N} responses per case, {rounds} round(s), {args.workers} worker(s) per replica"
    )
    print(f"{'case':<14}{'groups/s':>10}{'responses/s':>14}  rounds")
    for key, rate in rates.items():
        print(f"{key:<14}{rate:>10.1f}{rate * N:>14.1f}  " + " ".join(f"{r:.1f}" for r in figures[key]))
    scaling = {w: rates[f"{w}_2"] / rates[f"{w}_1"] for w in MAKERS}
    for workload, ratio in scaling.items():
        print(f"{workload}: 2 replicas over 1 = {ratio:.2f}")
    print(
        json.dumps(
            {
                "groups_per_s": {k: round(v, 2) for k, v in rates.items()},
                "scaling_2_over_1": {k: round(v, 3) for k, v in scaling.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
