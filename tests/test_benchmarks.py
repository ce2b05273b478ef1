"""Benchmarks run (quick mode) and end with one JSON object of headline figures, as STYLE.md asks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_streams_benchmark_quick_mode_prints_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/streams.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.split()[:1] == ["saturated"] for line in lines)  # the table
    figures = json.loads(lines[-1])
    for key in ("groups_per_s", "saturated_p50_ms", "paced_1000_per_s_p99_ms", "batched_over_unbatched"):
        assert figures[key] > 0
    assert figures["group_bytes"] > 20_000  # realistic groups: 8 x 512 tokens with log-probs


def test_vcpo_step_benchmark_quick_mode_prints_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/vcpo_step.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("brute-shared") for line in lines)  # the table
    figures = json.loads(lines[-1])
    for key in ("vcpo_over_grpo", "brute_over_vcpo", "brute_shared_over_vcpo"):
        assert figures[key] > 0
    assert figures["max_rel_err"] < 1e-4  # the norm pass agrees with brute force in float32


@pytest.mark.gpu
def test_vcpo_step_benchmark_runs_on_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/vcpo_step.py", "--quick", "--device", "cuda"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["max_rel_err"] < 1e-3


def test_weight_sync_benchmark_quick_mode_prints_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/weight_sync.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr  # non-zero also if any fetcher got different bytes
    lines = out.stdout.strip().splitlines()
    assert "all fetchers' digests equal the publisher's" in lines
    figures = json.loads(lines[-1])
    assert figures["broker_over_socket"] > 0 and figures["peak_rss_over_model"] > 0
