"""What a newcomer's first commands do to their files: nothing they did not ask for is deleted or overwritten."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(target: str) -> str:
    """The commands ``make <target>`` would run (``make -n``), without running them."""
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_clean_never_deletes_a_run_and_clean_runs_says_what_it_deletes() -> None:
    clean = _dry_run("clean")
    assert "rm -rf" in clean and "gen" in clean.split()
    assert "runs" not in clean.replace("-", " ").split(), clean
    runs = _dry_run("clean-runs")
    assert "rm -rf runs" in runs and "deleting every run" in runs, runs


def test_the_stability_experiment_writes_under_runs_unless_told_to_write_the_committed_results() -> None:
    from experiments.stability import parse_args

    default = Path(parse_args([]).out)
    assert default.parts[0] == "runs", default
    committed = ROOT / "docs" / "results" / "stability"
    assert (committed / "runs.jsonl").exists()  # what the default must not write over
    assert Path(parse_args(["--out", "docs/results/stability"]).out) == committed.relative_to(ROOT)
