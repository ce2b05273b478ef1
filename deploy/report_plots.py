"""The run report's plots: one PNG per step figure (reward, ESS ratio, LR scale, grad norm), the staleness
histogram and the throughput per service; accuracy.png is drawn by deploy/report_eval.py.

Decides: a plot is written only when there is data for it, otherwise it is skipped with the reason (which
report.md lists); a step series gets a trailing rolling mean once it is at least twice the window long
(window: a twentieth of the steps, at least 3). matplotlib is imported here only, inside the functions, and
only its Agg canvas: no pyplot, no global backend, and importing the report costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.report_common import finite
from deploy.report_eval import Evaluation, plot_accuracy
from deploy.report_figures import STEP_PLOTS, THROUGHPUT, Json, JsonlFile, rate, series

PLOT_NAMES = (*STEP_PLOTS, "staleness", "throughput", "accuracy")  # each written as <name>.png


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
            if (y := rate(r, key)) is not None:
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
    if any(rate(r, key) is not None for r in progress.rows for key in THROUGHPUT):
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
