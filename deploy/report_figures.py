"""The run report's figures: the files a run left behind, read leniently, and the headline numbers of
report.json computed from them.

Reading: a missing or empty file, a truncated last line, a step redone after a restart, NaN or null figures
are all expected of a partial run; nothing is dropped silently: unparseable lines and superseded step lines
are counted (:class:`JsonlFile`) and named in report.md. What the figures decide:

- reward "start" and "end" are the means over the first and last ``max(1, n // 10)`` steps that have a
  finite reward, so one noisy step does not decide the headline;
- the lag bound holds when every *trained* group's lag is at most k; dropped groups may exceed k (that is
  why they were dropped) and are counted apart;
- a throughput mean is over the progress samples where that service had reported a finite value;
- the ledger is the launcher's summary's, else the last one progress.jsonl sampled (which says nothing of
  balance).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.report_common import finite

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


def rate(row: Json, key: str) -> float | None:
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
    rates = {key: [v for p in progress.rows if (v := rate(p, key)) is not None] for key in THROUGHPUT}
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
