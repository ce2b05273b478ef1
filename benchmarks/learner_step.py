"""Learner step time on DeepSpeed ZeRO-3 ranks: VCPO against plain GRPO, and publishing.

By default 2 ranks on the CPU (gloo, fp32); ``--device cuda`` runs the learner's GPU settings (a GPU per rank,
NCCL, bf16; one rank unless --ranks says more).

On a Qwen2 model of about 10M parameters (built by code), one step's batch of 2 scored groups of 8
trajectories (64 prompt + 192 response tokens), one whole group per rank, timed side by side in one run
(the order alternates every round). Each rank's 8 trajectories are one micro-batch (--micro-batch), so GRPO
is exactly one forward and one backward; with several micro-batches the learner's GRPO path first scores
all rows without a graph (for whole-step statistics) and VCPO's relative cost falls.

  grpo      Trainer.train_step with objective "grpo": forward + backward per micro-batch, AdamW step
  vcpo      Trainer.train_step with objective "vcpo": norm pass per micro-batch, global ESS, coefficients,
            one backward handing every parameter its weighted gradient, AdamW step
  publish   publish_version of the new weights to a weight-broker process (its TCP data plane), ZeRO-3 parameters
            gathered bucket by bucket (after every step)

Reported: median seconds over --rounds rounds, and the ratios. The last line is one JSON object with the
headline figures: vcpo_over_grpo (target <= 1.5) and publish_over_step (publish over a VCPO step).

--mixed: trajectories of mixed lengths, as a base model samples them: each rank holds 4 groups of 16 (the 7B
math preset's 64 rows per rank; 2 groups in --quick), a 128-token prompt and responses up to --max-response
tokens (2048), drawn from a long tail (log-normal, median 30% of the maximum) with 5% of the step's
trajectories cut at the maximum; 4 rows per micro-batch unless --micro-batch says otherwise. One VCPO step on
the same batch, timed two ways side by side (the order alternates every round):

  trimmed   the learner's step: rows sorted by length, each micro-batch run at its own longest row
  padded    every micro-batch at the rank's longest row, rows in group order (the layout before trimming;
            ``Trainer.full_width``, a switch kept for this comparison only)

Reported: computed_over_real_tokens (positions run through the model over the real tokens among them,
counted by a hook on the decoder, every forward of the step; target <= 1.2), the same for the padded step, and
step_time_over_padded (the trimmed step's median time over the padded one's).

    python benchmarks/learner_step.py [--quick] [--rounds 5] [--device cuda] [--size 200m]
    python benchmarks/learner_step.py --mixed [--quick] [--max-response 2048] [--device cuda] [--size 200m]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vcpo_step import SPEC_QUICK, SPECS
from benchmarks.weight_sync import start_broker
from services.common.tiny_model import build_tiny_model, count_parameters
from services.learner.local_ranks import run_ranks, scored_groups

TARGET_VCPO_OVER_GRPO = 1.5
TARGET_COMPUTED_OVER_REAL = 1.2
AT_MAXIMUM = 0.05  # the share of a mixed step's trajectories cut at the maximum length


def _rank(
    rank: int,
    model_dir: str,
    groups: list[Any],
    broker: tuple[str, str],
    rounds: int,
    micro: int,
    gpus: int,
) -> dict[str, Any]:
    from services.learner.batching import place_groups, to_tensors
    from services.learner.config import LearnerConfig
    from services.learner.publish import publish_version
    from services.learner.trainer import Trainer
    from services.learner.vcpo import objective_config
    from services.weight_transport.transport import WeightTransport

    torch.set_num_threads(1)  # two ranks share this machine's cores
    configs = {
        name: LearnerConfig(objective=name, micro_batch_size=micro, lr=1e-5, gpus_per_rank=gpus)
        for name in ("grpo", "vcpo")
    }
    trainer = Trainer(configs["vcpo"], model_dir)
    batch = to_tensors([groups[i] for i in place_groups(groups, trainer.world_size)[rank]])
    transport = WeightTransport(*broker) if rank == 0 else None
    times: dict[str, list[float]] = {"grpo": [], "vcpo": [], "publish": []}
    for r in range(rounds + 1):  # round 0 warms up (allocations, first gathers) and is not counted
        order = ("grpo", "vcpo") if r % 2 else ("vcpo", "grpo")
        for name in order:
            trainer.objective = objective_config(configs[name])
            torch.distributed.barrier()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            torch.distributed.barrier()
            t1 = time.perf_counter()
            publish_version(trainer.module, transport, trainer.version, rank)
            torch.distributed.barrier()
            t2 = time.perf_counter()
            if r:
                times[name].append(t1 - t0)
                times["publish"].append(t2 - t1)
    return {
        "times": times,
        "tokens": float(batch.attention_mask.sum()),
        "rows": len(batch),
        "backend": trainer.backend,
        "precision": trainer.precision,
    }


def long_tailed_lengths(rows: int, maximum: int, seed: int = 0) -> list[int]:
    """Response lengths of ``rows`` trajectories: 5% (at least one) at ``maximum``, the rest log-normal with
    median 30% of it (a sampled response's length has a long right tail), below the maximum."""
    rng = random.Random(seed)
    lengths = [
        max(1, min(maximum - 1, int(rng.lognormvariate(math.log(0.3 * maximum), 0.7)))) for _ in range(rows)
    ]
    for i in rng.sample(range(rows), max(1, round(AT_MAXIMUM * rows))):
        lengths[i] = maximum
    return lengths


def mixed_groups(model_dir: Path, groups: int, size: int, prompt: int, maximum: int) -> list[Any]:
    """``groups`` scored groups of ``size`` whose responses have :func:`long_tailed_lengths`."""
    out = scored_groups(model_dir, [size] * groups, (maximum, maximum), prompt, noise=0.05)
    lengths = iter(long_tailed_lengths(groups * size, maximum))
    for group in out:
        for t in group.trajectories:  # a prefix of a response keeps its behaviour log-probs
            keep = next(lengths)
            del t.response_tokens[keep:], t.behaviour_logprobs[keep:], t.loss_mask[keep:]
    return out


def _rank_mixed(
    rank: int, model_dir: str, groups: list[Any], rounds: int, micro: int, gpus: int
) -> dict[str, Any]:
    from services.learner.batching import place_groups, to_tensors
    from services.learner.config import LearnerConfig
    from services.learner.trainer import Trainer

    torch.set_num_threads(1)  # two ranks share this machine's cores
    trainer = Trainer(
        LearnerConfig(objective="vcpo", micro_batch_size=micro, lr=1e-5, gpus_per_rank=gpus), model_dir
    )
    batch = to_tensors([groups[i] for i in place_groups(groups, trainer.world_size)[rank]])
    counted = {"positions": 0, "real": 0}

    def count(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        counted["positions"] += kwargs["input_ids"].numel()
        counted["real"] += int(kwargs["attention_mask"].sum())

    trainer.module.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
    times: dict[str, list[float]] = {"trimmed": [], "padded": []}
    counts: dict[str, dict[str, int]] = {}
    for r in range(rounds + 1):  # round 0 warms up (allocations, first gathers) and is not counted
        for name in ("trimmed", "padded") if r % 2 else ("padded", "trimmed"):
            trainer.full_width = name == "padded"
            counted.update(positions=0, real=0)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            torch.distributed.barrier()
            if r:
                times[name].append(time.perf_counter() - t0)
            counts[name] = dict(counted)
    return {
        "times": times,
        "counts": counts,
        "tokens": int(batch.attention_mask.sum()),
        "rows": len(batch),
        "width": int(batch.input_ids.shape[1]),
        "backend": trainer.backend,
        "precision": trainer.precision,
    }


def mixed(args: argparse.Namespace, spec: Any, gpus: int, ranks: int) -> None:
    """The --mixed mode (module docstring)."""
    prompt, maximum = (16, 96) if args.quick else (128, args.max_response)
    per_rank = 2 if args.quick else 4
    rounds = 2 if args.quick else args.rounds
    micro = args.micro_batch or 4
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec)
        params = count_parameters(model_dir)
        groups = mixed_groups(model_dir, per_rank * ranks, 16, prompt, maximum)
        results = run_ranks(_rank_mixed, ranks, str(model_dir), groups, rounds, micro, gpus, timeout_s=3600)
    med = {name: statistics.median(results[0]["times"][name]) for name in ("trimmed", "padded")}
    ratio = {
        name: sum(r["counts"][name]["positions"] for r in results)
        / sum(r["counts"][name]["real"] for r in results)
        for name in med
    }
    tokens, rows = sum(r["tokens"] for r in results), sum(r["rows"] for r in results)
    lengths = [len(g.prompt_tokens) + len(t.response_tokens) for g in groups for t in g.trajectories]
    print(
        f"model: {params / 1e6:.1f}M parameters; {ranks} ZeRO-3 rank(s) ({results[0]['backend']}, "
        f"{results[0]['precision']}); {rows} trajectories of {prompt}+[1, {maximum}] tokens (mean "
        f"{statistics.mean(lengths):.0f}, {sum(n == prompt + maximum for n in lengths)} at the maximum), "
        f"micro-batch {micro}; {rounds} rounds; rank widths {[r['width'] for r in results]}"
    )
    print(f"{'step':<10}{'median s':>10}{'min s':>10}{'tokens/s':>10}{'computed/real':>15}")
    for name in ("trimmed", "padded"):
        ts = results[0]["times"][name]
        print(f"{name:<10}{med[name]:>10.3f}{min(ts):>10.3f}{tokens / med[name]:>10.0f}{ratio[name]:>15.3f}")
    figures = {
        "computed_over_real_tokens": round(ratio["trimmed"], 4),
        "padded_computed_over_real_tokens": round(ratio["padded"], 4),
        "step_time_over_padded": round(med["trimmed"] / med["padded"], 3),
        "trimmed_step_s": round(med["trimmed"], 4),
        "padded_step_s": round(med["padded"], 4),
        "rows": rows,
        "real_tokens": tokens,
        "rows_at_maximum": sum(n == prompt + maximum for n in lengths),
        "max_response": maximum,
        "parameters": params,
        "ranks": ranks,
        "device": args.device,
        "backend": results[0]["backend"],
        "precision": results[0]["precision"],
        "micro_batch": micro,
        "rounds": rounds,
        "target_computed_over_real_tokens": TARGET_COMPUTED_OVER_REAL,
        "meets_computed_over_real_tokens": ratio["trimmed"] <= TARGET_COMPUTED_OVER_REAL,
    }
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small model and short sequences (for tests)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed rounds (one step of each objective each)"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="trajectories per micro-batch on each rank (8; --mixed: 4)"
    )
    parser.add_argument("--mixed", action="store_true", help="mixed lengths: trimmed against padded steps")
    parser.add_argument("--max-response", type=int, default=2048, help="--mixed: the longest response")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: one GPU per rank, NCCL and bf16 (the learner's GPU settings); cpu: gloo and fp32",
    )
    parser.add_argument("--ranks", type=int, default=0, help="learner ranks (default: 2 on CPU, 1 on CUDA)")
    parser.add_argument("--size", choices=list(SPECS), default="10m", help="the model (without --quick)")
    args = parser.parse_args()
    spec = SPEC_QUICK if args.quick else SPECS[args.size]
    prompt, response = (16, 48) if args.quick else (64, 192)
    rounds = 2 if args.quick else args.rounds
    gpus = 1 if args.device == "cuda" else 0
    ranks = args.ranks or (1 if gpus else 2)
    if gpus and torch.cuda.device_count() < ranks:
        parser.error(f"--ranks {ranks} needs {ranks} GPUs; this machine has {torch.cuda.device_count()}")
    if args.mixed:
        mixed(args, spec, gpus, ranks)
        return
    args.micro_batch = args.micro_batch or 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec)
        params = count_parameters(model_dir)
        groups = scored_groups(model_dir, [8] * max(ranks, 2), (response, response), prompt, noise=0.05)
        broker, address, data_address = start_broker(Path(tmp))
        try:
            results = run_ranks(
                _rank,
                ranks,
                str(model_dir),
                groups,
                (address, data_address),
                rounds,
                args.micro_batch,
                gpus,
                timeout_s=1800,
            )
        finally:
            broker.stop()
    times = results[0]["times"]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = sum(r["tokens"] for r in results)
    rows = sum(r["rows"] for r in results)
    print(
        f"model: {params / 1e6:.1f}M parameters; {ranks} ZeRO-3 rank(s) ({results[0]['backend']}, "
        f"{results[0]['precision']}); "
        f"{rows} trajectories of {prompt}+{response} tokens, micro-batch {args.micro_batch}; {rounds} rounds"
    )
    print(f"{'phase':<10}{'median s':>10}{'min s':>10}{'tokens/s':>10}")
    for name in ("grpo", "vcpo", "publish"):
        rate = f"{tokens / med[name]:>10.0f}" if name != "publish" else f"{'':>10}"
        print(f"{name:<10}{med[name]:>10.3f}{min(times[name]):>10.3f}{rate}")
    ratio = med["vcpo"] / med["grpo"]
    figures = {
        "vcpo_over_grpo": round(ratio, 3),
        "publish_over_step": round(med["publish"] / med["vcpo"], 3),
        "grpo_step_s": round(med["grpo"], 4),
        "vcpo_step_s": round(med["vcpo"], 4),
        "publish_s": round(med["publish"], 4),
        "parameters": params,
        "ranks": ranks,
        "device": args.device,
        "backend": results[0]["backend"],
        "precision": results[0]["precision"],
        "micro_batch": args.micro_batch,
        "rounds": rounds,
        "target_vcpo_over_grpo": TARGET_VCPO_OVER_GRPO,
        "meets_vcpo_over_grpo": ratio <= TARGET_VCPO_OVER_GRPO,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
