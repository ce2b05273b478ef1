"""The run report: what a run did, in plots and one page, written from the files the run left behind.

    <run_dir>/learner/steps.jsonl   one line per learner step (the last line for a step counts)
    <run_dir>/progress.jsonl        the launcher's sample every few seconds (throughput, ledger)
    summary (from the launcher)     run id, k, wall time, why it stopped, the balanced ledger
    <run_dir>/metrics.jsonl         the launcher's metrics log: held-out accuracy ("eval" lines, one per
                                    validation set and policy version), "train" lines (only counted)
    <run_dir>/config.resolved.json  fallback for run id and k when the summary lacks them
    (the CLI reads the summary from <run_dir>/summary.json, which the launcher writes)
      └─► <run_dir>/report/  reward.png ess_ratio.png lr_scale.png grad_norm.png staleness.png
                             throughput.png accuracy.png report.md report.json

The launcher calls ``write_report`` at the end of a run or on Ctrl-C, so everything here is written for a
partial run: a missing or empty file, a truncated last line, a step redone after a restart, NaN or null
figures. Nothing is dropped silently: skipped lines, superseded step lines and skipped plots are counted
and named in report.md. What it decides:

- reward "start" and "end" are the means over the first and last ``max(1, n // 10)`` steps that have a
  finite reward, so one noisy step does not decide the headline;
- the lag bound holds when every *trained* group's lag is at most k; dropped groups may exceed k (that is
  why they were dropped) and are counted apart;
- a throughput mean is over the progress samples where that service had reported a finite value;
- held-out accuracy (mean@n and pass@n per set against version, training time and GPU-hours) is read and
  drawn by ``deploy/report_eval.py``: the last eval line for a (set, version) counts, bad lines are counted.

    python -m deploy.report RUN_DIR [--k K]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.report_common import finite, fmt, table
from deploy.report_eval import (
    Evaluation,
    evaluation_markdown,
    load_evaluation,
    plot_accuracy,
    summarize_evaluation,
)

Json = dict[str, Any]  # one JSON object: a line of a JSONL file, the figures, the summary
# plot name -> (field of a step line, y-axis label); "metrics.x" is a key of the step's metrics
STEP_PLOTS: dict[str, tuple[str, str]] = {
    "reward": ("reward_mean", "mean reward"),
    "ess_ratio": ("metrics.ess_ratio", "ESS ratio"),
    "lr_scale": ("metrics.lr_scale", "LR scale"),
    "grad_norm": ("metrics.grad_norm", "gradient norm"),
}
# progress.jsonl throughput key -> (service, unit)
THROUGHPUT: dict[str, tuple[str, str]] = {
    "sampler_tokens_per_s": ("sampler", "tokens/s"),
    "reward_groups_per_s": ("reward", "groups/s"),
    "learner_tokens_per_s": ("learner", "tokens/s"),
}
PLOT_NAMES = (*STEP_PLOTS, "staleness", "throughput", "accuracy")  # each written as <name>.png


@dataclass(frozen=True)
class ReportPaths:
    """What ``write_report`` wrote, and which plots it skipped (name -> why)."""

    directory: Path
    markdown: Path
    json: Path
    plots: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def written(self) -> list[Path]:
        return [*self.plots.values(), self.markdown, self.json]


@dataclass
class JsonlFile:
    """The object lines of one JSONL file, with what could not be read counted rather than dropped."""

    exists: bool
    rows: list[Json]
    bad_lines: int = 0
    superseded: int = 0  # lines replaced by a later line for the same step (redone after a restart)

    def describe(self, name: str) -> str:
        if not self.exists:
            return f"`{name}`: missing"
        if not self.rows and not self.bad_lines:
            return f"`{name}`: empty"
        text = f"`{name}`: {len(self.rows) + self.superseded} lines read"
        if self.bad_lines:
            text += f", {self.bad_lines} unparseable lines skipped (e.g. a line cut short by a kill)"
        if self.superseded:
            text += f", {self.superseded} superseded by a later line for the same step (redone steps)"
        return text


def read_jsonl(path: Path, int_key: str | None = None) -> JsonlFile:
    """Every line that is a JSON object (with an integer ``int_key`` when one is named); the rest counted."""
    if not path.is_file():
        return JsonlFile(exists=False, rows=[])
    log = JsonlFile(exists=True, rows=[])
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and (int_key is None or type(row.get(int_key)) is int):
            log.rows.append(row)
        else:
            log.bad_lines += 1
    return log


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(row: Json, key: str) -> float | None:
    """One service's throughput in a progress sample, None if it had not reported."""
    throughput = row.get("throughput")
    return finite(throughput.get(key)) if isinstance(throughput, dict) else None


