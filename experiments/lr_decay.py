"""Does the local preset learn better with its learning rate decayed? (Why ``local.toml`` sets ``lr_decay``.)

The local preset's RL loop, replayed in one process (``experiments/replay.py``: the learner's own step on
rollouts exactly ``--lag`` versions old, with their true behaviour log-probs) on the tiny model after the
preset's supervised warm start, once per (schedule, seed). Schedules, all from the preset's η₀:

    constant   the rate the preset had before
    preset     the preset's own [learner] lr_decay, lr_decay_steps and lr_min_ratio
    linear:T   linear to the preset's lr_min_ratio over T steps, then held (any number of these)

Every ``--eval-every`` steps the learner's current policy is scored on the held-out split
(``builtin:tail_add``'s 200 test numbers, 4 samples each at temperature 0.8, as the preset's evaluation
samples them, without its top-p; the same random stream for every schedule at a given step), so each line
compares schedules on the same seed. The training reward's rise (the mean of the last 50 steps before each
evaluation against the first 50) is printed too: the end-to-end test checks both.

The last line is one JSON object: per schedule, the held-out mean@4 at every evaluation (mean over seeds),
the per-seed value at the last step, and how many seeds ended above ``constant``.

    python experiments/lr_decay.py [--steps 700] [--seeds 0,1,2,3] [--schedules constant,preset,linear:700]
                                   [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.stability import load_preset

PRESET = "deploy/presets/local.toml"
WINDOW = 50


def schedule_fields(name: str, preset: Any) -> dict[str, Any]:
    """``name``'s ReplaySettings fields (module docstring)."""
    le = preset.learner
    if name == "constant":
        return {"lr_decay": "constant", "lr_decay_steps": 0, "lr_min_ratio": 0.0}
    if name == "preset":
        return {"lr_decay": le.lr_decay, "lr_decay_steps": le.lr_decay_steps, "lr_min_ratio": le.lr_min_ratio}
    kind, _, steps = name.partition(":")
    if kind not in ("linear", "cosine") or not steps.isdigit() or int(steps) < 1:
        raise SystemExit(f"unknown schedule {name!r}: constant, preset, linear:STEPS or cosine:STEPS")
    return {"lr_decay": kind, "lr_decay_steps": int(steps), "lr_min_ratio": le.lr_min_ratio}


def warm_model(work_dir: str, ws_steps: int) -> Path:
    """The preset's model after its warm start (built once per work dir)."""
    from services.common.tiny_model import TinyModelSpec, build_tiny_model
    from services.learner.warm_start import warm_start

    preset = load_preset(PRESET)
    la, work = preset.launcher, Path(work_dir)
    base = build_tiny_model(work / "base", TinyModelSpec(seed=preset.run.seed))
    return warm_start(
        base,
        work / f"warm{ws_steps}",
        preset.sampler.dataset,
        steps=ws_steps,
        lr=la.warm_start_lr,
        batch_size=la.warm_start_batch_size,
        seed=preset.run.seed,
        threads=1,
    )


def run_one(model: str, schedule: str, seed: int, steps: int, lag: int, eval_every: int) -> dict[str, Any]:
    """One replayed run; its training rewards and held-out evaluations (in a worker process)."""
    import torch
    from transformers.utils import logging as hf_logging

    from experiments.replay import Replay, ReplaySettings
    from services.common.datasets import load_dataset
    from services.learner.vcpo import objective_config

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    preset = load_preset(PRESET)
    s, le, heldout = preset.sampler, preset.learner, preset.evaluation.sets[0]
    settings = ReplaySettings.from_preset(preset, **schedule_fields(schedule, preset))
    replay = Replay(Path(model), s.dataset, objective_config(le), seed=seed, lag=lag, settings=settings)
    tasks = load_dataset(heldout.dataset, split=heldout.split, seed=preset.run.seed)
    started, rewards, evals = time.monotonic(), [], []
    for t in range(1, steps + 1):
        rewards.append(replay.step()["reward"])
        if t % eval_every == 0 or t == steps:
            score = replay.evaluate(
                tasks, n_samples=heldout.n, seed=seed * 1_000_003 + t, temperature=heldout.temperature
            )
            evals.append((t, score))
    return {
        "schedule": schedule,
        "seed": seed,
        "rewards": rewards,
        "evals": evals,
        "seconds": time.monotonic() - started,
    }


def rise(rewards: list[float], window: int = WINDOW) -> float:
    """The mean training reward of the last ``window`` steps minus that of the first ``window``."""
    w = min(window, len(rewards) // 2) or 1
    return statistics.fmean(rewards[-w:]) - statistics.fmean(rewards[:w])


def summarize(runs: list[dict[str, Any]], schedules: list[str]) -> dict[str, Any]:
    by = {(r["schedule"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    base = [by[("constant", seed)]["evals"][-1][1] for seed in seeds] if "constant" in schedules else None
    out: dict[str, Any] = {}
    for name in schedules:
        mine = [by[(name, seed)] for seed in seeds]
        points = [t for t, _ in mine[0]["evals"]]
        curve = {t: statistics.fmean(dict(r["evals"])[t] for r in mine) for t in points}
        final = [r["evals"][-1][1] for r in mine]
        out[name] = {
            "heldout_mean_at_n": {str(t): round(v, 4) for t, v in curve.items()},
            "final_per_seed": [round(v, 4) for v in final],
            "final_mean": round(statistics.fmean(final), 4),
            "reward_rise_mean": round(statistics.fmean(rise(r["rewards"]) for r in mine), 4),
            "seeds_above_constant": None
            if base is None
            else sum(f > b for f, b in zip(final, base, strict=True)),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=700, help="learner steps per run (the e2e test's 700)")
    parser.add_argument("--seeds", default="0,1,2,3", help="sampling and task-order seeds")
    parser.add_argument("--schedules", default="constant,preset,linear:700", help="module docstring")
    parser.add_argument("--lag", type=int, default=4, help="staleness of every step's rollouts (k = 4)")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--ws-steps", type=int, default=0, help="warm-start steps (0: the preset's)")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes of 1 thread)")
    parser.add_argument("--work-dir", default="/tmp/vcpo-lr-decay", help="the warm-started model (reused)")
    parser.add_argument("--quick", action="store_true", help="8 steps, 1 seed, a 20-step warm start")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.ws_steps = 8, "0", 4, 20
    preset = load_preset(PRESET)
    schedules = args.schedules.split(",")
    for name in schedules:
        schedule_fields(name, preset)  # a bad name fails here, before any run
    seeds = [int(x) for x in args.seeds.split(",")]
    model = str(warm_model(args.work_dir, args.ws_steps or preset.launcher.warm_start_steps))
    started, runs = time.monotonic(), []
    with ProcessPoolExecutor(max_workers=max(1, args.workers), mp_context=get_context("spawn")) as pool:
        futures = [
            pool.submit(run_one, model, name, seed, args.steps, args.lag, args.eval_every)
            for seed in seeds
            for name in schedules
        ]
        for future in as_completed(futures):
            run = future.result()
            runs.append(run)
            curve = " ".join(f"{v:.3f}" for _, v in run["evals"])
            print(
                f"[{time.monotonic() - started:5.0f}s] {run['schedule']:<12} seed {run['seed']}: held-out "
                f"mean@n every {args.eval_every} steps {curve}; reward rise {rise(run['rewards']):+.3f}",
                flush=True,
            )
    print(json.dumps({"steps": args.steps, "lag": args.lag, "seeds": seeds, **summarize(runs, schedules)}))


if __name__ == "__main__":
    main()
