"""One short run of the chaos tool (deploy/chaos.py) on the local system with the collective weight transport:
one process of each kind SIGKILLed while it trains (a sampler replica, a reward replica, a learner rank, the
weight broker, the local redis-server) and a learner rank hung (SIGSTOPped: its peer's collective times out
after the 30 s chaos sets, and the launcher restarts the group), then the tool's judge: the launcher exited 0 at launcher.max_steps, the
ledger balances (no group lost), no group was trained twice, every trained group was within k, and a restart
of its service was counted for every kill; the report names them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
KINDS = ("sampler", "reward", "learner", "weight_broker", "redis", "learner_hang")


@pytest.mark.timeout(900)
def test_one_kill_of_each_kind_and_the_run_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "chaos"
    cmd = [
        sys.executable,
        "-m",
        "deploy.chaos",
        "--config",
        str(ROOT / "deploy" / "presets" / "local.toml"),
        "--run.run_dir",
        str(run_dir),
        "--kills",
        str(len(KINDS)),
        "--kinds",
        ",".join(KINDS),
        "--gap-s",
        "5,10",
        "--max-steps",
        "200",
        "--seed",
        "3",
        "--weight_broker.transport",
        "collective",
        "--launcher.progress_interval_s",
        "2",
        "--set",
        "evaluation.sets=[]",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840)
    out = done.stdout + done.stderr
    result = json.loads((run_dir / "chaos" / "result.json").read_text())
    assert result["kills_by_kind"] == dict.fromkeys(KINDS, 1), out[-4000:]
    assert result["passed"] and done.returncode == 0, (result["checks"], out[-4000:])
    assert result["groups_trained_twice"] == 0 and result["ledger_problems"] == []
    for kind in KINDS[:-1]:
        assert result["restarts"].get(kind, 0) >= 1, (kind, result["restarts"])
    stalls = result["learner_restarts"]
    assert len(stalls) == 2 and result["restarts"]["learner"] == 2, stalls  # the killed rank and the hung one
    assert all(
        s["seconds"] > 0 and s["reason"] for s in stalls
    )  # the dead rank, or its peer's failed collective
    # the hung rank's peer gave up on their collective (gloo's timeout), and the group came back
    assert any("Timed out" in s["reason"] for s in stalls), stalls
    assert result["longest_step_gap_s"] is not None
    report = (run_dir / "report" / "report.md").read_text()
    assert "## Faults and restarts" in report
    for n, stall in enumerate(stalls, 1):
        assert f"Learner restart {n}: {stall['reason']}" in report, report
    assert "[!!] learner" in (run_dir / "chaos" / "launcher.log").read_text()
