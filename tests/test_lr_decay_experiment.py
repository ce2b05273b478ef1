"""experiments/lr_decay.py's logic: which schedules it replays and how it compares them (the runs themselves
are the learner's real step in experiments/replay.py, tested with the stability experiment)."""

from __future__ import annotations

import pytest

from experiments.lr_decay import rise, schedule_fields, summarize
from experiments.stability import load_preset


def test_schedules_are_read_from_their_names_and_the_preset() -> None:
    preset = load_preset("deploy/presets/local.toml")
    le = preset.learner
    assert schedule_fields("constant", preset)["lr_decay"] == "constant"
    assert schedule_fields("preset", preset) == {
        "lr_decay": le.lr_decay,
        "lr_decay_steps": le.lr_decay_steps,
        "lr_min_ratio": le.lr_min_ratio,
    }
    assert le.lr_decay == "linear" and le.lr_decay_steps > 0  # what the experiment was made to justify
    assert schedule_fields("cosine:300", preset) == {
        "lr_decay": "cosine",
        "lr_decay_steps": 300,
        "lr_min_ratio": le.lr_min_ratio,
    }
    for bad in ("linear", "linear:0", "linear:x", "step:10"):
        with pytest.raises(SystemExit, match="unknown schedule"):
            schedule_fields(bad, preset)


def test_the_summary_compares_each_seed_with_the_constant_rate() -> None:
    def run(schedule: str, seed: int, final: float) -> dict[str, object]:
        return {
            "schedule": schedule,
            "seed": seed,
            "rewards": [0.1] * 50 + [0.3] * 50,
            "evals": [(50, 0.2), (100, final)],
        }

    runs = [
        run("constant", 0, 0.40),
        run("constant", 1, 0.50),
        run("preset", 0, 0.45),
        run("preset", 1, 0.48),
    ]
    out = summarize(runs, ["constant", "preset"])
    assert out["preset"]["final_per_seed"] == [0.45, 0.48]
    assert out["preset"]["seeds_above_constant"] == 1  # seed 0 above, seed 1 below
    assert out["preset"]["heldout_mean_at_n"] == {"50": 0.2, "100": pytest.approx(0.465)}
    assert out["constant"]["reward_rise_mean"] == pytest.approx(0.2)
    assert rise([0.0, 1.0]) == 1.0  # shorter than two windows: halves
