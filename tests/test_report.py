"""The run report: plots, report.md and report.json from synthetic (and damaged) run directories."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.progress import progress_line
from deploy.report import ReportPaths, write_report
from deploy.report_eval import load_evaluation, plot_accuracy, table_points
from deploy.report_plots import PLOT_NAMES

ROOT = Path(__file__).parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_line(step: int, reward: float, lags: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "version": step,
        "time": 1000.0 + 3 * step,
        "groups": [f"g{step}-{i}" for i in range(len(lags))],
        "lags": lags,
        "reward_mean": reward,
        "dropped": [],
        "metrics": {"ess_ratio": 0.8, "lr_scale": 0.5, "grad_norm": float(step), "loss": 0.1, "ess": 10.0},
        "timings": {"step_s": 1.0, "publish_s": 0.1, "tokens_all_ranks": 512.0},
    } | extra


def write_lines(path: Path, rows: list[Any], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def progress_lines(n: int = 10) -> list[dict[str, Any]]:
    return [
        {
            "time": 1000.0 + 5 * i,
            "elapsed_s": 5.0 * i,
            "step": i,
            "version": i,
            "reward_mean": None,
            "ess_ratio": None,
            "lag_mean": None,
            "throughput": {
                "sampler_tokens_per_s": 1000.0 + 100 * i,
                "reward_groups_per_s": 2.0,
                "learner_tokens_per_s": None if i < 2 else 500.0,  # not reported yet at first
            },
            "ledger": {"rollouts_added": 4 * i, "scored_added": 4 * i, "groups_trained": 4 * i},
        }
        for i in range(n)
    ]


def eval_line(name: Any, version: Any, mean: Any, passed: Any, n: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "eval",
        "set": name,
        "version": version,
        "mean_at_n": mean,
        "pass_at_n": passed,
        "n": n,
        "tasks": 20,
        "reward_mean": mean,
        "train_seconds": 3.0 * version if type(version) is int else None,
        "gpu_hours": 0.0,
        "time": 1000.0,
        "eval_seconds": 1.5,
        "where": "shared",
        "failed_scores": 0,
    } | extra


# (version, mean@8, pass@8) of digit_add and (version, mean@4, pass@4) of arith_hard: digit_add is best at
# version 10 and ends lower; arith_hard improves to its last version
DIGIT_ADD = [(0, 0.10, 0.50), (5, 0.30, 0.70), (10, 0.55, 0.90), (15, 0.45, 0.85), (20, 0.40, 0.80)]
ARITH_HARD = [(0, 0.05, 0.15), (10, 0.20, 0.35), (20, 0.25, 0.45)]


def metrics_lines() -> list[dict[str, Any]]:
    """Train lines for steps 1..20, the evaluations of both sets in time order, and one other kind."""
    train = [
        {"kind": "train", "step": s, "version": s, "time": 1000.0 + 3 * s, "train_seconds": 3.0 * s}
        for s in range(1, 21)
    ]
    evals = [eval_line("digit_add", v, m, p) for v, m, p in DIGIT_ADD]
    evals += [eval_line("arith_hard", v, m, p, n=4) for v, m, p in ARITH_HARD]
    evals.sort(key=lambda row: row["version"])
    return [*train, *evals, {"kind": "note", "text": "resumed"}]


def make_run(run_dir: Path, metrics: bool = True) -> Path:
    """20 steps with reward step/20, lags s % 3 and 0 (within k = 2), one group dropped at lag 5; and
    the metrics log of two validation sets evaluated every 5 or 10 versions."""
    rows = [step_line(s, s / 20, [s % 3, 0]) for s in range(1, 21)]
    rows[9]["dropped"] = [{"group_id": "old", "lag": 5, "reason": "stale"}]
    write_lines(run_dir / "learner" / "steps.jsonl", rows)
    write_lines(run_dir / "progress.jsonl", progress_lines())
    if metrics:
        write_lines(run_dir / "metrics.jsonl", metrics_lines())
    return run_dir


def report(run_dir: Path, **summary: Any) -> tuple[str, dict[str, Any]]:
    paths = write_report(run_dir, summary or None)
    return paths.markdown.read_text(), json.loads(paths.json.read_text())


LEDGER = {"balanced": True, "rollouts_added": 120, "scored_added": 120, "groups_trained": 116}
Full = tuple[ReportPaths, str, dict[str, Any]]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Full:
    """One report of the synthetic run with a full summary, shared by the tests that only read it."""
    run_dir = make_run(tmp_path_factory.mktemp("run"))
    summary = {"run_id": "synthetic", "k": 2, "wall_s": 61.5, "stopped_by": "max_steps", "ledger": LEDGER}
    paths = write_report(run_dir, summary)
    return paths, paths.markdown.read_text(), json.loads(paths.json.read_text())


def test_writes_every_plot_as_a_png_and_embeds_it(full: Full) -> None:
    from matplotlib.image import imread

    paths, md, _ = full
    assert paths.directory.name == "report"
    assert set(paths.plots) == set(PLOT_NAMES) and paths.skipped == {}
    for name, path in paths.plots.items():
        assert path == paths.directory / f"{name}.png"
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1024, path
        assert imread(path).ndim == 3  # matplotlib reads it back as an image
        assert f"![{name}]({name}.png)" in md
    assert set(paths.written()) == {*paths.plots.values(), paths.markdown, paths.json}


def test_headline_figures_are_computed_from_the_steps(full: Full) -> None:
    _, md, figures = full
    # 20 steps -> first and last 2: (0.05 + 0.10) / 2 and (0.95 + 1.00) / 2
    assert figures["reward"] == {
        "start": pytest.approx(0.075),
        "end": pytest.approx(0.975),
        "change": pytest.approx(0.9),
        "window_steps": 2,
        "steps_with_reward": 20,
    }
    assert "| reward at the start (mean of the first 2 steps) | 0.0750 |" in md
    assert "| reward at the end (mean of the last 2 steps) | 0.9750 |" in md
    assert "| reward change | +0.9000 |" in md
    assert figures["grad_norm"] == {"mean": pytest.approx(10.5), "max": 20.0}
    assert "| grad norm mean / max | 10.5000 / 20.0000 |" in md
    assert "| ESS ratio mean / min | 0.8000 / 0.8000 |" in md and "| LR scale mean | 0.5000 |" in md
    assert figures["steps"]["count"] == 20 and figures["steps"]["last_version"] == 20
    assert "| run id | synthetic |" in md and "| stopped by | max_steps |" in md
    assert "| wall time | 61.5 s (1.0 min) |" in md
    # sampler: mean of 1000..1900; learner: only the 8 samples where it had reported
    assert figures["throughput"]["sampler_tokens_per_s"] == pytest.approx(1450.0)
    assert figures["throughput"]["learner_tokens_per_s"] == pytest.approx(500.0)
    assert "| sampler | 1,450.0 tokens/s |" in md and "| reward | 2.0 groups/s |" in md


def test_a_dropped_group_past_k_does_not_break_the_bound(full: Full) -> None:
    _, md, figures = full
    stal = figures["staleness"]
    # JSON keys are strings; lags s % 3 and 0 over steps 1..20
    assert stal["trained"] == {"0": 26, "1": 7, "2": 7} and stal["dropped"] == {"5": 1}
    assert stal["bound_held"] is True and stal["trained_over_k"] == 0 and stal["max_lag"] == 5
    assert "| 5 | 0 | 1 |" in md
    assert (
        "Max lag seen: 5 (trained groups: 2) vs k = 2: the bound held for every trained group (40 groups)."
        in md
    )
    assert "1 dropped groups had lag > k" in md and "stale: 1" in md


def test_ledger_from_the_summary_is_a_table_with_its_balance(full: Full) -> None:
    _, md, figures = full
    assert figures["ledger"] == LEDGER and figures["ledger_source"] == "the summary"
    assert "| rollouts_added | 120 |" in md and "| groups_trained | 116 |" in md and "Balanced: yes." in md


def test_a_trained_group_past_k_violates_the_bound(tmp_path: Path) -> None:
    write_lines(tmp_path / "learner" / "steps.jsonl", [step_line(1, 0.1, [0, 1]), step_line(2, 0.2, [3, 1])])
    md, figures = report(tmp_path, k=2)
    assert figures["staleness"]["bound_held"] is False and figures["staleness"]["trained_over_k"] == 1
    assert "the bound was violated: 1 of 4 trained groups had lag > k." in md
    assert "bound held" not in md


def test_the_last_line_for_a_redone_step_counts(tmp_path: Path) -> None:
    rows = [step_line(s, 0.0, [0]) for s in range(1, 11)]
    rows.insert(5, step_line(3, 99.0, [0]))  # step 3 redone after a restart: the later line counts
    rows.append(step_line(10, 1.0, [0]))  # and step 10
    write_lines(tmp_path / "learner" / "steps.jsonl", rows)
    md, figures = report(tmp_path, k=1)
    assert figures["steps"]["count"] == 10 and figures["steps"]["redone_lines"] == 2
    assert figures["reward"]["start"] == 0.0 and figures["reward"]["end"] == 1.0  # 10 steps: 1-step windows
    assert figures["grad_norm"]["max"] == 10.0
    assert "`learner/steps.jsonl`: 12 lines read, 2 superseded by a later line for the same step" in md


def test_a_truncated_last_line_is_skipped_and_counted(tmp_path: Path) -> None:
    rows = [step_line(s, 0.5, [0]) for s in range(1, 4)]
    write_lines(tmp_path / "learner" / "steps.jsonl", rows, tail='{"step": 4, "version": 4, "metr')
    write_lines(tmp_path / "progress.jsonl", progress_lines(3), tail="[1, 2]\n")
    md, figures = report(tmp_path, k=2)
    assert figures["steps"]["count"] == 3 and figures["steps"]["unparseable_lines"] == 1
    assert figures["progress"] == {"samples": 3, "unparseable_lines": 1}
    assert "`learner/steps.jsonl`: 3 lines read, 1 unparseable lines skipped" in md
    assert "`progress.jsonl`: 3 lines read, 1 unparseable lines skipped" in md


def test_no_steps_still_writes_a_report_saying_so(tmp_path: Path) -> None:
    paths = write_report(tmp_path, {"run_id": "empty", "k": 4})
    md = paths.markdown.read_text()
    assert "No learner steps were recorded" in md
    assert "`learner/steps.jsonl`: missing" in md and "`progress.jsonl`: missing" in md
    assert paths.plots == {} and set(paths.skipped) == set(PLOT_NAMES)
    for name in PLOT_NAMES:
        assert f"- `{name}.png`: " in md
        assert not (tmp_path / "report" / f"{name}.png").exists()
    figures = json.loads(paths.json.read_text())
    assert figures["steps"]["count"] == 0 and figures["reward"]["start"] is None
    # an empty file is named as empty; progress alone still gives the throughput plot and the ledger
    write_lines(tmp_path / "learner" / "steps.jsonl", [])
    write_lines(tmp_path / "progress.jsonl", progress_lines())
    paths = write_report(tmp_path, {"k": 4})
    md = paths.markdown.read_text()
    assert "`learner/steps.jsonl`: empty" in md and set(paths.plots) == {"throughput"}
    figures = json.loads(paths.json.read_text())
    assert figures["ledger"] == {"rollouts_added": 36, "scored_added": 36, "groups_trained": 36}
    assert figures["ledger_source"] == "progress.jsonl (last sample)" and "Balanced: not checked." in md
    assert figures["wall_s"] == 45.0  # no wall_s in the summary: the last progress sample's elapsed_s


def test_k_and_run_id_come_from_the_resolved_config_when_not_given(tmp_path: Path) -> None:
    write_lines(tmp_path / "learner" / "steps.jsonl", [step_line(1, 0.1, [0, 2])])
    (tmp_path / "config.resolved.json").write_text(json.dumps({"run": {"k": 1, "run_id": "from-config"}}))
    md, figures = report(tmp_path)
    assert figures["k"] == 1 and figures["run_id"] == "from-config"
    assert figures["staleness"]["bound_held"] is False  # lag 2 > 1
    (tmp_path / "config.resolved.json").unlink()
    md, figures = report(tmp_path)
    assert figures["k"] is None and figures["run_id"] == tmp_path.name
    assert "k is unknown, so the bound was not checked" in md


def test_nan_none_and_missing_values_do_not_crash(tmp_path: Path) -> None:
    nan = float("nan")
    rows = [
        step_line(1, nan, [0], metrics={"ess_ratio": nan, "lr_scale": None, "grad_norm": float("inf")}),
        step_line(2, 0.5, [None, 1], metrics=None, dropped=[{"group_id": "x", "lag": nan}, "junk"]),
        {"step": 3},  # an older line with nothing else
        {"step": 4, "reward_mean": "high", "lags": "no", "dropped": 7, "groups": None},
        {"version": 9},  # no step at all: skipped and counted
    ]
    write_lines(tmp_path / "learner" / "steps.jsonl", rows)
    write_lines(tmp_path / "progress.jsonl", [{"time": nan, "throughput": None, "ledger": "x"}, {}])
    paths = write_report(tmp_path, {"k": 2, "wall_s": nan, "ledger": {"balanced": False, "lost": nan}})
    md = paths.markdown.read_text()
    figures = json.loads(paths.json.read_text())  # strict JSON: no NaN in it
    assert figures["reward"]["start"] == figures["reward"]["end"] == 0.5
    assert figures["ess_ratio"] == {"mean": None, "min": None}
    assert figures["ledger"] == {"balanced": False, "lost": None} and "Balanced: NO." in md
    assert figures["staleness"]["trained_without_lag"] == 1  # step 2's None lag
    assert figures["staleness"]["dropped_reasons"] == {"unknown": 1}
    assert figures["steps"]["unparseable_lines"] == 1 and figures["wall_s"] is None
    assert set(paths.plots) == {"reward", "staleness"}
    assert set(paths.skipped) == {"ess_ratio", "lr_scale", "grad_norm", "throughput", "accuracy"}


def test_cli_prints_the_paths_and_refuses_a_missing_run_dir(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deploy.report", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    run_dir = tmp_path / "run"
    write_lines(run_dir / "learner" / "steps.jsonl", [step_line(1, 0.1, [0]), step_line(2, 0.2, [1])])
    (run_dir / "summary.json").write_text(json.dumps({"run_id": "launched", "k": 3}))  # the launcher's
    out = cli(str(run_dir), "--k", "2")
    assert out.returncode == 0, out.stderr
    printed = out.stdout.split()
    assert (
        str(run_dir / "report" / "report.md") in printed and str(run_dir / "report" / "reward.png") in printed
    )
    assert "skipped throughput.png: no progress samples" in out.stderr
    figures = json.loads((run_dir / "report" / "report.json").read_text())
    assert figures["k"] == 2 and figures["run_id"] == "launched"  # --k over the summary's k
    out = cli(str(tmp_path / "nope"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_importing_the_module_does_not_import_matplotlib() -> None:
    code = "import sys, deploy.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_evaluation_figures_per_set(full: Full) -> None:
    paths, _, figures = full
    evaluation = figures["evaluation"]
    assert list(evaluation) == ["arith_hard", "digit_add"]
    digit = evaluation["digit_add"]
    assert digit["n"] == 8 and evaluation["arith_hard"]["n"] == 4
    assert [(p["version"], p["mean_at_n"], p["pass_at_n"]) for p in digit["points"]] == DIGIT_ADD
    assert digit["first"] == {
        "version": 0,
        "train_seconds": 0.0,
        "gpu_hours": 0.0,
        "mean_at_n": 0.10,
        "pass_at_n": 0.50,
        "tasks": 20,
        "n": 8,
    }
    assert (digit["last"]["version"], digit["last"]["mean_at_n"], digit["last"]["pass_at_n"]) == (
        20,
        0.4,
        0.8,
    )
    assert (digit["best"]["version"], digit["best"]["mean_at_n"], digit["best"]["train_seconds"]) == (
        10,
        0.55,
        30,
    )
    hard = evaluation["arith_hard"]
    assert [p["version"] for p in hard["points"]] == [0, 10, 20]
    assert hard["first"]["mean_at_n"] == 0.05 and hard["last"]["pass_at_n"] == 0.45
    assert hard["best"] == hard["last"] and hard["best"]["version"] == 20
    assert figures["metrics_file"] == {
        "exists": True,
        "unparseable_lines": 0,
        "eval_lines": 8,
        "points": 8,
        "bad_eval_lines": 0,
        "superseded_eval_lines": 0,
        "train_lines": 20,
        "other_kinds": {"note": 1},
    }
    assert paths.plots["accuracy"].read_bytes().startswith(PNG_SIGNATURE) and "accuracy" in figures["plots"]


def test_held_out_accuracy_section_in_markdown(full: Full) -> None:
    _, md, _ = full
    section = md.split("## Held-out accuracy")[1].split("## Staleness")[0]
    assert section.index("### arith_hard") < section.index("### digit_add")
    digit = section.split("### digit_add")[1]
    assert "| version | training time | GPU-hours | mean@8 | pass@8 | tasks |" in digit
    assert "| 0 | 0.0 min | 0.000 | 0.1000 | 0.5000 | 20 |" in digit
    assert "| 10 | 0.5 min | 0.000 | 0.5500 | 0.9000 | 20 |" in digit  # 30 s of training
    assert "| 20 | 1.0 min | 0.000 | 0.4000 | 0.8000 | 20 |" in digit
    assert digit.count("| 0.000 |") == 5  # every point is a row: no thinning below 13 points
    assert "- first → last: mean@8 0.1000 → 0.4000, pass@8 0.5000 → 0.8000 (version 0 → 20)" in digit
    assert "- best mean@8: 0.5500 at version 10" in digit
    hard = section.split("### arith_hard")[1].split("### digit_add")[0]
    assert "| version | training time | GPU-hours | mean@4 | pass@4 | tasks |" in hard
    assert "- first → last: mean@4 0.0500 → 0.2500, pass@4 0.1500 → 0.4500 (version 0 → 20)" in hard
    assert "- best mean@4: 0.2500 at version 20" in hard
    assert "evaluations shown" not in section and "left out of the time panel" not in section
    assert (
        "- `metrics.jsonl`: 29 lines read; 8 eval lines (8 points in 2 sets), 20 train lines, "
        "other kinds ignored (note: 1)" in md
    )
    assert "![accuracy](accuracy.png)" in md


def test_a_repeated_set_and_version_counts_the_last_line_and_bad_lines_are_counted(tmp_path: Path) -> None:
    make_run(tmp_path, metrics=False)
    rows = [
        eval_line("digit_add", 0, 0.1, 0.2),
        eval_line("digit_add", 5, 0.9, 1.0),  # redone after a restart: the next line for version 5 counts
        eval_line("digit_add", 5, 0.3, 0.6),
        eval_line("digit_add", 10, 0.4, float("nan")),  # non-finite accuracy (json writes NaN)
        eval_line("digit_add", 15, 1.5, 0.9),  # not a fraction
        {k: v for k, v in eval_line("digit_add", 20, 0.5, 0.7).items() if k != "mean_at_n"},
        eval_line("digit_add", "25", 0.5, 0.7),  # a version that is a string
        eval_line(None, 30, 0.5, 0.7),  # no set
        {"version": 40, "mean_at_n": 0.5},  # no kind: counted as another kind, not as an eval line
    ]
    write_lines(tmp_path / "metrics.jsonl", rows, tail='{"kind": "eval", "set": "digit_add", "vers')
    md, figures = report(tmp_path, k=2)
    points = figures["evaluation"]["digit_add"]["points"]
    assert [(p["version"], p["mean_at_n"], p["pass_at_n"]) for p in points] == [(0, 0.1, 0.2), (5, 0.3, 0.6)]
    assert figures["evaluation"]["digit_add"]["best"]["mean_at_n"] == 0.3  # not the superseded 0.9
    counts = figures["metrics_file"]
    assert counts["eval_lines"] == 8 and counts["points"] == 2
    assert counts["bad_eval_lines"] == 5 and counts["superseded_eval_lines"] == 1
    assert counts["unparseable_lines"] == 1 and counts["other_kinds"] == {"(no kind)": 1}
    assert "`metrics.jsonl`: 9 lines read, 1 unparseable lines skipped" in md
    assert "5 bad eval lines skipped (no set, version, mean_at_n or pass_at_n" in md
    assert "1 superseded by a later line for the same set and version" in md
    assert "- first → last: mean@8 0.1000 → 0.3000, pass@8 0.2000 → 0.6000 (version 0 → 5)" in md
    assert "- 5 bad eval lines were skipped (see Data)." in md
    assert "accuracy" in figures["plots"]


def test_no_metrics_file_says_no_evaluation_was_recorded(tmp_path: Path) -> None:
    paths = write_report(make_run(tmp_path, metrics=False), {"k": 2})
    md = paths.markdown.read_text()
    section = md.split("## Held-out accuracy")[1].split("## Staleness")[0]
    assert "No evaluation was recorded (no metrics.jsonl)." in section
    assert "`[evaluation]`" in section and "`[[evaluation.sets]]`" in section
    assert "- `metrics.jsonl`: missing" in md
    assert paths.skipped == {"accuracy": "no metrics.jsonl"} and "- `accuracy.png`: no metrics.jsonl" in md
    assert not (tmp_path / "report" / "accuracy.png").exists()
    figures = json.loads(paths.json.read_text())
    assert figures["evaluation"] == {} and figures["metrics_file"]["exists"] is False
    # train lines only, then eval lines that are all bad: still no evaluation, with the reason
    write_lines(tmp_path / "metrics.jsonl", metrics_lines()[:20])
    paths = write_report(tmp_path, {"k": 2})
    assert paths.skipped == {"accuracy": "no eval line in metrics.jsonl"}
    assert "No evaluation was recorded (no eval line in metrics.jsonl)." in paths.markdown.read_text()
    write_lines(tmp_path / "metrics.jsonl", [eval_line("a", 1, None, 0.5), eval_line("a", 2, 0.5, "x")])
    paths = write_report(tmp_path, {"k": 2})
    why = "none of the 2 eval lines in metrics.jsonl is valid"
    assert (
        paths.skipped == {"accuracy": why}
        and f"No evaluation was recorded ({why})." in paths.markdown.read_text()
    )
    assert not (tmp_path / "report" / "accuracy.png").exists()


def test_points_without_training_time_are_in_the_table_but_not_the_time_panel(tmp_path: Path) -> None:
    rows = [eval_line("digit_add", v, 0.1 * v, 0.2 * v) for v in range(5)]
    rows[1]["train_seconds"] = rows[3]["train_seconds"] = None  # unknown
    make_run(tmp_path, metrics=False)
    write_lines(tmp_path / "metrics.jsonl", rows)
    md, figures = report(tmp_path, k=2)
    assert [p["train_seconds"] for p in figures["evaluation"]["digit_add"]["points"]] == [
        0.0,
        None,
        6.0,
        None,
        12.0,
    ]
    assert (
        "| 1 | n/a | 0.000 | 0.1000 | 0.2000 | 20 |" in md
        and "| 3 | n/a | 0.000 | 0.3000 | 0.6000 | 20 |" in md
    )
    assert "| 4 | 0.2 min | 0.000 | 0.4000 | 0.8000 | 20 |" in md
    assert "- 2 of 5 evaluations have no training time (`train_seconds` unknown)" in md
    # what is drawn: every version in the version panel, only the timed points (in minutes) in the time panel
    evaluation = load_evaluation(rows)
    fig = plot_accuracy(tmp_path / "accuracy.png", evaluation.sets)
    by_version, by_time = fig.axes
    assert len(fig.axes) == 2  # no GPU-hours panel: every gpu_hours is 0
    mean, passed = by_version.lines
    assert list(mean.get_xdata()) == [0, 1, 2, 3, 4] and mean.get_label() == "digit_add mean@8"
    assert list(passed.get_ydata()) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert passed.get_label() == "digit_add pass@8" and passed.get_linestyle() == "--"
    assert mean.get_linestyle() == "-" and mean.get_marker() == "o"
    mean, passed = by_time.lines
    assert list(mean.get_xdata()) == pytest.approx([0.0, 0.1, 0.2]) and list(
        mean.get_ydata()
    ) == pytest.approx([0.0, 0.2, 0.4])
    assert "2 points without train_seconds left out" in by_time.get_title()
    assert by_time.get_xlabel() == "training wall time (min)"


def test_gpu_hours_add_a_panel(tmp_path: Path) -> None:
    rows = [eval_line("s", v, 0.5, 0.5, gpu_hours=0.25 * v) for v in range(3)]
    rows.append(eval_line("s", 3, 0.6, 0.7, gpu_hours=None))
    fig = plot_accuracy(tmp_path / "accuracy.png", load_evaluation(rows).sets)
    assert len(fig.axes) == 3 and fig.axes[2].get_xlabel() == "GPU-hours"
    assert list(fig.axes[2].lines[0].get_xdata()) == [0.0, 0.25, 0.5]  # the point without GPU-hours left out
    assert (tmp_path / "accuracy.png").read_bytes().startswith(PNG_SIGNATURE)


def test_more_than_12_evaluations_show_first_last_and_evenly_spaced(tmp_path: Path) -> None:
    make_run(tmp_path, metrics=False)
    write_lines(tmp_path / "metrics.jsonl", [eval_line("d", 10 * i, i / 100, i / 50) for i in range(30)])
    md, figures = report(tmp_path, k=2)
    assert len(figures["evaluation"]["d"]["points"]) == 30  # all of them in report.json
    table = md.split("### d")[1].split("- first")[0]
    shown = [
        int(line.split("|")[1]) for line in table.splitlines() if line.startswith("| ") and "min" in line
    ]
    assert len(shown) == 12 and shown[0] == 0 and shown[-1] == 290
    gaps = {b - a for a, b in itertools.pairwise(shown)}
    assert gaps <= {20, 30}  # 29 steps of 10 versions over 11 gaps: every 2 or 3 points
    assert "12 of 30 evaluations shown: the first, the last and evenly spaced ones between" in md
    assert "- first → last: mean@8 0.0000 → 0.2900, pass@8 0.0000 → 0.5800 (version 0 → 290)" in md
    assert [p["version"] for p in table_points(figures["evaluation"]["d"]["points"][:12])] == list(
        range(0, 120, 10)
    )


def test_the_progress_line_shows_each_sets_newest_accuracy_and_the_rounds_abandoned() -> None:
    newest = {"version": 100, "n": 4, "mean_at_n": 0.25, "pass_at_n": 0.5}
    record = progress_lines(2)[1] | {"lag_max": 3.0, "eval": {"held": newest}}
    for abandoned in (None, 0.0):  # no shared evaluation, or none abandoned: nothing to say
        line = progress_line(record | {"eval_abandoned": abandoned})
        assert line.endswith("| held mean@4 0.250 (v100)") and "abandoned" not in line, line
    line = progress_line(record | {"eval_abandoned": 2.0})
    assert line.endswith("| held mean@4 0.250 (v100) | eval rounds abandoned 2 (evaluation.max_delay_s)"), (
        line
    )


def test_faults_name_the_restarts_and_the_longest_stand_still(tmp_path: Path) -> None:
    rows = [step_line(s, 0.1, [0]) for s in range(1, 9)]  # 3 s apart
    rows += [
        step_line(s, 0.1, [0], time=1100.0 + s) for s in (6, 7, 8, 9)
    ]  # restarted at step 5's checkpoint
    write_lines(tmp_path / "learner" / "steps.jsonl", rows)
    stall = {"restart": 1, "reason": "ActorDiedError: rank 1 died", "from_step": 5, "seconds": 12.5}
    md, figures = report(
        tmp_path, k=1, restarts={"learner": 1, "sampler": 2, "reward": 0}, learner_restarts=[stall]
    )
    assert figures["faults"]["restarts"] == {"learner": 1, "sampler": 2, "reward": 0}
    assert figures["faults"]["longest_step_gap_s"] == pytest.approx(1106.0 - 1015.0)  # step 5 -> redone 6
    assert "- Restarts by service: learner: 1, sampler: 2." in md
    assert "- Longest gap between two learner steps: 91.0 s." in md
    assert "Learner restart 1: ActorDiedError: rank 1 died; from the checkpoint at step 5, 12.5 s" in md
    (tmp_path / "none").mkdir()
    md, figures = report(tmp_path / "none")
    assert figures["faults"] == {"restarts": {}, "learner_restarts": [], "longest_step_gap_s": None}
    assert "- Restarts by service: none." in md and "- Longest gap between two learner steps: n/a." in md
