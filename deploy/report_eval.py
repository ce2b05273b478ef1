"""The run report's held-out accuracy: ``<run_dir>/metrics.jsonl``'s eval lines as a plot, tables, figures.

The launcher appends to metrics.jsonl a ``{"kind": "eval", ...}`` line per validation set each time it
evaluates a policy version (mean@n: the mean over tasks of the fraction of the n samples that are correct;
pass@n: the fraction of tasks with at least one correct sample), and a ``{"kind": "train", ...}`` line per
learner step. What this module decides:

- eval lines are grouped by set, one point per version; for a repeated (set, version) the last line counts
  and the earlier ones are counted as superseded (an evaluation redone after a restart);
- an eval line without a non-empty string ``set``, an integer ``version``, and ``mean_at_n`` and
  ``pass_at_n`` that are finite numbers in [0, 1] is counted as bad; train lines and other kinds are only
  counted; nothing is dropped silently;
- ``train_seconds`` and ``gpu_hours`` are null when unknown (or not a finite number >= 0); a point without
  ``train_seconds`` is left out of the time panel of accuracy.png (counted) but stays in the tables;
- "first" and "last" are the lowest and highest version of a set, "best" its highest mean@n (the lowest
  version on a tie).

``deploy.report`` (and its plots and report.md modules) import this module and never the reverse
(``python -m deploy.report`` runs that module as ``__main__``, so importing it back would load it twice); the
helpers they share are in deploy/report_common.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.report_common import finite, fmt, table

Json = dict[str, Any]
ACCURACY = ("mean_at_n", "pass_at_n")
MAX_TABLE_ROWS = 12  # a set with more points shows the first, the last and evenly spaced ones between
# x-axes of accuracy.png: (point key, axis label, divisor); the GPU-hours panel only when a point has > 0
PANELS: tuple[tuple[str, str, float], ...] = (
    ("version", "policy version", 1.0),
    ("train_seconds", "training wall time (min)", 60.0),
    ("gpu_hours", "GPU-hours", 1.0),
)
HOW_TO_CONFIGURE = (
    "To measure held-out accuracy during a run, add an `[evaluation]` table with one `[[evaluation.sets]]` "
    "per validation set to the run file."
)


def _non_negative(value: Any) -> float | None:
    x = finite(value)
    return x if x is not None and x >= 0 else None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _point(row: Json) -> Json | None:
    """One eval line as a point, or None when it lacks what a point needs (a bad line)."""
    name, version = row.get("set"), row.get("version")
    mean, passed = (_non_negative(row.get(key)) for key in ACCURACY)
    if not isinstance(name, str) or not name or type(version) is not int:
        return None
    if mean is None or passed is None or mean > 1 or passed > 1:
        return None
    return {
        "version": version,
        "train_seconds": _non_negative(row.get("train_seconds")),
        "gpu_hours": _non_negative(row.get("gpu_hours")),
        "mean_at_n": mean,
        "pass_at_n": passed,
        "tasks": _count(row.get("tasks")),
        "n": _count(row.get("n")),
    }


def set_n(points: list[Json]) -> int | None:
    """The n of a set's points when they agree on one (points without n aside), else None."""
    ns = {p["n"] for p in points if p["n"] is not None}
    return ns.pop() if len(ns) == 1 else None


@dataclass
class Evaluation:
    """The eval points of metrics.jsonl by set (sorted by name; points in version order), and the counts."""

    file_exists: bool
    sets: dict[str, list[Json]] = field(default_factory=dict)
    eval_lines: int = 0  # every eval line: the points, the superseded and the bad ones
    bad: int = 0
    superseded: int = 0
    train_lines: int = 0
    other_kinds: Counter[str] = field(default_factory=Counter)

    def counts(self) -> Json:
        return {
            "eval_lines": self.eval_lines,
            "points": sum(len(points) for points in self.sets.values()),
            "bad_eval_lines": self.bad,
            "superseded_eval_lines": self.superseded,
            "train_lines": self.train_lines,
            "other_kinds": dict(sorted(self.other_kinds.items())),
        }

    def describe(self) -> str:
        """What the lines of metrics.jsonl were, for the report's data section."""
        points = sum(len(points) for points in self.sets.values())
        parts = [f"{self.eval_lines} eval lines ({points} points in {len(self.sets)} sets)"]
        if self.bad:
            parts.append(
                f"{self.bad} bad eval lines skipped (no set, version, mean_at_n or pass_at_n, "
                "or an accuracy that is not a number in [0, 1])"
            )
        if self.superseded:
            parts.append(f"{self.superseded} superseded by a later line for the same set and version")
        parts.append(f"{self.train_lines} train lines")
        if self.other_kinds:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.other_kinds.items()))
            parts.append(f"other kinds ignored ({kinds})")
        return ", ".join(parts)

    def missing_reason(self) -> str | None:
        """Why there is no point to show, or None when there is one."""
        if self.sets:
            return None
        if not self.file_exists:
            return "no metrics.jsonl"
        if not self.eval_lines:
            return "no eval line in metrics.jsonl"
        return f"none of the {self.eval_lines} eval lines in metrics.jsonl is valid"


def load_evaluation(rows: Iterable[Json], file_exists: bool = True) -> Evaluation:
    """The eval points of metrics.jsonl's object lines, in file order (the last line for a version wins)."""
    evaluation = Evaluation(file_exists)
    latest: dict[str, dict[int, Json]] = {}
    for row in rows:
        kind = row.get("kind")
        if kind == "train":
            evaluation.train_lines += 1
        elif kind != "eval":
            evaluation.other_kinds["(no kind)" if kind is None else str(kind)] += 1
        elif (point := _point(row)) is None:
            evaluation.eval_lines += 1
            evaluation.bad += 1
        else:
            evaluation.eval_lines += 1
            by_version = latest.setdefault(row["set"], {})
            evaluation.superseded += point["version"] in by_version
            by_version[point["version"]] = point
    evaluation.sets = {
        name: [by_version[v] for v in sorted(by_version)] for name, by_version in sorted(latest.items())
    }
    return evaluation


