"""The run report's page, report.md: the header table, then one section per question (data read, learning,
held-out accuracy, staleness, throughput, ledger, faults and restarts, plots).

Decides the wording only: every figure comes from report_figures.py (and report_eval.py for accuracy), a
figure that is missing reads "n/a" or says why, and the lag bound's verdict names how many trained groups
exceeded k.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deploy.report_common import fmt, table
from deploy.report_eval import Evaluation, evaluation_markdown
from deploy.report_figures import THROUGHPUT, Json, JsonlFile


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
    plots: Mapping[str, Path],
    skipped: Mapping[str, str],
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
    images = ["\n\n".join(f"![{name}]({path.name})" for name, path in plots.items()) or "No plots."]
    if skipped:
        images += ["", "Skipped plots:", "", *(f"- `{n}.png`: {why}" for n, why in skipped.items())]
    sections = [
        [f"# Run report: {s['run_id'] or 'unknown run'}", "", *table(("", ""), header)],
        ["## Data", "", *data],
        ["## Learning", "", *_learning(s)],
        ["## Held-out accuracy", "", *evaluation_markdown(evaluation)],
        ["## Staleness", "", *_staleness(s["staleness"], k)],
        ["## Throughput (mean over progress samples)", "", *table(("service", "mean"), throughput)],
        ["## Ledger", "", *_ledger(s["ledger"], s["ledger_source"])],
        ["## Faults and restarts", "", *_faults(s["faults"])],
        ["## Plots", "", *images],
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"
