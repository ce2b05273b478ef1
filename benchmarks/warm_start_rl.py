"""Does RL raise the tiny model's reward after a warm start, and with which settings? (The local preset's recipe.)

For each run seed, the tiny built-in model (``TinyModelSpec(seed)``) is warm-started
(``services.learner.warm_start``) on a builtin task's train split for a few step counts; each warm start's
sampled reward is measured at temperature 1 (8 samples per prompt, every train prompt, and the held-out
split); then the RL loop of the local preset is simulated in one process on it, for a few learning rates:

    each step: 4 train prompts (DatasetTasks order) x 8 responses sampled by a policy `lag` versions old
               (temperature 1, top-p 1, <= 32 tokens, cut at the stop token) ─► the reward service's `math`
               scorer ─► the learner's own step: services.learner.step.backward with the [learner] defaults
               (VCPO: OPOB baseline, truncated importance weights C = 8, seq-mean-token-mean, lr × s(ESS))
               ─► grad clip 1.0, AdamW (weight decay 0), float32

The sampler's behaviour log-probs are the lagged policy's log-softmax (vLLM's processed log-probs at
temperature 1). ``--lag 4`` (the default) is the worst staleness k = 4 allows: every step learns from
responses four versions old; ``--lag 0`` is on-policy; ``--objective grpo`` swaps the objective.

Reported per case (mean over the run seeds, and the smallest rise): the mean training reward of the first
and the last 20 RL steps, the rise, and the sampled reward of the final policy on the train prompts; the
warm start's seconds and rewards; and the recommended case's reward curve in 25-step windows. The last line is
one JSON object with the recommended settings and their figures.

    python benchmarks/warm_start_rl.py [--quick] [--seeds 0,1,2] [--ws-steps 50,100,150] [--rl-lrs ...]
        [--lora-rank 16 --lora-alpha 32]   (RL trains LoRA adapters on the warm-started model)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from experiments.replay import Replay, ReplaySettings
from services.common.datasets import load_dataset
from services.common.lora import LoraConfig
from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.config import LearnerConfig
from services.learner.policy_sampling import policy_reward
from services.learner.vcpo import objective_config
from services.learner.warm_start import warm_start

GROUPS_PER_STEP = 4
N = 8
MAX_TOKENS = 32
MAX_MODEL_LEN = 256
WINDOW = 20
CURVE_WINDOW = 25
RECOMMENDED = {"dataset": "builtin:digit_add", "ws_steps": 100, "ws_lr": 1e-3, "ws_batch": 16, "rl_lr": 1e-4}


def rl_run(
    model_dir: Path,
    dataset: str,
    *,
    steps: int,
    lr: float,
    seed: int,
    lag: int = 4,
    objective: str = "vcpo",
    lora: LoraConfig | None = None,
) -> tuple[list[float], Any, Any]:
    """The simulated RL loop (module docstring; ``experiments.replay``) on ``model_dir``'s model: each step's
    mean reward, the final model and its tokenizer. ``seed`` generates the dataset (as the run's seed does)
    and drives the task order and the sampling; ``lag`` is how many versions behind the learner the sampling
    policy is; ``lora``: train LoRA adapters on the frozen model instead of every weight."""
    config = objective_config(LearnerConfig(objective=objective))
    settings = ReplaySettings(
        groups_per_step=GROUPS_PER_STEP, n=N, max_tokens=MAX_TOKENS, max_model_len=MAX_MODEL_LEN, lr=lr
    )
    replay = Replay(model_dir, dataset, config, seed=seed, lag=lag, settings=settings, lora=lora)
    rewards_per_step = [replay.step()["reward"] for _ in range(steps)]
    replay.model.eval()
    return rewards_per_step, replay.model, replay.tokenizer


def _csv(text: str, kind: type, default: list[Any]) -> list[Any]:
    return [kind(part) for part in text.split(",")] if text else default


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small run that takes seconds")
    parser.add_argument("--dataset", default=RECOMMENDED["dataset"])
    parser.add_argument(
        "--seeds", default="", help="run seeds: model init, data, warm start, RL (default 0,1,2)"
    )
    parser.add_argument("--ws-steps", default="", help="warm-start step counts (default 50,100,150)")
    parser.add_argument("--ws-lr", type=float, default=RECOMMENDED["ws_lr"])
    parser.add_argument("--ws-batch", type=int, default=RECOMMENDED["ws_batch"])
    parser.add_argument("--rl-lrs", default="", help="RL learning rates (default 5e-5,1e-4,2e-4,4e-4)")
    parser.add_argument("--rl-steps", type=int, default=0, help="RL steps per case (default 150; quick: 6)")
    parser.add_argument("--lag", type=int, default=4, help="versions the sampling policy is behind (k = 4)")
    parser.add_argument(
        "--objective", default="vcpo", choices=["vcpo", "grpo"], help="the learner's objective"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="RL trains LoRA adapters of this rank (0: every weight)"
    )
    parser.add_argument("--lora-alpha", type=int, default=0, help="LoRA alpha (0: 2 x rank)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per model load
    seeds = _csv(args.seeds, int, [0] if args.quick else [0, 1, 2])
    ws_steps = _csv(args.ws_steps, int, [20] if args.quick else [50, 100, 150])
    rl_lrs = _csv(args.rl_lrs, float, [1e-4] if args.quick else [5e-5, 1e-4, 2e-4, 4e-4])
    rl_steps = args.rl_steps or (6 if args.quick else 150)
    window = min(WINDOW, max(1, rl_steps // 3))
    eval_prompts = 4 if args.quick else None  # None: every prompt of the split

    warm: dict[tuple[int, int], dict[str, float]] = {}
    runs: dict[tuple[int, float], list[dict[str, Any]]] = {}
    curves: dict[tuple[int, float], list[list[float]]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            base = build_tiny_model(Path(tmp) / f"base{seed}", TinyModelSpec(seed=seed))
            train = load_dataset(args.dataset, split="train", seed=seed)[:eval_prompts]
            held_out = load_dataset(args.dataset, split="test", seed=seed)[:eval_prompts]
            for steps in ws_steps:
                t0 = time.monotonic()
                ws_dir = warm_start(
                    base,
                    Path(tmp) / f"ws{seed}-{steps}",
                    args.dataset,
                    steps=steps,
                    lr=args.ws_lr,
                    batch_size=args.ws_batch,
                    seed=seed,
                    threads=args.threads,
                )
                ws_s = time.monotonic() - t0
                model, tokenizer = _load(ws_dir)
                warm[seed, steps] = {
                    "seconds": ws_s,
                    "train": policy_reward(model, tokenizer, train, n_samples=N, seed=seed),
                    "held_out": policy_reward(model, tokenizer, held_out, n_samples=N, seed=seed),
                }
                for lr in rl_lrs:
                    t0 = time.monotonic()
                    rewards, model, tokenizer = rl_run(
                        ws_dir,
                        args.dataset,
                        steps=rl_steps,
                        lr=lr,
                        seed=seed,
                        lag=args.lag,
                        objective=args.objective,
                        lora=LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha),
                    )
                    first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
                    runs.setdefault((steps, lr), []).append(
                        {
                            "first": first,
                            "last": last,
                            "rise": last - first,
                            "rl_s": time.monotonic() - t0,
                            "final": policy_reward(model, tokenizer, train, n_samples=N, seed=seed),
                        }
                    )
                    curves.setdefault((steps, lr), []).append(rewards)
                    print(
                        f"# seed {seed} warm start {steps} steps (reward {warm[seed, steps]['train']:.3f}) "
                        f"RL lr {lr:g}: {first:.3f} -> {last:.3f}",
                        file=sys.stderr,
                        flush=True,
                    )

    print(
        f"warm start on {args.dataset}: lr {args.ws_lr:g}, batch {args.ws_batch}; sampled reward at "
        f"temperature 1, {N} samples per prompt; mean over seeds {seeds}"
    )
    print(f"{'ws_steps':>8} {'seconds':>7} {'train':>6} {'held_out':>8} {'min_train':>9} {'max_train':>9}")
    for steps in ws_steps:
        rows = [warm[s, steps] for s in seeds]
        trains = [r["train"] for r in rows]
        print(
            f"{steps:>8} {_mean(rows, 'seconds'):>7.1f} {statistics.fmean(trains):>6.3f} "
            f"{_mean(rows, 'held_out'):>8.3f} {min(trains):>9.3f} {max(trains):>9.3f}"
        )
    print(
        f"\nRL ({args.objective}, lag {args.lag}, {rl_steps} steps of {GROUPS_PER_STEP} x {N}"
        f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}): mean training "
        f"reward of the first and last {window} steps; mean over seeds, min_rise the smallest"
    )
    print(
        f"{'ws_steps':>8} {'rl_lr':>7} {'first':>6} {'last':>6} {'rise':>6} {'min_rise':>8} {'final':>6} "
        f"{'rl_s':>5}"
    )
    for (steps, lr), rows in runs.items():
        print(
            f"{steps:>8} {lr:>7g} {_mean(rows, 'first'):>6.3f} {_mean(rows, 'last'):>6.3f} "
            f"{_mean(rows, 'rise'):>+6.3f} {min(r['rise'] for r in rows):>+8.3f} {_mean(rows, 'final'):>6.3f} "
            f"{_mean(rows, 'rl_s'):>5.1f}"
        )

    key = (RECOMMENDED["ws_steps"], RECOMMENDED["rl_lr"])
    if key not in runs:  # e.g. --quick: report the best case measured instead
        key = max(runs, key=lambda k: _mean(runs[k], "rise"))
    curve = [statistics.fmean(values) for values in zip(*curves[key], strict=True)]
    windows = [statistics.fmean(curve[i : i + CURVE_WINDOW]) for i in range(0, len(curve), CURVE_WINDOW)]
    print(
        f"\ncurve (ws_steps {key[0]}, rl_lr {key[1]:g}), mean reward per {CURVE_WINDOW}-step window: "
        + " ".join(f"{w:.2f}" for w in windows)
    )
    rows = runs[key]
    ws_rows = [warm[s, key[0]] for s in seeds]
    print(
        json.dumps(
            {
                "dataset": args.dataset,
                "ws_steps": key[0],
                "ws_lr": args.ws_lr,
                "ws_batch": args.ws_batch,
                "rl_lr": key[1],
                "objective": args.objective,
                "lag": args.lag,
                "rl_steps": rl_steps,
                "seeds": seeds,
                "ws_seconds": round(_mean(ws_rows, "seconds"), 2),
                "ws_reward": round(_mean(ws_rows, "train"), 4),
                "ws_held_out_reward": round(_mean(ws_rows, "held_out"), 4),
                "rl_first": round(_mean(rows, "first"), 4),
                "rl_last": round(_mean(rows, "last"), 4),
                "rl_rise": round(_mean(rows, "rise"), 4),
                "rl_min_rise": round(min(r["rise"] for r in rows), 4),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )


def _load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    main()
