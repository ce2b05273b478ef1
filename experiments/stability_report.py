"""The stability experiment's results: per-run summaries, the collapse rule, the table, the plots.

Reads ``runs.jsonl`` (written by ``experiments/stability.py``: a header line, then one line per finished
(method, k, seed) run) and writes beside it ``stability.md`` (the command at the top, the table, a summary),
``stability.json`` (the same numbers, per seed too) and one PNG per plotted quantity.

The collapse rule was fixed before any result was looked at (issue 11). A run collapsed when any of:

- ``nonfinite``: a step's loss or pre-clip gradient norm was not finite;
- ``reward``: its final reward (the mean evaluation reward of the learner's current policy over the
  evaluations in the last W steps) is below the warm-start reward (the same evaluation at step 0) − 0.1;
- ``grad_spike``: its largest pre-clip gradient norm exceeds 100 × the median of its first 10 steps'.

Plots use matplotlib's Agg canvas only (no pyplot, no global backend), as ``deploy/report_plots.py`` does.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REWARD_DROP = 0.1
SPIKE_FACTOR = 100.0
SPIKE_REFERENCE_STEPS = 10
COLLAPSE_RULE = (
    f"a run collapsed if a step's loss or pre-clip gradient norm was non-finite (`nonfinite`), or its final "
    f"reward is below its warm-start reward − {REWARD_DROP} (`reward`), or its largest pre-clip gradient norm "
    f"exceeds {SPIKE_FACTOR:g} × the median of its first {SPIKE_REFERENCE_STEPS} steps' (`grad_spike`)"
)
# (key in a run's per-step series or "eval", axis label, log scale, file name)
PLOTS = (
    ("eval", "evaluation reward (learner's policy)", False, "eval_reward.png"),
    ("reward", "training reward (rollouts' policy)", False, "reward.png"),
    ("ess_ratio", "ESS ratio ρ", False, "ess_ratio.png"),
    ("lr_scale", "LR scale", False, "lr_scale.png"),
    ("grad_norm", "pre-clip gradient norm", True, "grad_norm.png"),
)
TABLE = (  # (summary key, column header, format)
    ("final_reward", "final reward", ".3f"),
    ("rise", "final − warm start", "+.3f"),
    ("vs_sync", "final − sync", "+.3f"),
    ("best_reward", "best reward", ".3f"),
    ("final_train_reward", "final train reward", ".3f"),
    ("min_ess_ratio", "min ESS ratio", ".3f"),
    ("mean_ess_ratio", "mean ESS ratio", ".3f"),
    ("max_grad_norm", "max grad norm", ".3g"),
)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc}); a run cut off mid-write?") from None


def read_header(path: Path) -> dict[str, Any]:
    """The grid ``runs.jsonl`` was started for (its first line)."""
    first = next(_lines(path), {})
    if "header" not in first:
        raise ValueError(f"{path}: the first line is not the header")
    return dict(first["header"])


def read_runs(path: Path) -> list[dict[str, Any]]:
    """Every finished run in ``runs.jsonl``, in the order they finished."""
    return [row for row in _lines(path) if "header" not in row]


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def summarize(run: dict[str, Any], window: int) -> dict[str, Any]:
    """One run's figures and its verdict under the collapse rule (module docstring)."""
    steps, evals = run["steps"], run["evals"]
    total = len(steps["reward"])
    ws_reward = evals[0][1]
    final = [r for t, r in evals if t >= total - window]
    grad, loss = steps["grad_norm"], steps["loss"]
    initial = statistics.median(_finite(grad[:SPIKE_REFERENCE_STEPS]) or [math.nan])
    summary = {
        "ws_reward": ws_reward,
        "final_reward": statistics.fmean(final),
        "best_reward": max(r for _, r in evals),
        "final_train_reward": statistics.fmean(steps["reward"][-window:]),
        "min_ess_ratio": min(steps["ess_ratio"]),
        "mean_ess_ratio": statistics.fmean(steps["ess_ratio"]),
        "min_lr_scale": min(steps["lr_scale"]),
        "max_grad_norm": max(_finite(grad) or [math.nan]),
        "initial_grad_median": initial,
        "nonfinite_steps": sum(
            not (math.isfinite(g) and math.isfinite(x)) for g, x in zip(grad, loss, strict=True)
        ),
        "skipped_steps": int(sum(steps["step_skipped"])),
        "steps": total,
        "seconds": run["seconds"],
    }
    reasons = []
    if summary["nonfinite_steps"]:
        reasons.append("nonfinite")
    if summary["final_reward"] < ws_reward - REWARD_DROP:
        reasons.append("reward")
    if summary["max_grad_norm"] > SPIKE_FACTOR * initial:
        reasons.append("grad_spike")
    summary["collapsed"], summary["reasons"] = bool(reasons), reasons
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def cells(runs: list[dict[str, Any]], window: int, methods: list[str], ks: list[int]) -> list[dict[str, Any]]:
    """One entry per (method, k) of the grid, in grid order: per-seed summaries and mean/sd/min/max.

    Two paired figures take the seed's own level out (seeds warm-start to quite different rewards):
    ``rise`` = final − warm-start reward, and ``vs_sync`` = final − the final reward of the same method and
    seed at k = 0 (absent where that run has not finished)."""
    out = []
    sync = {(r["method"], r["seed"]): summarize(r, window)["final_reward"] for r in runs if r["k"] == 0}
    for method in methods:
        for k in ks:
            mine = sorted((r for r in runs if r["method"] == method and r["k"] == k), key=lambda r: r["seed"])
            per_seed = [{"seed": r["seed"], **summarize(r, window)} for r in mine]
            for s in per_seed:
                s["rise"] = s["final_reward"] - s["ws_reward"]
                if (method, s["seed"]) in sync:
                    s["vs_sync"] = s["final_reward"] - sync[method, s["seed"]]
            cell: dict[str, Any] = {
                "method": method,
                "k": k,
                "seeds": [r["seed"] for r in mine],
                "per_seed": per_seed,
            }
            if per_seed:
                for key, _, _ in TABLE:
                    values = [s[key] for s in per_seed if key in s]
                    if values:
                        cell[key] = _stats(values)
                cell["collapsed"] = sum(s["collapsed"] for s in per_seed)
                cell["reasons"] = sorted({reason for s in per_seed for reason in s["reasons"]})
            out.append(cell)
    return out


