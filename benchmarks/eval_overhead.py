"""What held-out evaluation on the samplers costs training: the same learner steps with and without it.

The local preset is launched twice, one run after the other (``python -m deploy.launch``, each with its own
local Ray, Redis and run directory, every port a free one): once with its ``[evaluation]`` removed, once with
it on the sampler's engine (``placement = "shared"``) every ``--every`` versions. Both run the same steps at
the same k.

    window        time of step N's line in learner/steps.jsonl − time of step 1's line (start-up left out);
                  per-step wall = window / (N − 1)
    slowdown      per-step wall with evaluation / without
    rounds        evaluation rounds the sampler finished (and abandoned), from its summary
    hold_s        seconds newer versions waited for a round to finish generating (the sampler's summary):
                  the training delay evaluation caused directly, bounded per round by evaluation.max_delay_s;
                  the rest of the slowdown is the engine's time shared between the two
    held_fraction hold_s / the run's window: measured within one run, so machine noise does not enter it
                  (the slowdown compares two runs one after the other: on a shared, noisy machine a few
                  percent either way is noise)
    round_s       mean wall time of a round (generation and scoring) from the metrics log

    python benchmarks/eval_overhead.py [--quick] [--steps 300] [--every 50] [--out DIR] [--SECTION.KEY VALUE ...]

Any other ``--section.key value`` pair is a launcher override given to both runs alike. Prints each run's
progress, then a table, then as its last line one JSON object with the figures. Exits non-zero if a run fails,
stops short of its steps or its ledger does not balance. A dedicated evaluator (``placement = "dedicated"``)
takes no engine time from the samplers; on the 2-core box it would take CPU time from them instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.async_speedup import (
    _rounded,
    launch,
    launch_arguments,
    logged_steps,
    parse_with_overrides,
    run_overrides,
)


def window_step_s(run_dir: Path, steps: int, what: str) -> float:
    log = logged_steps(run_dir, steps, what)
    return float(log[steps]["time"] - log[1]["time"]) / (steps - 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch_arguments(parser, "learner steps per run (default 300; quick: 40)")
    parser.add_argument(
        "--every", type=int, default=0, help="versions between evaluations (default 50; quick: 20)"
    )
    parser.add_argument("--k", type=int, default=4, help="k of both runs")
    args, overrides = parse_with_overrides(parser)
    steps = args.steps or (40 if args.quick else 300)
    every = args.every or (20 if args.quick else 50)
    if steps < 3 or every < 1:
        parser.error("need --steps >= 3 and --every >= 1")
    # quick: no warm start, so the untrained model's responses run to max_tokens and a round takes longer than
    # the preset's budget allows; a wider one keeps the rounds (what is measured) from being abandoned
    extra = run_overrides(args, overrides, quick=["--evaluation.max_delay_s", "60"])
    with_eval = ["--evaluation.placement", "shared", "--evaluation.every", str(every)]

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        figures: dict[str, float] = {}
        for name, evaluation in (("without", False), ("with", True)):
            run_dir = out / name
            print(f"{name} evaluation: {steps} steps on {args.preset}, run directory {run_dir}", flush=True)
            launch(
                args.preset.resolve(),
                run_dir,
                args.k,
                steps,
                extra + (with_eval if evaluation else []),
                args.timeout,
                evaluation=evaluation,
            )
            figures[f"step_s_{name}"] = window_step_s(run_dir, steps, f"{name}-evaluation")
        summary = json.loads((out / "with" / "summary.json").read_text())
        samplers = summary.get("samplers") or []
        rounds = {
            k: sum(s.get("evaluation_rounds", {}).get(k, 0) for s in samplers) for k in ("done", "abandoned")
        }
        hold_s = sum(s.get("evaluation_hold_s", 0.0) for s in samplers)
        records = [json.loads(x) for x in (out / "with" / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if r["kind"] == "eval"]
        max_delay = json.loads((out / "with" / "config.resolved.json").read_text())["evaluation"][
            "max_delay_s"
        ]
    if not samplers or rounds["done"] == 0 or not evals:
        raise RuntimeError(
            f"the run with evaluation finished no evaluation round: {rounds}, {len(evals)} records"
        )
    slowdown = figures["step_s_with"] / figures["step_s_without"]
    round_s = statistics.fmean(r["eval_seconds"] for r in evals)
    tasks = evals[0]["tasks"] * evals[0]["n"]
    print(
        f"\npreset {args.preset}, k = {args.k}, {steps} learner steps per run, shared evaluation every {every} "
        f"versions ({tasks} responses a round); window = step 1's line to step {steps}'s"
    )
    print(f"{'run':<9}{'step_s':>8}{'rounds':>8}{'abandoned':>11}{'hold_s':>8}{'round_s':>9}")
    print(f"{'without':<9}{figures['step_s_without']:>8.3f}{'-':>8}{'-':>11}{'-':>8}{'-':>9}")
    print(
        f"{'with':<9}{figures['step_s_with']:>8.3f}{rounds['done']:>8}{rounds['abandoned']:>11}{hold_s:>8.2f}"
        f"{round_s:>9.2f}"
    )
    held_fraction = hold_s / (figures["step_s_with"] * (steps - 1))
    print(
        f"slowdown with evaluation: {slowdown:.3f}x; newer versions held {hold_s:.1f}s over {rounds['done']} "
        f"round(s) (at most max_delay_s = {max_delay:g}s each), {held_fraction:.1%} of the run's window"
    )
    result = {
        **figures,
        "slowdown": slowdown,
        "rounds_done": rounds["done"],
        "rounds_abandoned": rounds["abandoned"],
        "hold_s": hold_s,
        "hold_s_per_round": hold_s / rounds["done"],
        "held_fraction": held_fraction,
        "round_s": round_s,
        "steps": steps,
        "every": every,
        "k": args.k,
        "max_delay_s": max_delay,
        "responses_per_round": tasks,
        "eval_versions": [r["version"] for r in evals],
        "overrides": " ".join(overrides),
    }
    print(json.dumps(_rounded(result)))


if __name__ == "__main__":
    main()
