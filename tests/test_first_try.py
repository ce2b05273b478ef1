"""What a newcomer's first commands do: nothing they did not ask for is deleted or overwritten, and the example
clients find the local run by themselves (its sampler's free port) or say what is missing.

scripts/setup.sh's first-try behaviour (the CPU build of torch, the remembered route) is in
tests/test_setup_script.py; the example clients against a real sampler in tests/test_sampler_envs.py and
tests/test_node_example.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# A run directory that does not lead to a live sampler, and what the example clients must say about it:
# (name, make the directory's files, the fragments of the error). ``{run}`` is the run directory.
def _no_endpoints(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)


def _endpoints(run: Path, pid: int, port: int = 1) -> None:
    (run / "sampler").mkdir(parents=True, exist_ok=True)
    ends = {"grpc_port": port, "metrics_url": "http://127.0.0.1:1", "pid": pid}
    (run / "sampler" / "sampler-0.endpoints.json").write_text(json.dumps(ends))


def _dead_sampler(run: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID that was a process and is not one now
    _endpoints(run, gone.pid)


def _tls_run(run: Path) -> None:
    _endpoints(run, os.getpid())
    sampler = {"api_token": "", "api_token_file": "", "api_tls": {"cert_file": "/pki/server.pem"}}
    (run / "config.resolved.json").write_text(json.dumps({"sampler": sampler}))


def _token_in_config(run: Path) -> None:
    _endpoints(run, os.getpid())
    (run / "config.resolved.json").write_text(json.dumps({"sampler": {"api_token": "**********"}}))


NO_RUN = [
    ("no run", _no_endpoints, ["{run}/sampler/sampler-0.endpoints.json does not exist", "--sampler"]),
    ("stopped run", _dead_sampler, ["{run} is not up", "{run}/sampler/sampler-0.endpoints.json"]),
    ("tls run", _tls_run, ["sampler.api_tls in {run}/config.resolved.json", "--tls-ca", "/pki/server.pem"]),
    ("token in config", _token_in_config, ["sampler.api_token", "--token-file"]),
]


def check_no_run(command: list[str], cwd: Path, tmp_path: Path) -> None:
    """``command`` (an example client, --run-dir and the rest appended) for each of NO_RUN: it exits 2 before
    dialling anything, with an error that names the file and the flag to use."""
    for name, make, fragments in NO_RUN:
        run = tmp_path / name.replace(" ", "-")
        make(run)
        done = subprocess.run(
            [*command, "--run-dir", str(run), "--env-endpoint", "127.0.0.1:1", "--watch-s", "0"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        for fragment in fragments:
            assert fragment.format(run=run) in done.stderr, (name, done.stderr)


def test_the_python_example_client_says_what_is_missing_when_its_run_is_not_up(tmp_path: Path) -> None:
    check_no_run([sys.executable, "examples/submit_tasks.py"], ROOT, tmp_path)