def _json_safe(value: Any) -> Any:
    """NaN/inf as null: ``stability.json`` is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _fmt(stat: dict[str, float] | None, spec: str) -> str:
    if stat is None:
        return "–"
    if stat["sd"] == 0.0:
        return format(stat["mean"], spec)
    return f"{format(stat['mean'], spec)} ± {format(stat['sd'], spec.lstrip('+'))}"


def table_rows(grid_cells: list[dict[str, Any]]) -> list[str]:
    """The Markdown table: one row per (method, k); mean ± sd over seeds."""
    head = ["method", "k", "seeds", *(title for _, title, _ in TABLE), "collapsed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in grid_cells:
        if not c["per_seed"]:
            rows.append(f"| {c['method']} | {c['k']} | 0 |" + " – |" * (len(TABLE) + 1))
            continue
        n = len(c["per_seed"])
        verdict = f"{c['collapsed']}/{n}" + (f" ({', '.join(c['reasons'])})" if c["reasons"] else "")
        values = [_fmt(c.get(key), spec) for key, _, spec in TABLE]
        rows.append(f"| {c['method']} | {c['k']} | {n} | " + " | ".join(values) + f" | {verdict} |")
    return rows


def summary_paragraph(grid_cells: list[dict[str, Any]], methods: list[str], ks: list[int]) -> str:
    """A factual paragraph generated from the numbers: each method's mean rise over its warm start at each
    k, its mean difference from its own synchronous run, and where it collapsed."""
    done = [c for c in grid_cells if c["per_seed"]]
    if not done:
        return "No run has finished yet."
    ws = {s["seed"]: s["ws_reward"] for c in done for s in c["per_seed"]}
    parts = [
        "Warm-start reward by seed: " + ", ".join(f"{seed}: {ws[seed]:.2f}" for seed in sorted(ws)) + "."
    ]
    for method in methods:
        mine = [c for c in done if c["method"] == method]
        if not mine:
            continue
        figures = []
        for c in mine:
            text = f"k={c['k']} {c['rise']['mean']:+.2f}"
            if c["k"] != 0 and "vs_sync" in c:
                text += f" ({c['vs_sync']['mean']:+.2f} vs sync)"
            figures.append(text)
        collapsed = [f"k={c['k']} ({c['collapsed']}/{len(c['per_seed'])})" for c in mine if c["collapsed"]]
        verdict = "collapsed at " + ", ".join(collapsed) if collapsed else "no collapse"
        parts.append(f"**{method}**, final − warm start: {'; '.join(figures)}; {verdict}.")
    missing = len(methods) * len(ks) - len(done)
    if missing:
        parts.append(f"{missing} cell(s) of the grid have no finished run yet.")
    return " ".join(parts)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total, kept = [], 0.0, []
    for v in values:
        kept.append(v)
        total += v
        if len(kept) > window:
            total -= kept.pop(0)
        out.append(total / len(kept))
    return out


def plot(
    path: Path, runs: list[dict[str, Any]], key: str, label: str, log: bool, methods: list[str], ks: list[int]
) -> None:
    """One panel per k, one line per method (mean over seeds; thin lines: each seed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6 * len(ks), 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(ks), sharey=True, squeeze=False)[0]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, k in zip(axes, ks, strict=True):
        for method in methods:
            mine = [r for r in runs if r["method"] == method and r["k"] == k]
            if not mine:
                continue
            if key == "eval":
                xs = [t for t, _ in mine[0]["evals"]]
                ys = [[v for _, v in r["evals"]] for r in mine]
            else:
                window = max(1, len(mine[0]["steps"][key]) // 30)
                ys = [_smooth(r["steps"][key], window) for r in mine]
                xs = list(range(len(ys[0])))
            for y in ys if len(ys) > 1 else []:
                ax.plot(xs, y, "-", lw=0.5, alpha=0.3, color=colors[method])
            mean = [statistics.fmean(col) for col in zip(*ys, strict=True)]
            ax.plot(xs, mean, "-", lw=1.6, color=colors[method], label=method)
        ax.set_title(f"k = {k}" + (" (sync)" if k == 0 else ""))
        ax.set_xlabel("learner step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(label)
    axes[-1].legend(loc="best", fontsize="small")
    fig.savefig(path)


def write_report(
    out: Path, runs_path: Path, *, window: int, grid: tuple[list[str], list[int], list[int]], command: str
) -> dict[str, Any]:
    """``stability.md``, ``stability.json`` and the PNGs in ``out``; returns the headline figures."""
    methods, ks, seeds = grid
    header, runs = read_header(runs_path), read_runs(runs_path)
    runs = [r for r in runs if r["method"] in methods and r["k"] in ks and r["seed"] in seeds]
    grid_cells = cells(runs, window, methods, ks)
    paragraph = summary_paragraph(grid_cells, methods, ks)
    run_commands = list(dict.fromkeys(r.get("command", command) for r in runs)) or [command]
    plots = {}
    for key, label, log, name in PLOTS:
        plot(out / name, runs, key, label, log, methods, ks)
        plots[key] = name
    plan = header["plan"]
    report = {
        "command": command,
        "run_commands": run_commands,
        "plan": plan,
        "window": window,
        "grid": {"methods": methods, "ks": ks, "seeds": seeds},
        "collapse_rule": COLLAPSE_RULE,
        "collapse_parameters": {
            "reward_drop": REWARD_DROP,
            "spike_factor": SPIKE_FACTOR,
            "spike_reference_steps": SPIKE_REFERENCE_STEPS,
        },
        "methods": {r["method"]: r["fields"] for r in runs},
        "cells": grid_cells,
        "summary": paragraph,
        "plots": plots,
        "runs": len(runs),
        "run_seconds": sum(r["seconds"] for r in runs),
    }
    (out / "stability.json").write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    (out / "stability.md").write_text(_markdown(report, grid_cells, plots))
    return {
        "runs": len(runs),
        "cells": len(grid_cells),
        "collapsed": {m: sum(c.get("collapsed", 0) for c in grid_cells if c["method"] == m) for m in methods},
        "final_reward": {
            m: {
                str(c["k"]): round(c["final_reward"]["mean"], 4)
                for c in grid_cells
                if c["method"] == m and c["per_seed"]
            }
            for m in methods
        },
        "run_seconds": round(report["run_seconds"], 1),
    }


def _markdown(report: dict[str, Any], grid_cells: list[dict[str, Any]], plots: dict[str, str]) -> str:
    plan, grid = report["plan"], report["grid"]
    produced = " then ".join(f"`{c}`" for c in report["run_commands"])
    rewritten = report["command"] not in report["run_commands"]
    lines = [
        "# Stability under policy lag, with and without VCPO (in miniature)",
        "",
        f"Produced by: {produced}"
        + (f" (this report rewritten by `{report['command']}`)" if rewritten else ""),
        "",
        "An **in-process replay, not the full system** (`experiments/replay.py`): the tiny built-in model after "
        f"the local preset's supervised warm start ({plan['ws_steps']} steps) learns `{plan['dataset']}` with "
        "the learner's own step (`services.learner.step.backward`), on rollouts sampled by the policy exactly "
        "k versions old (from step k on; version 0 before) with their true behaviour log-probs. Redis, gRPC, "
        "Ray, vLLM and DeepSpeed are left out: the whole system runs ~2.5 steps/s on two cores with a lag set "
        "by throughput, so this grid at k = 128 would take many hours there.",
        "",
        f"Grid: methods {', '.join(grid['methods'])}; k ∈ {{{', '.join(map(str, grid['ks']))}}}; seeds "
        f"{grid['seeds']}; {plan['steps']} learner steps of 4 prompts × 8 responses (preset `{plan['preset']}`). "
        f"Evaluation every {plan['eval_every']} steps: the learner's current policy, {plan['eval_samples']} "
        f"sample(s) per train prompt ({plan['eval_prompts'] or 'all'} prompts), the same random stream for every "
        f"cell at a given step. **final reward**: mean evaluation reward over the last {report['window']} "
        "steps; **best**: the highest evaluation; **final train reward**: mean reward of the rollouts trained on "
        f"in the last {report['window']} steps (sampled by a policy k versions old). Mean ± sd over seeds.",
        "",
        "Methods (`[learner]` fields; the rest as the preset: seq-mean-token-mean, std_normalize, no PPO clip):",
        "",
        *(f"- `{m}`: " + ", ".join(f"{k} = {v}" for k, v in f.items()) for m, f in report["methods"].items()),
        "",
        f"Collapse rule (fixed before the results): {report['collapse_rule']}.",
        "",
        "## Results",
        "",
        *table_rows(grid_cells),
        "",
        "## Summary",
        "",
        report["summary"],
        "",
        "## Plots",
        "",
        "One panel per k, one colour per method: thick lines are the mean over seeds, thin lines each seed. "
        "Per-step series are drawn as a trailing mean over steps/30 steps (so single-step gradient spikes look "
        "smaller than the table's maxima); the evaluation reward is drawn as measured.",
        "",
        *(f"![{key}]({name})" for key, name in plots.items()),
        "",
        f"Total run time {report['run_seconds'] / 60:.1f} CPU-process minutes over {report['runs']} runs.",
        "",
    ]
    return "\n".join(lines)