def summarize_evaluation(evaluation: Evaluation) -> Json:
    """report.json's "evaluation": per set its n, its points by version, and the first, last and best."""
    return {
        name: {
            "n": set_n(points),
            "points": points,
            "first": points[0],
            "last": points[-1],
            "best": max(points, key=lambda p: p["mean_at_n"]),  # max keeps the first (lowest version) tie
        }
        for name, points in evaluation.sets.items()
    }


# --- accuracy.png (matplotlib's Agg canvas only, imported here only, as in deploy/report_plots.py) ---


def plot_accuracy(path: Path, sets: Mapping[str, list[Json]]) -> Any:
    """Accuracy against version and training time (and GPU-hours when any > 0); returns the Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gpu = any((p["gpu_hours"] or 0) > 0 for points in sets.values() for p in points)
    panels = PANELS if gpu else PANELS[:2]
    fig = Figure(figsize=(4.6 * len(panels), 3.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        left_out = 0
        for i, (name, points) in enumerate(sets.items()):
            shown = [p for p in points if p[key] is not None]
            left_out += len(points) - len(shown)
            if not shown:
                continue
            n = set_n(points)
            at = f"@{n}" if n is not None else "@n"
            xs = [p[key] / scale for p in shown]
            color = f"C{i % 10}"
            ax.plot(xs, [p["mean_at_n"] for p in shown], "-o", color=color, ms=4, label=f"{name} mean{at}")
            ax.plot(xs, [p["pass_at_n"] for p in shown], "--x", color=color, ms=4, label=f"{name} pass{at}")
        title = f"accuracy against {label.split(' (')[0]}"
        if left_out:
            title += f"\n({left_out} points without {key} left out)"
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {key} recorded", transform=ax.transAxes, ha="center", color="gray")
        ax.set(title=title, xlabel=label, ylim=(-0.03, 1.03))
        ax.title.set_fontsize("medium")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    handles, labels = axes[0].get_legend_handles_labels()  # every point has a version: every set is here
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize="small")
    fig.savefig(path)
    return fig


# --- report.md ---


def table_points(points: list[Json], limit: int = MAX_TABLE_ROWS) -> list[Json]:
    """All the points if there are at most ``limit``, else the first, the last and evenly spaced between."""
    if len(points) <= limit:
        return points
    return [points[round(i * (len(points) - 1) / (limit - 1))] for i in range(limit)]


def _set_section(name: str, points: list[Json]) -> list[str]:
    n = set_n(points)
    at = f"@{n}" if n is not None else "@n"
    shown = table_points(points)
    rows = [
        (
            p["version"],
            "n/a" if p["train_seconds"] is None else f"{p['train_seconds'] / 60:.1f} min",
            fmt(p["gpu_hours"], ".3f"),
            fmt(p["mean_at_n"]),
            fmt(p["pass_at_n"]),
            "n/a" if p["tasks"] is None else p["tasks"],
        )
        for p in shown
    ]
    header = ("version", "training time", "GPU-hours", f"mean{at}", f"pass{at}", "tasks")
    lines = [f"### {name}", "", *table(header, rows), ""]
    if len(shown) < len(points):
        lines += [
            f"{len(shown)} of {len(points)} evaluations shown: the first, the last and evenly spaced ones "
            "between (all of them in report.json).",
            "",
        ]
    first, last = points[0], points[-1]
    best = max(points, key=lambda p: p["mean_at_n"])
    if len(points) == 1:
        lines.append(
            f"- one evaluation: mean{at} {fmt(first['mean_at_n'])}, pass{at} {fmt(first['pass_at_n'])} "
            f"(version {first['version']})"
        )
    else:
        lines.append(
            f"- first → last: mean{at} {fmt(first['mean_at_n'])} → {fmt(last['mean_at_n'])}, "
            f"pass{at} {fmt(first['pass_at_n'])} → {fmt(last['pass_at_n'])} "
            f"(version {first['version']} → {last['version']})"
        )
    lines.append(f"- best mean{at}: {fmt(best['mean_at_n'])} at version {best['version']}")
    if n is None and any(p["n"] is not None for p in points):
        ns = ", ".join(str(v) for v in sorted({p["n"] for p in points if p["n"] is not None}))
        lines.append(f"- n differs between evaluations ({ns}).")
    if untimed := sum(p["train_seconds"] is None for p in points):
        lines.append(
            f"- {untimed} of {len(points)} evaluations have no training time (`train_seconds` unknown) "
            "and are left out of the time panel of accuracy.png."
        )
    return lines


def evaluation_markdown(evaluation: Evaluation) -> list[str]:
    """The body of report.md's "Held-out accuracy" section."""
    if (why := evaluation.missing_reason()) is not None:
        return [f"No evaluation was recorded ({why}). {HOW_TO_CONFIGURE}"]
    lines = [
        "mean@n: the mean over tasks of the fraction of the n samples that are correct; pass@n: the fraction "
        "of tasks with at least one correct sample. Training time is the learner's wall time when the "
        "version was published."
    ]
    for name, points in evaluation.sets.items():
        lines += ["", *_set_section(name, points)]
    notes = []
    if evaluation.bad:
        notes.append(f"- {evaluation.bad} bad eval lines were skipped (see Data).")
    if evaluation.superseded:
        notes.append(
            f"- {evaluation.superseded} eval lines were superseded by a later line for the same set and "
            "version (the later one counts)."
        )
    return [*lines, "", *notes] if notes else lines
