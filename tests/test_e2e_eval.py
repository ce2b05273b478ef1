"""The dedicated evaluator end to end: the launcher on the local preset with ``evaluation.placement =
"dedicated"`` (its own Ray actor and vLLM engine following the published versions), real everything.

(The shared placement runs end to end in tests/test_e2e.py, whose local preset evaluates on the sampler.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_e2e import Launch, _ledger, _steps

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 120


@pytest.mark.timeout(900)
def test_a_dedicated_evaluator_evaluates_due_versions_while_the_samplers_only_train(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch = Launch(
        run_dir,
        "--launcher.max_steps",
        str(STEPS),
        "--launcher.warm_start_steps",
        "0",
        "--evaluation.placement",
        "dedicated",
        "--evaluation.every",
        "50",
    )
    assert launch.finish(timeout_s=840) == 0, launch.output[-6000:]
    assert "by a dedicated evaluator (0 GPU)" in launch.output
    assert re.search(r"\[ok\] evaluator\s+stopped", launch.output), launch.output[-3000:]

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval"]
    versions = [x["version"] for x in evals]
    assert versions and versions[0] == 0 and versions == sorted(set(versions)), versions
    # version 0, then one version per bucket of 50 at most (the first the evaluator met in it)
    assert len(versions) >= 2 and len({v // 50 for v in versions}) == len(versions) and versions[-1] <= STEPS
    assert all((x["where"], x["replica"], x["tasks"]) == ("dedicated", "evaluator", 200) for x in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = summary["evaluator"][0]
    assert (
        rounds["rounds"]["done"] >= len(versions)
        and rounds["evaluated_versions"][: len(versions)] == versions
    )
    # the samplers ran no evaluation and wrote only training groups: the ledger balances
    assert all("evaluation_rounds" not in s for s in summary["samplers"])
    assert _ledger(run_dir)["balanced"] and max(_steps(run_dir)) == STEPS
    ends = json.loads((run_dir / "evaluator" / "evaluator.endpoints.json").read_text())
    assert ends["metrics_url"].startswith("http://")
    assert (run_dir / "logs" / "evaluator.log").exists()