def load_steps(path: Path) -> JsonlFile:
    """The learner's steps, one row per step (the last line written for it counts), in step order."""
    log = read_jsonl(path, int_key="step")
    last = {row["step"]: row for row in log.rows}  # later lines overwrite earlier ones
    log.superseded = len(log.rows) - len(last)
    log.rows = [last[step] for step in sorted(last)]
    return log


def series(rows: list[Json], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one field over the steps, keeping only finite values."""
    xs: list[int] = []
    ys: list[float] = []
    for row in rows:
        value: Any = row
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        y = finite(value)
        if y is not None:
            xs.append(row["step"])
            ys.append(y)
    return xs, ys


def staleness(rows: list[Json], k: int | None) -> Json:
    """Lag counts of trained and dropped groups, and whether every trained group's lag was at most k."""
    trained: Counter[int] = Counter()
    dropped: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    unknown = 0  # trained groups without a recorded lag (step lines older than the `lags` field)
    for row in rows:
        lags = row.get("lags")
        lags = [int(x) for x in lags if finite(x) is not None] if isinstance(lags, list) else []
        trained.update(lags)
        groups = row.get("groups")
        unknown += max(0, len(groups) - len(lags)) if isinstance(groups, list) else 0
        drops = row.get("dropped")
        for drop in (d for d in (drops if isinstance(drops, list) else []) if isinstance(d, dict)):
            reasons[str(drop.get("reason", "unknown"))] += 1
            if finite(drop.get("lag")) is not None:
                dropped[int(drop["lag"])] += 1
    over_k = None if k is None else sum(n for lag, n in trained.items() if lag > k)
    return {
        "trained": dict(sorted(trained.items())),
        "dropped": dict(sorted(dropped.items())),
        "dropped_reasons": dict(sorted(reasons.items())),
        "trained_without_lag": unknown,
        "max_trained_lag": max(trained, default=None),
        "max_lag": max([*trained, *dropped], default=None),
        "trained_over_k": over_k,
        "dropped_over_k": None if k is None else sum(n for lag, n in dropped.items() if lag > k),
        "bound_held": None if over_k is None or not trained else over_k == 0,
    }


def summarize(steps: JsonlFile, progress: JsonlFile, summary: Mapping[str, Any], k: int | None) -> Json:
    """The headline figures (report.json); None wherever the data was not there."""
    rows = steps.rows
    _, rewards = series(rows, "reward_mean")
    edge = max(1, len(rewards) // 10)
    start, end = (_mean(rewards[:edge]), _mean(rewards[-edge:])) if rewards else (None, None)
    figures = {name: series(rows, key)[1] for name, (key, _) in STEP_PLOTS.items()}
    rates = {key: [v for p in progress.rows if (v := _rate(p, key)) is not None] for key in THROUGHPUT}
    ledger = summary.get("ledger")
    ledger_source: str | None = "the summary"
    if not isinstance(ledger, Mapping):  # the launcher's last sample of it, which says nothing of balance
        ledger = next((p["ledger"] for p in progress.rows[::-1] if isinstance(p.get("ledger"), dict)), None)
        ledger_source = "progress.jsonl (last sample)" if ledger else None
    elapsed = [e for p in progress.rows if (e := finite(p.get("elapsed_s"))) is not None]
    wall_s = finite(summary.get("wall_s"))
    return {
        "run_id": summary.get("run_id"),
        "k": k,
        "stopped_by": summary.get("stopped_by"),
        "wall_s": wall_s if wall_s is not None else (max(elapsed) if elapsed else None),
        "steps": {
            "count": len(rows),
            "first": rows[0]["step"] if rows else None,
            "last": rows[-1]["step"] if rows else None,
            "last_version": next((v for r in reversed(rows) if isinstance(v := r.get("version"), int)), None),
            "redone_lines": steps.superseded,
            "unparseable_lines": steps.bad_lines,
        },
        "reward": {
            "start": start,
            "end": end,
            "change": None if start is None or end is None else end - start,
            "window_steps": edge if rewards else 0,
            "steps_with_reward": len(rewards),
        },
        "ess_ratio": {"mean": _mean(figures["ess_ratio"]), "min": min(figures["ess_ratio"], default=None)},
        "lr_scale": {"mean": _mean(figures["lr_scale"])},
        "grad_norm": {"mean": _mean(figures["grad_norm"]), "max": max(figures["grad_norm"], default=None)},
        "staleness": staleness(rows, k),
        "throughput": {key: _mean(values) for key, values in rates.items()},
        "ledger": dict(ledger) if isinstance(ledger, Mapping) else None,
        "ledger_source": ledger_source,
        "progress": {"samples": len(progress.rows), "unparseable_lines": progress.bad_lines},
        "faults": faults(rows, summary),
    }


def faults(rows: list[Json], summary: Mapping[str, Any]) -> Json:
    """Restarts by service (the launcher's summary), each learner restart, and the longest wall-clock gap
    between two consecutive learner steps (the longest the run made no progress, waiting included; a redone
    step's last line counts, so the time a failed group spent on steps its successor redid counts too)."""
    times = [t for r in rows if (t := finite(r.get("time"))) is not None]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    restarts = summary.get("restarts")
    learner = summary.get("learner_restarts")
    return {
        "restarts": {str(s): int(n) for s, n in restarts.items()} if isinstance(restarts, Mapping) else {},
        "learner_restarts": list(learner) if isinstance(learner, list) else [],
        "longest_step_gap_s": max(gaps) if gaps else None,
    }


# --- plots (matplotlib is imported here only, and only its Agg canvas: no pyplot, no global backend) ---


def _figure(rows: int = 1) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3 + 1.6 * (rows - 1)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_series(path: Path, xs: list[int], ys: list[float], title: str, ylabel: str) -> None:
    import numpy as np

    fig = _figure()
    ax = fig.add_subplot()
    window = max(3, len(ys) // 20)
    smoothed = len(ys) >= 2 * window  # a rolling mean only helps once there is something to smooth
    ax.plot(xs, ys, "o" if smoothed else "o-", ms=3, alpha=0.35 if smoothed else 1.0, label="per step")
    if smoothed:
        smooth = np.convolve(ys, np.ones(window) / window, mode="valid")  # trailing mean
        ax.plot(xs[window - 1 :], smooth, "-", lw=2, label=f"rolling mean ({window} steps)")
        ax.legend(loc="best", fontsize="small")
    ax.set(title=title, xlabel="learner step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    fig.savefig(path)


def plot_staleness(path: Path, trained: Mapping[int, int], dropped: Mapping[int, int], k: int | None) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    lags = sorted({*trained, *dropped})
    below = [trained.get(lag, 0) for lag in lags]
    ax.bar(lags, below, label="trained", color="tab:blue")
    ax.bar(lags, [dropped.get(lag, 0) for lag in lags], bottom=below, label="dropped", color="tab:red")
    if k is not None:
        ax.axvline(k + 0.5, color="black", ls="--", label=f"k = {k} (bound)")
    ax.set(title="staleness of consumed groups", xlabel="lag (policy versions)", ylabel="groups")
    ax.set_xticks(lags)
    ax.margins(y=0.1)
    ax.legend(loc="best", fontsize="small")
    fig.savefig(path)


def plot_throughput(path: Path, rows: list[Json]) -> None:
    fig = _figure(rows=len(THROUGHPUT))
    axes = fig.subplots(len(THROUGHPUT), 1, sharex=True, squeeze=False)[:, 0]
    t0 = next((t for r in rows if (t := finite(r.get("time"))) is not None), 0.0)
    for ax, (key, (service, unit)) in zip(axes, THROUGHPUT.items(), strict=True):
        xs, ys = [], []
        for r in rows:
            x = finite(r.get("elapsed_s"))
            x = x if x is not None else (finite(r.get("time")) or t0) - t0
            if (y := _rate(r, key)) is not None:
                xs.append(x)
                ys.append(y)
        if ys:
            ax.plot(xs, ys, "-", lw=1.5)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")
        ax.set_ylabel(f"{service}\n{unit}")
        ax.grid(alpha=0.3)
    axes[0].set_title("throughput per service")
    axes[-1].set_xlabel("wall time (s since start)")
    fig.savefig(path)


def write_plots(
    out: Path, steps: JsonlFile, progress: JsonlFile, figures: Json, evaluation: Evaluation
) -> tuple[dict[str, Path], dict[str, str]]:
    """Each plot there is data for; the others are named with the reason they were skipped."""
    plots: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for name, (key, label) in STEP_PLOTS.items():
        xs, ys = series(steps.rows, key)
        if not ys:
            skipped[name] = "no steps" if not steps.rows else f"no finite `{key}` in any step"
            continue
        plot_series(out / f"{name}.png", xs, ys, f"{label} against step", label)
        plots[name] = out / f"{name}.png"
    stal = figures["staleness"]
    if stal["trained"] or stal["dropped"]:
        plot_staleness(out / "staleness.png", stal["trained"], stal["dropped"], figures["k"])
        plots["staleness"] = out / "staleness.png"
    else:
        skipped["staleness"] = "no steps" if not steps.rows else "no step recorded a group's lag"
    if any(_rate(r, key) is not None for r in progress.rows for key in THROUGHPUT):
        plot_throughput(out / "throughput.png", progress.rows)
        plots["throughput"] = out / "throughput.png"
    else:
        skipped["throughput"] = "no service reported throughput" if progress.rows else "no progress samples"
    if (why := evaluation.missing_reason()) is None:
        plot_accuracy(out / "accuracy.png", evaluation.sets)
        plots["accuracy"] = out / "accuracy.png"
    else:
        skipped["accuracy"] = why
    return plots, skipped


# --- report.md ---


def _learning(s: Json) -> list[str]:
    st, r = s["steps"], s["reward"]
    if not st["count"]:
        return ["No learner steps were recorded, so there are no reward, ESS, LR or gradient figures."]
    n = r["window_steps"]
    lines = table(
        ("figure", "value"),
        [
            (f"reward at the start (mean of the first {n} steps)", fmt(r["start"])),
            (f"reward at the end (mean of the last {n} steps)", fmt(r["end"])),
            ("reward change", fmt(r["change"], "+.4f")),
            ("ESS ratio mean / min", f"{fmt(s['ess_ratio']['mean'])} / {fmt(s['ess_ratio']['min'])}"),
            ("LR scale mean", fmt(s["lr_scale"]["mean"])),
            ("grad norm mean / max", f"{fmt(s['grad_norm']['mean'])} / {fmt(s['grad_norm']['max'])}"),
        ],
    )
    if r["steps_with_reward"] < st["count"]:
        lines += ["", f"{st['count'] - r['steps_with_reward']} steps had no finite reward and are left out."]
    return lines


def _staleness(stal: Json, k: int | None) -> list[str]:
    lags = sorted({*stal["trained"], *stal["dropped"]})
    counts = [(lag, stal["trained"].get(lag, 0), stal["dropped"].get(lag, 0)) for lag in lags]
    lines = [*table(("lag", "trained", "dropped"), counts), ""] if lags else []
    n_trained = sum(stal["trained"].values())
    top = stal["max_trained_lag"]
    seen = f"- Max lag seen: {stal['max_lag']} (trained groups: {top}) vs k = {k}: "
    if not n_trained:
        lines.append("- No trained group recorded a lag, so the lag bound could not be checked.")
    elif k is None:
        lines.append(f"- k is unknown, so the bound was not checked (max trained lag {top}).")
    elif stal["bound_held"]:
        lines.append(seen + f"the bound held for every trained group ({n_trained} groups).")
    else:
        over = stal["trained_over_k"]
        lines.append(seen + f"the bound was violated: {over} of {n_trained} trained groups had lag > k.")
    if stal["dropped_over_k"]:
        lines.append(f"- {stal['dropped_over_k']} dropped groups had lag > k (dropped, not trained).")
    if stal["dropped_reasons"]:
        reasons = ", ".join(f"{why}: {n}" for why, n in stal["dropped_reasons"].items())
        lines.append(f"- Dropped groups by reason: {reasons}.")
    if stal["trained_without_lag"]:
        lines.append(f"- {stal['trained_without_lag']} trained groups have no recorded lag (older lines).")
    return lines


def _faults(f: Json) -> list[str]:
    gap = "n/a" if f["longest_step_gap_s"] is None else f"{f['longest_step_gap_s']:.1f} s"
    restarts = ", ".join(f"{s}: {n}" for s, n in sorted(f["restarts"].items()) if n) or "none"
    lines = [f"- Restarts by service: {restarts}.", f"- Longest gap between two learner steps: {gap}."]
    lines += [
        f"- Learner restart {r.get('restart')}: {r.get('reason')}; from the checkpoint at step "
        f"{r.get('from_step')}, {r.get('seconds')} s until its version was published again."
        for r in f["learner_restarts"]
        if isinstance(r, Mapping)
    ]
    return lines


def _ledger(ledger: Json | None, source: str | None) -> list[str]:
    if ledger is None:
        return ["No ledger was given (neither in the summary nor in progress.jsonl)."]
    balanced, problems = ledger.get("balanced"), ledger.get("problems")
    verdict = "not checked" if balanced is None else ("yes" if balanced else "NO")
    rows = [(key, value) for key, value in ledger.items() if key not in ("balanced", "problems")]
    lines = [f"From {source}.", "", *table(("key", "value"), rows), "", f"Balanced: {verdict}."]
    if isinstance(problems, list) and problems:
        lines += ["", *(f"- {problem}" for problem in problems)]
    return lines


def render_markdown(
    s: Json,
    steps: JsonlFile,
    progress: JsonlFile,
    paths: ReportPaths,
    metrics: JsonlFile,
    evaluation: Evaluation,
) -> str:
    k, st = s["k"], s["steps"]
    wall = "n/a" if s["wall_s"] is None else f"{s['wall_s']:.1f} s ({s['wall_s'] / 60:.1f} min)"
    span = f"{st['count']} (step {st['first']} to {st['last']}, last version {st['last_version']})"
    header = [
        ("run id", s["run_id"] or "n/a"),
        ("k (lag bound)", "unknown" if k is None else k),
        ("steps", span if st["count"] else "0"),
        ("wall time", wall),
        ("stopped by", s["stopped_by"] or "n/a"),
    ]
    metrics_line = metrics.describe("metrics.jsonl") + (f"; {evaluation.describe()}" if metrics.rows else "")
    data = [
        f"- {steps.describe('learner/steps.jsonl')}",
        f"- {progress.describe('progress.jsonl')}",
        f"- {metrics_line}",
    ]
    throughput = [
        (service, "no data" if (v := s["throughput"][key]) is None else f"{v:,.1f} {unit}")
        for key, (service, unit) in THROUGHPUT.items()
    ]
    plots = ["\n\n".join(f"![{name}]({path.name})" for name, path in paths.plots.items()) or "No plots."]
    if paths.skipped:
        plots += ["", "Skipped plots:", "", *(f"- `{n}.png`: {why}" for n, why in paths.skipped.items())]
    sections = [
        [f"# Run report: {s['run_id'] or 'unknown run'}", "", *table(("", ""), header)],
        ["## Data", "", *data],
        ["## Learning", "", *_learning(s)],
        ["## Held-out accuracy", "", *evaluation_markdown(evaluation)],
        ["## Staleness", "", *_staleness(s["staleness"], k)],
        ["## Throughput (mean over progress samples)", "", *table(("service", "mean"), throughput)],
        ["## Ledger", "", *_ledger(s["ledger"], s["ledger_source"])],
        ["## Faults and restarts", "", *_faults(s["faults"])],
        ["## Plots", "", *plots],
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader (or a second Ctrl-C) never sees half a report


def _json_object(path: Path) -> Json:
    """A JSON object file's content; {} when it is missing or not an object (only a fallback is read so)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_report(
    run_dir: str | Path, summary: Mapping[str, Any] | None = None, *, k: int | None = None
) -> ReportPaths:
    """Write ``<run_dir>/report/`` (plots, report.md, report.json) from whatever the run left behind.

    ``k`` overrides ``summary["k"]``, which overrides the run's config.resolved.json; the same order for the
    run id, then the run directory's name."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    resolved = _json_object(run_dir / "config.resolved.json").get("run")
    resolved = resolved if isinstance(resolved, dict) else {}
    summary = dict(summary or {})
    if k is None:
        k = next((v for v in (summary.get("k"), resolved.get("k")) if isinstance(v, int)), None)
    summary.setdefault("run_id", resolved.get("run_id") or run_dir.name)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    steps = load_steps(run_dir / "learner" / "steps.jsonl")
    progress = read_jsonl(run_dir / "progress.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evaluation = load_evaluation(metrics.rows, metrics.exists)
    figures = summarize(steps, progress, summary, k)
    figures["evaluation"] = summarize_evaluation(evaluation)
    figures["metrics_file"] = {"exists": metrics.exists, "unparseable_lines": metrics.bad_lines}
    figures["metrics_file"] |= evaluation.counts()
    plots, skipped = write_plots(out, steps, progress, figures, evaluation)
    paths = ReportPaths(out, out / "report.md", out / "report.json", plots, skipped)
    figures["plots"] = {name: path.name for name, path in plots.items()}
    figures["skipped_plots"] = skipped
    # strict JSON: a NaN or infinity that came in with the summary becomes null, anything odd a string
    strict = json.loads(json.dumps(figures, default=str), parse_constant=lambda _: None)
    _write_text(paths.json, json.dumps(strict, indent=2, allow_nan=False) + "\n")
    _write_text(paths.markdown, render_markdown(figures, steps, progress, paths, metrics, evaluation))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's directory (run.run_dir)")
    parser.add_argument("--k", type=int, default=None, help="the lag bound, if not in config.resolved.json")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: run directory {args.run_dir} does not exist", file=sys.stderr)
        return 2
    # the summary the launcher wrote beside the run, so the CLI redraws the launcher's own report
    paths = write_report(args.run_dir, _json_object(args.run_dir / "summary.json") or None, k=args.k)
    for path in paths.written():
        print(path)
    for name, why in paths.skipped.items():
        print(f"skipped {name}.png: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
