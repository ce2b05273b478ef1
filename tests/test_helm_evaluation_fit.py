"""Every shipped Helm values file records held-out accuracy by the evaluator's start-up rule.

The chart's values.yaml and every helm/vcpo-rl/ci/*.yaml (globbed, as tests/test_shipped_fit.py finds them) is
rendered by the chart, and the run file it gives the launcher (the run-config ConfigMap, read back as the
launcher reads it) is put to the rule each sampler applies when it builds its shared evaluator
(services/evaluator/build.py ``make_evaluator`` -> services/evaluator/capacity.py ``check_round``): a shared
round that cannot finish inside ``evaluation.max_delay_s`` at the assumed throughput is refused, and every
sampler of the release with it. The held-out files the values name are on the release's volume, not here: their
numbers of tasks come from the table the presets' test uses (tests/test_evaluation_shards.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.evaluator.capacity import check_round
from tests.test_evaluation_shards import task_counts
from tests.test_shipped_fit import ROOT, VALUES_FILES, shipped

NAMES = [p.relative_to(ROOT).as_posix() for p in VALUES_FILES]


def test_every_values_file_is_taken() -> None:
    assert "helm/vcpo-rl/values.yaml" in NAMES
    assert "helm/vcpo-rl/ci/environments-values.yaml" in NAMES
    assert len(NAMES) == 1 + len(list((ROOT / "helm" / "vcpo-rl" / "ci").glob("*.yaml")))


@pytest.mark.parametrize("name", NAMES)
def test_every_values_file_records_accuracy_by_the_start_up_rule(name: str, tmp_path: Path) -> None:
    """The run file the chart renders passes the samplers' start-up rule: its heaviest shared round, on the
    hardware its engines hold, finishes inside the hold, with at least one evaluation sample running."""
    cfg = shipped(name, tmp_path).cfg
    try:
        plan = check_round(cfg.sampler, cfg.evaluation, task_counts(cfg))
    except ValueError as exc:
        pytest.fail(f"{name}: every sampler would refuse to start: {exc}")
    if cfg.evaluation.sets:
        assert plan is not None and plan.running > 0 and plan.fits, plan
