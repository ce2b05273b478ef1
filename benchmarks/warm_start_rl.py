"""Does RL raise the tiny model's reward after a warm start, and with which settings? (The local preset's recipe.)

The tiny built-in model (``TinyModelSpec(seed=0)``) is warm-started (``services.learner.warm_start``) on a
builtin task's train split for a few step counts, each one's sampled reward is measured at temperature 1
(8 samples per prompt, every train prompt), and then the RL loop of the local preset is simulated in plain
torch on it, for a few learning rates:

    each step: 4 train prompts (DatasetTasks order) x 8 responses, temperature 1, top-p 1, <= 32 tokens,
               cut at the stop token ─► math scorer ─► advantages (r − mean_g)/std_g (zero-std groups skipped)
               ─► loss = −mean over trajectories of A · (mean token log-prob of the response)
               ─► AdamW (weight decay 0), grad clip 1.0, float32

That is GRPO on-policy; the real system's VCPO adds importance weights for responses up to k = 4 versions
stale (sampling and learning overlap) and its OPOB baseline, which this leaves out. Reported per case: the
mean training reward of the first and the last 20 steps, the rise, and the sampled reward of the final policy
on the train prompts; and the seconds the warm start took. The last line is one JSON object with the
headline figures (for the recommended case).

    python benchmarks/warm_start_rl.py [--quick] [--dataset builtin:digit_add] [--rl-steps 150]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.config import LearnerConfig
from services.learner.grad_norms import token_logprobs
from services.learner.step import TrajectoryTensors, objective_config
from services.learner.step import backward as learner_backward
from services.learner.warm_start import (
    pad_batch,
    pad_token_id,
    policy_reward,
    sample_responses,
    sampled_reward,
    stop_token_ids,
    warm_start,
)
from services.reward.scorers import ScoreInput, get_scorer
from services.sampler.tasks import DatasetTasks, PromptEncoder, load_dataset

GROUPS_PER_STEP = 4
N = 8
MAX_TOKENS = 32
MAX_MODEL_LEN = 256
WINDOW = 20


def rl_run(
    model_dir: Path,
    dataset: str,
    *,
    steps: int,
    lr: float,
    seed: int,
    rl_seed: int,
    lag: int = 0,
    objective: str = "vcpo",
) -> tuple[list[float], Any, Any]:
    """The simulated RL loop (module docstring) on ``model_dir``'s model: each step's mean reward, the final
    model and its tokenizer. ``seed`` is the dataset's (the run's) seed; ``rl_seed`` drives the task order
    and the sampling; ``lag`` is how many versions behind the learner the sampling policy is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoder = PromptEncoder(tokenizer, MAX_MODEL_LEN, MAX_TOKENS)
    stops = stop_token_ids(tokenizer, model.generation_config)
    pad = pad_token_id(tokenizer)
    score = get_scorer("math")
    config = objective_config(LearnerConfig(objective=objective))
    tasks = DatasetTasks(load_dataset(dataset, split="train", seed=seed), seed=rl_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(rl_seed)
    versions = [copy.deepcopy(model.state_dict())]  # versions[v]: the policy after v steps
    rewards_per_step = []
    for step in range(steps):
        sampler.load_state_dict(versions[max(0, step - lag)])
        batch = [tasks.next() for _ in range(GROUPS_PER_STEP)]
        prompts = [encoder.encode(task) for task in batch]
        responses = sample_responses(sampler, prompts, n=N, max_tokens=MAX_TOKENS, stop_ids=stops, pad_id=pad,
                                     generator=generator)  # fmt: skip
        rows = [(prompt, r) for prompt, group in zip(prompts, responses, strict=True) for r in group]
        rewards = [
            score(ScoreInput(tokenizer.decode(r, skip_special_tokens=True), task.reference)).value
            for task, group in zip(batch, responses, strict=True)
            for r in group
        ]
        rewards_per_step.append(statistics.fmean(rewards))
        ids, attention, response_mask = pad_batch(rows, pad)
        with torch.no_grad():  # the sampler's log-probs: at temperature 1, vLLM's processed log-probs
            behaviour = token_logprobs(sampler, ids, attention)
        trajectories = TrajectoryTensors(ids, attention, response_mask, behaviour, torch.tensor(rewards),
                                         torch.arange(len(rows)) // N)  # fmt: skip
        model.train()
        optimizer.zero_grad(set_to_none=True)
        metrics = learner_backward(model, trajectories, config)
        for group in optimizer.param_groups:  # lr ← η₀ · s(ρ), as the learner sets it each step
            group["lr"] = lr * metrics["lr_scale"]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        versions.append(copy.deepcopy(model.state_dict()))
        if len(versions) > lag + 1:
            versions[-lag - 2] = {}  # no longer sampled from
    model.eval()
    return rewards_per_step, model, tokenizer


def _csv(text: str, kind: type, default: list[Any]) -> list[Any]:
    return [kind(part) for part in text.split(",")] if text else default


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small run that takes seconds")
    parser.add_argument("--dataset", default="builtin:digit_add")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed: model init, dataset, warm start")
    parser.add_argument("--ws-steps", default="", help="comma-separated warm-start step counts")
    parser.add_argument("--ws-lr", type=float, default=3e-3)
    parser.add_argument("--ws-batch", type=int, default=16)
    parser.add_argument("--rl-lrs", default="", help="comma-separated RL learning rates")
    parser.add_argument("--rl-steps", type=int, default=0, help="RL steps per case (default 150; quick: 6)")
    parser.add_argument("--rl-seeds", type=int, default=0, help="RL runs per case (default 3; quick: 1)")
    parser.add_argument(
        "--lag", type=int, default=0, help="versions the sampling policy is behind (k = 4: <= 4)"
    )
    parser.add_argument(
        "--objective", default="vcpo", choices=["vcpo", "grpo"], help="the learner's objective"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ws_steps = _csv(args.ws_steps, int, [20] if args.quick else [100, 150, 200])
    rl_lrs = _csv(args.rl_lrs, float, [1e-3] if args.quick else [1e-4, 3e-4, 1e-3])
    rl_steps = args.rl_steps or (6 if args.quick else 150)
    rl_seeds = args.rl_seeds or (1 if args.quick else 3)
    window = min(WINDOW, max(1, rl_steps // 3))
    train_tasks = load_dataset(args.dataset, split="train", seed=args.seed)
    eval_tasks = train_tasks[:4] if args.quick else train_tasks

    results: list[dict[str, Any]] = []
    print(f"{'ws_steps':>8} {'ws_s':>5} {'ws_rew':>6} {'rl_lr':>7} {'first':>6} {'last':>6} {'rise':>6} "
          f"{'min_rise':>8} {'final':>6} {'rl_s':>5}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "base", TinyModelSpec(seed=args.seed))
        for steps in ws_steps:
            t0 = time.monotonic()
            ws_dir = warm_start(base, Path(tmp) / f"ws{steps}", args.dataset, steps=steps, lr=args.ws_lr,
                                batch_size=args.ws_batch, seed=args.seed, threads=args.threads)  # fmt: skip
            ws_s = time.monotonic() - t0
            ws_reward = sampled_reward(ws_dir, args.dataset, n_prompts=len(eval_tasks), n_samples=N,
                                       seed=args.seed)  # fmt: skip
            for lr in rl_lrs:
                firsts, lasts, finals, seconds = [], [], [], []
                for rl_seed in range(rl_seeds):
                    t0 = time.monotonic()
                    rewards, model, tokenizer = rl_run(ws_dir, args.dataset, steps=rl_steps, lr=lr,
                                                         seed=args.seed, rl_seed=rl_seed, lag=args.lag, objective=args.objective)  # fmt: skip
                    seconds.append(time.monotonic() - t0)
                    firsts.append(statistics.fmean(rewards[:window]))
                    lasts.append(statistics.fmean(rewards[-window:]))
                    finals.append(policy_reward(model, tokenizer, eval_tasks, n_samples=N, seed=args.seed))
                rises = [b - a for a, b in zip(firsts, lasts, strict=True)]
                row = {"ws_steps": steps, "ws_s": ws_s, "ws_reward": ws_reward, "rl_lr": lr,
                       "first": statistics.fmean(firsts), "last": statistics.fmean(lasts),
                       "rise": statistics.fmean(rises), "min_rise": min(rises),
                       "final": statistics.fmean(finals), "rl_s": statistics.fmean(seconds)}  # fmt: skip
                results.append(row)
                print(f"{steps:>8} {ws_s:>5.1f} {ws_reward:>6.3f} {lr:>7.0e} {row['first']:>6.3f} "
                      f"{row['last']:>6.3f} {row['rise']:>+6.3f} {row['min_rise']:>+8.3f} {row['final']:>6.3f} "
                      f"{row['rl_s']:>5.1f}", flush=True)  # fmt: skip
    best = max(results, key=lambda r: r["min_rise"])
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()}))


if __name__ == "__main__":
    main()
