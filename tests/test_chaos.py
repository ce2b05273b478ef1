"""The chaos tool's parts that need no running system: which process is which kind, the last learner step,
and its refusals of bad arguments. The tool itself runs in tests/test_e2e_chaos.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.chaos import classify, judge, last_step, main, processes


@pytest.mark.parametrize(
    ("title", "kind"),
    [
        ("ray::SamplerActor.run", "sampler"),
        ("ray::SamplerActor", "sampler"),
        ("ray::LearnerRankActor.run", "learner"),
        ("ray::WeightBrokerActor", "weight_broker"),
        ("ray::ServeReplica:vcpo-reward:RewardDeployment", "reward"),
        ("/usr/bin/redis-server 127.0.0.1:51207", "redis"),
        ("redis-server *:6379", "redis"),
        ("ray::ServeController", None),  # Ray's and Serve's own processes are never killed
        ("ray::ProxyActor", None),
        ("ray::EvaluatorActor.run", None),
        ("/usr/bin/python3 -m deploy.launch", None),
        ("", None),
    ],
)
def test_processes_are_told_apart_by_their_titles(title: str, kind: str | None) -> None:
    assert classify(title) == kind


def test_descendants_are_found_by_kind(tmp_path: Path) -> None:
    """A child that renames itself as Ray names its workers is found under its parent, and only there."""
    script = "import setproctitle, time; setproctitle.setproctitle('ray::WeightBrokerActor'); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        import os
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and child.pid not in processes(os.getpid())["weight_broker"]:
            time.sleep(0.1)
        assert processes(os.getpid())["weight_broker"] == [child.pid]
        assert processes(child.pid)["weight_broker"] == []  # not among its own descendants
        os.kill(child.pid, signal.SIGSTOP)  # a process chaos hung already is not a target again
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and processes(os.getpid())["weight_broker"]:
            time.sleep(0.1)
        assert processes(os.getpid())["weight_broker"] == []
    finally:
        child.kill()
        child.wait()


def test_the_last_step_is_read_from_the_audit_log(tmp_path: Path) -> None:
    assert last_step(tmp_path) == 0
    path = tmp_path / "learner" / "steps.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "tru')
    assert last_step(tmp_path) == 3  # a line still being written is skipped


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kinds", "sampler,gpu"], "--kinds: unknown ['gpu']"),
        (["--gap-s", "10"], "--gap-s must be MIN,MAX"),
        (["--gap-s", "20,10"], "need 0 <= MIN <= MAX"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--run.run_dir", str(tmp_path / "run"), "--max-steps", "10", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_directory_that_holds_a_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "steps.jsonl").write_text("")
    with pytest.raises(SystemExit):
        main(["--run.run_dir", str(tmp_path), "--max-steps", "10"])
    assert "holds a run already" in capsys.readouterr().err


def test_the_judge_fails_a_run_that_lost_or_repeated_a_group_or_missed_a_restart() -> None:
    ledger = {
        "balanced": True,
        "trained_in_audit_log": 1200,
        "distinct_trained": 1200,
        "max_trained_lag": 2,
        "k": 2,
    }
    kills = {"learner": 2, "redis": 1}
    good = judge(0, 300, 300, ledger, {"learner": 2, "redis": 1, "sampler": 1}, kills)
    assert all(good.values()) and len(good) == 6
    failed = [
        judge(1, 300, 300, ledger, {"learner": 2, "redis": 1}, kills),
        judge(0, 300, 250, ledger, {"learner": 2, "redis": 1}, kills),
        judge(0, 300, 300, ledger | {"balanced": False}, {"learner": 2, "redis": 1}, kills),
        judge(0, 300, 300, ledger | {"trained_in_audit_log": 1201}, {"learner": 2, "redis": 1}, kills),
        judge(0, 300, 300, ledger | {"max_trained_lag": 3}, {"learner": 2, "redis": 1}, kills),
        judge(0, 300, 300, {}, {"learner": 2, "redis": 1}, kills),  # no ledger at all
    ]
    for checks in failed:
        assert not all(checks.values()), checks
    missed = judge(0, 300, 300, ledger, {"learner": 1}, kills)
    assert [name for name, ok in missed.items() if not ok] == [
        "a restart counted for every kill (missing: {'learner': 1, 'redis': 1})"
    ]
    # a hung learner rank is one of the learner's faults: its group must have been restarted for it too
    hangs = {"learner": 1, "learner_hang": 1}
    assert all(judge(0, 300, 300, ledger, {"learner": 2}, hangs).values())
    assert not all(judge(0, 300, 300, ledger, {"learner": 1}, hangs).values())


def test_a_hang_shortens_the_collective_timeout_unless_one_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With learner_hang among the kinds, the run's learner.collective_timeout_s is 30 s (a hung rank's peer
    gives up after it, and the launcher restarts the group), unless the arguments set one."""
    import deploy.chaos as chaos

    seen: list[list[str]] = []

    def run(self: chaos.Chaos, launcher_args: list[str]) -> dict[str, bool]:
        seen.append(launcher_args)
        return {"passed": True}

    monkeypatch.setattr(chaos.Chaos, "run", run)
    for n, extra in enumerate(([], ["--learner.collective_timeout_s", "45"], ["--kinds", "sampler"])):
        with pytest.raises(SystemExit):
            main(["--run.run_dir", str(tmp_path / f"run{n}"), "--max-steps", "10", *extra])
    default, given, no_hang = seen
    assert default[:2] == ["--learner.collective_timeout_s", str(chaos.HANG_TIMEOUT_S)]
    assert given.count("--learner.collective_timeout_s") == 1 and "45" in given
    assert "--learner.collective_timeout_s" not in no_hang
