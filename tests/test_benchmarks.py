"""Benchmarks run (quick mode) and end with one JSON object of headline figures, as STYLE.md asks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
