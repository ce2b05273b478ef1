"""What the launcher shows while a run goes: one progress line every few seconds, and the same figures as
JSON lines in ``<run_dir>/progress.jsonl`` (the run report plots throughput from them).

    learner/steps.jsonl (rank 0, one line per step) ──► StepLog.poll(): new steps, the last line per step wins
    Redis: XINFO entries-added of rollouts and scored  ─┐
    sampler replicas' tokens/s (their status)           ├─► Progress.sample() ─► progress.jsonl + the line
    the steps read since the last sample                ─┘

Rates are deltas between two samples over the time between them, so they are the run's real throughput
(restarts, back-pressure and waits included), not a service's best case.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis


class StepLog:
    """Incremental reader of the learner's audit log; a partly written last line waits for the next poll,
    a line that never parses (a kill mid-write) is skipped and counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: dict[int, dict[str, Any]] = {}  # step -> its last line
        self.unreadable = 0
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        new: list[dict[str, Any]] = []
        consumed = 0
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break  # still being written
            consumed += len(raw)
            try:
                record = json.loads(raw)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                self.unreadable += 1
                continue
            self.steps[step] = record
            new.append(record)
        self._offset += consumed
        return new

    def latest(self) -> dict[str, Any] | None:
        return self.steps[max(self.steps)] if self.steps else None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def entries_added(client: redis.Redis, key: str) -> int:
    """Entries ever added to a stream (consumers delete acknowledged ones, so XLEN would undercount)."""
    try:
        info: Any = client.xinfo_stream(key)
    except redis.ResponseError:  # no such stream yet
        return 0
    return int(info["entries-added"])


@dataclass
class Progress:
    """Samples the run's figures; :meth:`sample` returns one progress.jsonl record and writes it."""

    run_dir: Path
    client: redis.Redis
    stream_keys: dict[str, str]  # "rollouts", "scored" -> Redis key
    started: float = field(default_factory=time.time)
    log: StepLog = field(init=False)
    _last: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log = StepLog(self.run_dir / "learner" / "steps.jsonl")
        self.path = self.run_dir / "progress.jsonl"

    def sample(
        self,
        sampler_tokens_per_s: float | None,
        sampler_busy_s: float | None = None,
        evaluation: dict[str, dict[str, Any]] | None = None,
        eval_abandoned: float | None = None,
    ) -> dict[str, Any]:
        """``evaluation``: each validation set's newest result (metrics_log.MetricsLog.latest);
        ``eval_abandoned``: the sampler replicas' evaluation rounds abandoned so far (shared placement)."""
        now = time.time()
        new = self.log.poll()
        latest = self.log.latest()
        rollouts = entries_added(self.client, self.stream_keys["rollouts"])
        scored = entries_added(self.client, self.stream_keys["scored"])
        tokens = sum(float(s.get("timings", {}).get("tokens_all_ranks", 0.0)) for s in new)
        dt = now - self._last.get("time", self.started)
        reward_rate = (scored - self._last.get("scored", scored)) / dt if self._last and dt > 0 else None
        recent = new or ([latest] if latest else [])
        lags = [float(x) for s in recent for x in s.get("lags", [])]
        metrics = latest.get("metrics", {}) if latest else {}
        record = {
            "time": now,
            "elapsed_s": now - self.started,
            "step": int(latest["step"]) if latest else 0,
            "version": int(latest["version"]) if latest else 0,
            "reward_mean": _mean([s.get("reward_mean", math.nan) for s in recent]),
            "ess_ratio": metrics.get("ess_ratio"),
            "lag_mean": _mean(lags),
            "lag_max": max(lags, default=None),
            "throughput": {
                "sampler_tokens_per_s": sampler_tokens_per_s,
                "reward_groups_per_s": reward_rate,
                "learner_tokens_per_s": tokens / dt if self._last and dt > 0 else None,
            },
            "busy_s": {  # running totals: seconds each service spent working (not waiting)
                "sampler": sampler_busy_s,
                "learner": sum(
                    float(s.get("timings", {}).get("step_s", 0.0))
                    + float(s.get("timings", {}).get("publish_s", 0.0))
                    for s in self.log.steps.values()
                ),
            },
            "ledger": {
                "rollouts_added": rollouts,
                "scored_added": scored,
                "groups_trained": sum(len(s.get("groups", [])) for s in self.log.steps.values()),
            },
            "eval": evaluation or {},
            "eval_abandoned": eval_abandoned,
        }
        self._last = {"time": now, "scored": float(scored)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def progress_line(r: dict[str, Any]) -> str:
    """``[  62s] step 14 v14 | reward 0.31 | ess 0.97 | lag 1.8 (max 3/k=4) | 2,345 tok/s | ...``"""
    t = r["throughput"]
    lag = f"lag {_fmt(r['lag_mean'], '.1f')} (max {_fmt(r['lag_max'], '.0f')})"
    return (
        f"[{r['elapsed_s']:6.0f}s] step {r['step']:>4} v{r['version']:<4} | reward {_fmt(r['reward_mean'], '.3f')}"
        f" | ess {_fmt(r['ess_ratio'], '.3f')} | {lag} | {_fmt(t['sampler_tokens_per_s'], ',.0f')} tok/s sampled"
        f" | scored {_fmt(t['reward_groups_per_s'], '.2f')} groups/s"
        f" | rollouts {r['ledger']['rollouts_added']} scored {r['ledger']['scored_added']}"
        f" trained {r['ledger']['groups_trained']}"
        + "".join(
            f" | {name} mean@{e.get('n')} {_fmt(e.get('mean_at_n'), '.3f')} (v{e.get('version')})"
            for name, e in r.get("eval", {}).items()
        )
        # a round abandoned leaves its version without a point: say so where the accuracy is shown
        + (
            f" | eval rounds abandoned {r['eval_abandoned']:.0f} (evaluation.max_delay_s)"
            if r.get("eval_abandoned")
            else ""
        )
    )
