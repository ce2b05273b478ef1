"""The stability experiment (experiments/stability.py): its method mapping, its collapse rule, its report
from synthetic runs, and its --quick mode end to end (a real replay on the tiny model)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from experiments import stability_report
from experiments.stability import KNOWN, METHODS, learner_config, load_preset, method_fields, run_grid
from services.learner.vcpo import objective_config

ROOT = Path(__file__).parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_methods_map_to_the_learner_config_the_docstring_names() -> None:
    preset = load_preset("deploy/presets/local.toml")
    configs = {m: objective_config(learner_config(preset, m)) for m in KNOWN}
    for m in ("no-correction", "tis", "mis"):  # the baselines: GRPO, no ESS step-size rule
        assert (configs[m].objective, configs[m].ess_rule) == ("grpo", "off")
    assert configs["no-correction"].importance_weighting == "none"
    assert configs["tis"].importance_weighting == "truncated" and configs["tis"].truncation == 8.0
    assert configs["mis"].importance_weighting == "masked" and configs["mis"].truncation == 8.0
    for m, weighting in (("vcpo-paper", "paper"), ("vcpo-exact", "exact")):
        c = configs[m]
        assert (c.objective, c.importance_weighting, c.truncation) == ("vcpo", "truncated", 8.0)
        assert (c.ess_rule, c.rho_base, c.baseline_weighting) == ("sqrt", 1.0, weighting)
    # the ablations: each half of VCPO alone
    assert configs["vcpo-paper-no-ess"] == dataclasses.replace(configs["vcpo-paper"], ess_rule="off")
    assert configs["tis-with-ess"] == dataclasses.replace(configs["tis"], ess_rule="sqrt")
    for c in configs.values():  # the rest as the preset leaves them
        assert (c.loss_aggregation, c.std_normalize, c.ppo_clip) == ("seq-mean-token-mean", True, 0.0)


def test_any_registered_objective_joins_the_grid_without_an_edit() -> None:
    """``--objectives`` adds a method per registered objective (the preset's table with that objective) and
    ``--method NAME=TABLE`` any fields; every one is checked as the learner checks it, on one rank (the replay
    is one process, so a batch-baseline objective is valid there although the preset has two ranks)."""
    preset = load_preset("deploy/presets/local.toml")
    grid = method_fields(["tis"], ["rloo", "reinforce"], ['r2 = {objective = "rloo", ess_rule = "off"}'])
    assert grid == {
        "tis": METHODS["tis"],
        "rloo": {"objective": "rloo"},
        "reinforce": {"objective": "reinforce"},
        "r2": {"objective": "rloo", "ess_rule": "off"},
    }
    assert preset.learner.num_ranks == 2
    configs = {m: objective_config(learner_config(preset, m, f)) for m, f in grid.items()}
    assert (configs["reinforce"].objective, configs["r2"].ess_rule) == ("reinforce", "off")
    preset_table = objective_config(preset.learner)  # the rest as the preset leaves them
    assert configs["rloo"] == dataclasses.replace(preset_table, objective="rloo")
    for bad, message in (
        ((["nope"], [], []), "unknown method 'nope'"),
        (([], ["ppo"], []), "--objectives: unknown objective 'ppo'; registered: "),
        (([], [], ["tis={objective = 'rloo'}"]), "'tis' is already a method"),
        (([], [], ["x={objective = "]), "not a TOML inline table"),
        (([], [], ["x"]), "write NAME={field = value, ...}"),
    ):
        with pytest.raises(SystemExit, match=re.escape(message)):
            method_fields(*bad)


def test_resume_refuses_a_method_name_that_now_means_other_fields(tmp_path: Path) -> None:
    """``--method`` names are the user's: resuming a grid where one now has other fields would mix two
    methods' runs in one row of the table."""
    runs_path = tmp_path / "runs.jsonl"
    header = {"plan": {"steps": 3}, "command": "python experiments/stability.py"}
    old = {"method": "mine", "k": 0, "seed": 0, "fields": {"objective": "rloo", "ess_rule": "off"}}
    runs_path.write_text(json.dumps({"header": header}) + "\n" + json.dumps(old) + "\n")
    grid = {"mine": {"objective": "rloo"}}
    with pytest.raises(
        SystemExit, match=r"holds method 'mine' with the fields .*name the new one differently"
    ):
        run_grid(None, grid, [0], [0], runs_path, header, workers=1, resume=True)  # type: ignore[arg-type]


def synthetic_run(
    method: str, k: int, seed: int, *, steps: int = 30, grad: float = 1.0, **change: Any
) -> dict:
    series: dict[str, list[float]] = {
        "reward": [0.4] * steps,
        "ess_ratio": [0.9] * steps,
        "lr_scale": [0.95] * steps,
        "grad_norm": [grad] * steps,
        "loss": [0.1] * steps,
        "step_skipped": [0.0] * steps,
    }
    evals = [[t, 0.4] for t in range(0, steps + 1, 10)]
    for key, value in change.items():
        if key == "evals":
            evals = value
        else:
            series[key] = value
    return {
        "method": method,
        "k": k,
        "seed": seed,
        "fields": METHODS[method],
        "steps": series,
        "evals": evals,
        "seconds": 1.0,
    }


def test_collapse_rule_names_each_reason() -> None:
    healthy = stability_report.summarize(synthetic_run("tis", 4, 0), window=10)
    assert not healthy["collapsed"] and healthy["reasons"] == []
    spike = [1.0] * 29 + [101.0]
    assert stability_report.summarize(synthetic_run("tis", 4, 0, grad_norm=spike), 10)["reasons"] == [
        "grad_spike"
    ]
    below = [[0, 0.4], [10, 0.4], [20, 0.29], [30, 0.29]]  # final 0.29 < 0.4 - 0.1
    assert stability_report.summarize(synthetic_run("tis", 4, 0, evals=below), 10)["reasons"] == ["reward"]
    at = [[0, 0.4], [10, 0.4], [20, 0.31], [30, 0.31]]
    assert not stability_report.summarize(synthetic_run("tis", 4, 0, evals=at), 10)["collapsed"]
    nan = [1.0] * 15 + [math.nan] + [1.0] * 14
    s = stability_report.summarize(synthetic_run("tis", 4, 0, grad_norm=nan), 10)
    assert s["reasons"] == ["nonfinite"] and s["nonfinite_steps"] == 1 and math.isfinite(s["max_grad_norm"])


def test_report_from_synthetic_runs_has_one_row_per_cell(tmp_path: Path) -> None:
    methods, ks, seeds = ["no-correction", "vcpo-paper"], [0, 4], [0, 1]
    runs_path = tmp_path / "runs.jsonl"
    runs = [synthetic_run(m, k, s) for m in methods for k in ks for s in seeds if (m, k) != ("vcpo-paper", 4)]
    runs[0]["steps"]["grad_norm"][5] = math.nan  # no-correction k=0 seed 0: collapsed (nonfinite)
    header = {
        "plan": {
            "steps": 30,
            "eval_every": 10,
            "eval_samples": 1,
            "eval_prompts": 0,
            "ws_steps": 5,
            "dataset": "builtin:digit_add",
            "preset": "p.toml",
        }
    }
    runs_path.write_text("".join(json.dumps(row) + "\n" for row in [{"header": header}, *runs]))
    figures = stability_report.write_report(
        tmp_path,
        runs_path,
        window=10,
        grid=(methods, ks, seeds),
        command="python experiments/stability.py --x",
    )
    assert figures["runs"] == 6 and figures["collapsed"] == {"no-correction": 1, "vcpo-paper": 0}
    report = strict_json((tmp_path / "stability.json").read_text())
    assert [(c["method"], c["k"]) for c in report["cells"]] == [(m, k) for m in methods for k in ks]
    missing = report["cells"][3]
    assert missing["per_seed"] == [] and "final_reward" not in missing  # vcpo-paper k=4: no run yet
    markdown = (tmp_path / "stability.md").read_text()
    assert "| no-correction | 0 | 2 |" in markdown and "1/2 (nonfinite)" in markdown
    assert (
        "| vcpo-paper | 4 | 0 |" in markdown and "1 cell(s) of the grid have no finished run yet" in markdown
    )


@pytest.mark.slow
def test_quick_mode_writes_a_consistent_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable,
        "experiments/stability.py",
        "--quick",
        "--out",
        str(out),
        "--work-dir",
        str(tmp_path / "work"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    methods, ks = ["no-correction", "vcpo-paper"], [0, 16]
    assert figures["runs"] == 4 and set(figures["final_reward"]) == set(methods)

    report = strict_json((out / "stability.json").read_text())
    assert report["grid"] == {"methods": methods, "ks": ks, "seeds": [0]}
    assert [(c["method"], c["k"]) for c in report["cells"]] == [(m, k) for m in methods for k in ks]
    for cell in report["cells"]:
        (run,) = cell["per_seed"]
        for key, value in run.items():
            if isinstance(value, float) and key not in ("final_reward", "best_reward", "ws_reward"):
                assert math.isfinite(value) or "nonfinite" in run["reasons"], (cell["method"], key)
        assert 0 <= run["final_reward"] <= 1 and run["steps"] == 8
        assert run["collapsed"] == bool(run["reasons"])

    markdown = (out / "stability.md").read_text()
    assert "Produced by: `python experiments/stability.py --quick --out" in markdown
    rows = [
        line for line in markdown.splitlines() if line.startswith(("| no-correction |", "| vcpo-paper |"))
    ]
    assert len(rows) == len(methods) * len(ks)
    for name in report["plots"].values():
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)

    runs = stability_report.read_runs(out / "runs.jsonl")
    assert len(runs) == 4
    for run in runs:  # the lag is real: stale rollouts carry importance weights, on-policy ones do not
        assert [t for t, _ in run["evals"]] == [0, 4, 8] and len(run["steps"]["reward"]) == 8
        assert run["steps"]["lag"] == [float(min(t, run["k"])) for t in range(8)]
        if run["k"] == 0:
            assert min(run["steps"]["ess_ratio"]) > 0.999
        else:
            assert min(run["steps"]["ess_ratio"][2:]) < 0.999


def test_the_committed_results_parse_and_cover_the_default_grid() -> None:
    results = ROOT / "docs/results/stability"
    report = strict_json((results / "stability.json").read_text())
    assert report["grid"]["methods"] == list(METHODS) and report["grid"]["ks"] == [0, 4, 16, 64, 128]
    assert len(report["cells"]) == len(METHODS) * 5
    assert all(len(c["per_seed"]) == len(report["grid"]["seeds"]) for c in report["cells"])
    assert report["runs"] == len(stability_report.read_runs(results / "runs.jsonl"))
    markdown = (results / "stability.md").read_text()
    assert "Produced by: `python experiments/stability.py`" in markdown
    assert sum(line.startswith(tuple(f"| {m} |" for m in METHODS)) for line in markdown.splitlines()) == 25
    for name in report["plots"].values():
        assert (results / name).read_bytes().startswith(PNG_SIGNATURE)
    readme = (results / "README.md").read_text()
    for link in re.findall(r"\]\(([^)]+)\)", readme):  # the findings' links point at files that exist
        assert (results / link).exists(), link


def test_the_replay_trains_lora_adapters_alone_and_samples_from_them(tiny_model_dir: Path) -> None:
    """With ``lora`` the replay's learner and sampler carry the learner's adapters (services/learner/lora.py):
    the optimizer holds the adapters alone, a step leaves every base weight as it was and moves the adapters,
    and the sampler loads each version, adapters included."""
    import types

    import torch

    from experiments.replay import Replay, ReplaySettings
    from services.common.lora import LoraConfig
    from services.learner.config import LearnerConfig
    from services.learner.vcpo import objective_config

    settings = ReplaySettings(groups_per_step=2, n=4, max_tokens=8, lr=1e-2)
    lora = LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    replay = Replay(
        tiny_model_dir,
        "builtin:tail_add",
        objective_config(LearnerConfig()),
        seed=0,
        lag=1,
        settings=settings,
        lora=lora,
    )
    # the untrained model scores 0 on every task: a reward by the response's length gives the groups a signal
    replay.score = lambda scored: types.SimpleNamespace(value=float(len(scored.response) % 2))
    before = {k: v.clone() for k, v in replay.model.state_dict().items()}
    trained = {n for n, p in replay.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {id(p) for p in replay.trained} == {id(p) for p in replay.model.parameters() if p.requires_grad}
    for _ in range(3):
        record = replay.step()
        assert record["update_skipped"] == 0.0 and record["zero_signal_groups"] < settings.groups_per_step
    after = replay.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".lora_A." in k or ".lora_B." in k for k in moved), sorted(moved)[:5]
    assert any(".lora_B." in k for k in moved)  # B starts at zero: the adapters' output changed
    # the sampler serves version t - lag, adapters included
    replay.sampler.load_state_dict(replay.versions[replay.t])
    assert all(torch.equal(replay.sampler.state_dict()[k], after[k]) for k in after)
