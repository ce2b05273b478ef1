"""Multi-turn rollouts, LoRA and a dedicated evaluator through the whole system, in one launch.

The local preset with every dataset task run as an episode of ``tests/envs/scripted_env.py`` (two turns per
episode, ``turn`` parser), registered from the run file: the sampler's episodes go through reward to the
learner, which trains on them (loss mask and log-probs checked by its batching), and the ledger balances.
The learner trains LoRA adapters (``[learner.lora]``), so every version is an adapter: the sampler and the
evaluator fetch each from the broker and load it into their engines' LoRA slot.
Beside them, ``evaluation.placement = "dedicated"``: its own Ray actor and vLLM engine follow the published
versions and evaluate the held-out set (which is not an environment's), while the samplers only train.
(The shared placement runs end to end in tests/test_e2e.py, whose local preset evaluates on the sampler.)
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_e2e import Launch, _audit, _ledger, _steps

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
STEPS = 80
EVERY = 30
LORA_RANK = 8


@pytest.mark.timeout(900)
def test_multi_turn_rollouts_train_while_a_dedicated_evaluator_evaluates_due_versions(tmp_path: Path) -> None:
    log = tmp_path / "env-calls.jsonl"
    env = subprocess.Popen(
        [sys.executable, "tests/envs/scripted_env.py", "--port", "0", "--steps", "2", "--log", str(log)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert env.stdout is not None
        endpoint = env.stdout.readline().split()[-1]
        extra = tmp_path / "env.toml"
        extra.write_text(
            '[sampler]\ndataset_environment = "game"\nmax_tokens = 12\n\n'
            f'[[sampler.environments]]\nname = "game"\nendpoint = "{endpoint}"\ntool_parser = "turn"\n'
            'scorer = "math"\nmax_turns = 4\nstep_timeout_seconds = 10\n'
        )
        run_dir = tmp_path / "run"
        launch = Launch(
            run_dir,
            "--config",
            str(extra),
            "--launcher.max_steps",
            str(STEPS),
            "--launcher.warm_start_steps",
            "0",
            "--evaluation.placement",
            "dedicated",
            "--evaluation.every",
            str(EVERY),
            "--learner.lora.rank",
            str(LORA_RANK),
        )
        assert launch.finish(timeout_s=840) == 0, launch.output[-6000:]
        assert f"bearer token: {run_dir / 'api_token'}" in launch.output  # where clients find the API
    finally:
        env.kill()
        env.wait(10)
        if env.stdout is not None:
            env.stdout.close()

    # the episodes: every trained group is a multi-turn one, each of its n episodes two steps in the environment
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    steps_by_group: dict[str, int] = {}
    for call in calls:
        if call["method"] == "step":
            group = call["session_id"].rsplit("/", 1)[0]
            steps_by_group[group] = steps_by_group.get(group, 0) + 1
    steps = _steps(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    trained = _audit(run_dir)
    assert len(trained) == STEPS * 4
    n = json.loads((run_dir / "config.resolved.json").read_text())["sampler"]["n"]
    assert all(steps_by_group.get(g) == 2 * n for g in trained), {
        g: steps_by_group.get(g) for g in trained if steps_by_group.get(g) != 2 * n
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    sampler = summary["samplers"][0]
    assert (
        sampler["environment_calls"]["step"] >= 2 * n * len(trained)
        and sampler["turns"] > sampler["groups_emitted"]
    )

    # the dedicated evaluator
    assert "by a dedicated evaluator (0 GPU)" in launch.output
    assert re.search(r"\[ok\] evaluator\s+stopped", launch.output), launch.output[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval"]
    versions = [x["version"] for x in evals]
    assert versions and versions[0] == 0 and versions == sorted(set(versions)), versions
    # version 0, then one version per bucket of EVERY at most (the first the evaluator met in it)
    assert (
        len(versions) >= 2 and len({v // EVERY for v in versions}) == len(versions) and versions[-1] <= STEPS
    )
    assert all((x["where"], x["replica"], x["tasks"]) == ("dedicated", "evaluator", 200) for x in evals)
    rounds = summary["evaluator"][0]
    assert (
        rounds["rounds"]["done"] >= len(versions)
        and rounds["evaluated_versions"][: len(versions)] == versions
    )
    # the samplers ran no evaluation and wrote only training groups: the ledger balances
    assert all("evaluation_rounds" not in s for s in summary["samplers"])
    assert _ledger(run_dir)["balanced"]
    ends = json.loads((run_dir / "evaluator" / "evaluator.endpoints.json").read_text())
    assert ends["metrics_url"].startswith("http://")
    assert (run_dir / "logs" / "evaluator.log").exists()

    # every version was an adapter (publish = "adapter"), fetched whole by the sampler and the evaluator
    from services.common.lora import LoraConfig, adapter_shapes

    model = json.loads((run_dir / "config.resolved.json").read_text())["run"]["model"]
    shapes = adapter_shapes(model, LoraConfig(rank=LORA_RANK))  # the model the run built and trained from
    adapter_bytes = 4 * sum(math.prod(s) for s in shapes.values())  # fp32 on the CPU
    for log_name in ("sampler-0.log", "evaluator.log"):
        fetched = re.findall(
            r"fetched version (\d+) \((\d+) bytes", (run_dir / "logs" / log_name).read_text()
        )
        assert fetched and {int(b) for _, b in fetched} == {adapter_bytes}, (log_name, fetched[:3])
