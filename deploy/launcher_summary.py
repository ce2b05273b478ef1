"""What a run leaves behind when it stops: ledger.json, summary.json and the report.

    ledger.json   every group the samplers wrote, followed to what the learner did with it (deploy/ledger.py):
                  the streams' counts, the learner's checkpointed feed state and its audit log must agree;
                  taken after the learner stopped and before Redis does
    summary.json  what the launcher knows that no file says: run id, k, wall time, why it stopped, restarts
                  by service, each learner restart, the services' last figures, the ledger
    report/       deploy/report.py, from the run directory and this summary

Decides: no ledger when the learner never started or was down at the end (stopped during a restart's
backoff: it has no feed state to account against), and the launcher's exit code follows the ledger
(ray_launcher.py: 3 when it does not balance).
"""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.launcher_services import Services
from deploy.launcher_stopping import Stopping
from deploy.ledger import take_ledger
from deploy.progress import Progress


def write_ledger(services: Services, progress: Progress | None) -> None:
    """Take the ledger into the summary and ledger.json, and say whether it balanced; ``progress`` is the
    training loop's (None when the run stopped before training began)."""
    s = services
    if s.learner is None or not hasattr(s, "specs"):
        return
    if progress is None:  # stopped before training began: nothing to account for yet
        progress = Progress(s.run_dir, s.client, s.queue_keys())
    progress.log.poll()
    feed = (s.summary.get("learner") or {}).get("feed")
    dead = {n: s.specs[n].dead_letter_key for n in ("rollouts", "scored")}
    ledger = take_ledger(s.client, s.queue_keys(), dead, feed, progress.log.steps, s.cfg.run.k)
    s.summary["ledger"] = ledger
    (s.run_dir / "ledger.json").write_text(json.dumps(ledger, indent=2) + "\n")
    verdict = "balanced" if ledger["balanced"] else "NOT balanced: " + "; ".join(ledger["problems"])
    foreign = ledger["rollouts_foreign"] + ledger["scored_foreign"]
    apart = f", {foreign} foreign entries in the queues (counted apart)" if foreign else ""
    s.say(
        "ledger",
        f"{ledger['rollouts_produced']} groups sampled, {ledger.get('trained', 0)} trained, "
        f"max lag {ledger['max_trained_lag']} (k={s.cfg.run.k}){apart}: {verdict}",
    )


def write_summary_and_report(
    services: Services, stopping: Stopping, learner_restarts: list[dict[str, Any]], t0: float
) -> None:
    """summary.json (the run's figures, with the wall time since ``t0``), then the report from it."""
    from deploy.report import write_report

    s = services
    s.summary.update(
        run_id=s.cfg.run.run_id,
        k=s.cfg.run.k,
        groups_per_step=s.cfg.run.groups_per_step,
        wall_s=time.monotonic() - t0,
        stopped_by=stopping.reason,
        learner_restarts=learner_restarts,
    )
    (s.run_dir / "summary.json").write_text(json.dumps(s.summary, indent=2, default=str) + "\n")
    written = write_report(s.run_dir, s.summary)
    print(f"report: {written.markdown} (plots and report.json beside it)", flush=True)
