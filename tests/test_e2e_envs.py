"""Multi-turn rollouts through the whole system: an environment in its own process, the launcher's services.

The local preset with every dataset task run as an episode of ``tests/envs/scripted_env.py`` (two turns per
episode, ``turn`` parser), registered from the run file: the sampler's episodes go through reward to the
learner, which trains on them (loss mask and log-probs checked by its batching), and the ledger balances.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_e2e import Launch, _ledger, _reached, _steps

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
STEPS = 6


@pytest.mark.timeout(600)
def test_multi_turn_rollouts_reach_the_learner_and_train(tmp_path: Path) -> None:
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
        )
        launch.wait_for(f"step {STEPS}", _reached(run_dir, STEPS), 420)
        assert launch.finish(180) == 0, launch.output[-4000:]
        assert f"bearer token: {run_dir / 'api_token'}" in launch.output  # where clients find the API
    finally:
        env.kill()
        env.wait(10)
        if env.stdout is not None:
            env.stdout.close()

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    steps_by_group: dict[str, int] = {}
    for call in calls:
        if call["method"] == "step":
            group = call["session_id"].rsplit("/", 1)[0]
            steps_by_group[group] = steps_by_group.get(group, 0) + 1
    steps = _steps(run_dir)
    assert sorted(steps)[:STEPS] == list(range(1, STEPS + 1))
    trained = [g for s in range(1, STEPS + 1) for g in steps[s]["groups"]]
    assert len(trained) == STEPS * 4
    n = json.loads((run_dir / "config.resolved.json").read_text())["sampler"]["n"]
    # every trained group is a multi-turn one: each of its n episodes took two steps in the environment
    assert all(steps_by_group.get(g) == 2 * n for g in trained), {g: steps_by_group.get(g) for g in trained}
    ledger = _ledger(run_dir)
    assert ledger["balanced"], ledger
    summary = json.loads((run_dir / "summary.json").read_text())
    sampler = summary["samplers"][0]
    assert (
        sampler["environment_calls"]["step"] >= 2 * n * len(trained)
        and sampler["turns"] > sampler["groups_emitted"]
    )
