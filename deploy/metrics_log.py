"""The run's metrics log, ``<run_dir>/metrics.jsonl``: what a user reads (and the report plots) to judge a run.

    learner/steps.jsonl (one line per step) ──► {"kind": "train", step, version, train_seconds, gpu_hours,
                                                 reward_mean, ess_ratio, lr_scale, grad_norm, lag_mean, ...}
    Redis vcpo:<run>:eval:results (evaluators) ──► {"kind": "eval", set, version, mean_at_n, pass_at_n, n,
                                                 tasks, train_seconds, gpu_hours, ...}  (evaluator/metrics.py)

Written by the launcher at each progress line and once more when the run stops. ``train_seconds`` and
``gpu_hours`` are the training wall time and GPU-hours when the step's version was published (the run's
clock, services/common/clock.py), the x axis of accuracy-against-time curves. A resumed run appends: the steps
and evaluation records already in the file are not written again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import redis

from deploy.progress import StepLog
from services.common.clock import RunClock, eval_results_key
from services.learner.metric_names import objective_metrics

TRAIN_METRICS = ("ess_ratio", "lr_scale", "grad_norm", "loss")


def train_record(
    step: dict[str, Any], train_seconds: float | None, gpu_hours: float | None
) -> dict[str, Any]:
    """The metrics-log line of one learner step (from its steps.jsonl line)."""
    lags = [float(x) for x in step.get("lags", [])]
    metrics = step.get("metrics", {})
    reward = step.get("reward_mean")
    own = objective_metrics(metrics)  # the ones an objective declares (docs/research/adding-an-objective.md)
    return {
        "kind": "train",
        "step": int(step["step"]),
        "version": int(step["version"]),
        "time": step.get("time"),
        "train_seconds": train_seconds,
        "gpu_hours": gpu_hours,
        "reward_mean": reward if isinstance(reward, int | float) and math.isfinite(reward) else None,
        **{name: metrics.get(name) for name in TRAIN_METRICS},
        "lag_mean": sum(lags) / len(lags) if lags else None,
        "groups": len(step.get("groups", [])),
        **({"objective_metrics": own} if own else {}),
    }


class MetricsLog:
    def __init__(self, run_dir: Path, client: redis.Redis, run_id: str) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.client, self.key = client, eval_results_key(run_id)
        self.clock = RunClock(client, run_id)
        self.steps = StepLog(run_dir / "learner" / "steps.jsonl")
        self.latest_eval: dict[str, dict[str, Any]] = {}  # set -> its newest record
        self.evals_written, self.last_step = 0, 0
        self._scan()

    def _scan(self) -> None:
        """What an earlier run of the launcher on this run directory already wrote."""
        if not self.path.exists():
            return
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "eval":
                self.evals_written += 1
                self._note(record)
            elif record.get("kind") == "train":
                self.last_step = max(self.last_step, int(record.get("step", 0)))

    def _note(self, record: dict[str, Any]) -> None:
        name = str(record.get("set"))
        if int(record.get("version", -1)) >= int(self.latest_eval.get(name, {}).get("version", -1)):
            self.latest_eval[name] = record

    def poll(self) -> int:
        """Append the steps and evaluation records that are new since the last poll; how many lines."""
        lines = []
        for step in sorted(self.steps.poll(), key=lambda s: int(s["step"])):
            if int(step["step"]) <= self.last_step:
                continue  # written before (a resumed run's launcher rereads the whole audit log)
            seconds, gpu_hours = self.clock.at(int(step["version"]))
            lines.append(train_record(step, seconds, gpu_hours))
            self.last_step = int(step["step"])
        raw: Any = self.client.lrange(self.key, self.evals_written, -1)
        for item in raw:
            record = json.loads(item)
            lines.append(record)
            self._note(record)
        self.evals_written += len(raw)
        if lines:
            with self.path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        return len(lines)

    def latest(self) -> dict[str, dict[str, Any]]:
        """Each set's newest evaluation: version, mean@n and pass@n (for the progress line)."""
        return {
            name: {
                "version": r.get("version"),
                "n": r.get("n"),
                "mean_at_n": r.get("mean_at_n"),
                "pass_at_n": r.get("pass_at_n"),
            }
            for name, r in sorted(self.latest_eval.items())
        }
