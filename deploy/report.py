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
and named in report.md. This module decides where the inputs come from (``k`` and the run id: the caller,
then the summary, then config.resolved.json, then the directory's name) and writes the outputs atomically
(a reader, or a second Ctrl-C, never sees half a report); the work is in four modules:

    deploy/report_figures.py   read the JSONL files, compute report.json's figures (and what they decide)
    deploy/report_eval.py      held-out accuracy: mean@n and pass@n per set against version, training time
                               and GPU-hours; its figures, tables and accuracy.png
    deploy/report_plots.py     the other PNGs, each only when there is data for it
    deploy/report_markdown.py  report.md

They never import this module: ``python -m deploy.report`` runs it as ``__main__``, and importing it back
would load it twice.

    python -m deploy.report RUN_DIR [--k K]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.report_eval import load_evaluation, summarize_evaluation
from deploy.report_figures import Json, load_steps, read_jsonl, summarize
from deploy.report_markdown import render_markdown
from deploy.report_plots import write_plots


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
    _write_text(
        paths.markdown, render_markdown(figures, steps, progress, plots, skipped, metrics, evaluation)
    )
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
