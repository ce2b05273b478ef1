"""LoRA against full fine-tuning on the learner: what a version would weigh, a step's time and its memory.

On a Qwen2-shaped model of about 32M parameters built by code (8 layers of width 512, head_dim 64), 2 DeepSpeed
ZeRO-3 ranks on the CPU (gloo, fp32; ``--device cuda``: one GPU per rank, NCCL, bf16), VCPO steps on one batch
of 2 scored groups of 8 trajectories (64 prompt + 192 response tokens), one group per rank:

  version_bytes_over_full   a LoRA version's bytes (publish = "adapter", the default: the adapters alone, rank
                            16 on every attention and MLP projection) over a full fine-tuning version's (the
                            whole model), both from the trainers' publish manifests (tensor_specs): what
                            travels to the samplers per version (target <= 0.05)
  step_time_over_full       a LoRA step's median time over a full fine-tuning step's, the two trainers held by
                            the same ranks and stepped alternately, round by round
  peak_memory_over_full     the growth of a rank's peak memory from before its trainer is built to after its
                            steps, LoRA over full (each in processes of its own; on a GPU
                            torch.cuda.max_memory_allocated; on the CPU the resident set's high-water mark,
                            ru_maxrss, which also holds what the allocator keeps after tensors are freed)
  estimated_peak_over_full  the learner's start-up estimate of a rank's peak (services/learner/memory.py: model
                            states counted, the step's tensors simulated), LoRA over full, for the same step

  serve_time_over_full      the seconds from a publish until a sampler's vLLM engine serves the version (through a
                            broker process, the sampler's fetch, prepare and apply), an adapter version over a
                            full one, medians of 3 (benchmarks/_publish_to_serve.py); needs vLLM, so not with
                            --device cuda on a machine without it

The last line is one JSON object with the figures.

    python benchmarks/lora.py [--quick] [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.tiny_model import TinyModelSpec, build_tiny_model, count_parameters
from services.learner.local_ranks import run_ranks, scored_groups

SPEC = TinyModelSpec(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=2048,
    vocab_size=1024,
)
SPEC_QUICK = TinyModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
RANK = 16
TARGET_VERSION_BYTES = 0.05


def _config(lora: bool, gpus: int) -> Any:
    from services.learner.config import LearnerConfig

    return LearnerConfig(
        objective="vcpo", micro_batch_size=8, lr=1e-5, gpus_per_rank=gpus, lora={"rank": RANK if lora else 0}
    )


def _batch(trainer: Any, groups: list[Any], rank: int) -> Any:
    from services.learner.batching import place_groups, to_tensors

    return to_tensors([groups[i] for i in place_groups(groups, trainer.world_size)[rank]])


def _times(rank: int, model_dir: str, groups: list[Any], rounds: int, gpus: int) -> dict[str, Any]:
    """Both trainers on these ranks, stepped alternately (the order flips every round)."""
    from services.learner.publish import tensor_specs
    from services.learner.trainer import Trainer

    torch.set_num_threads(1)  # two ranks share this machine's cores
    trainers = {name: Trainer(_config(name == "lora", gpus), model_dir) for name in ("full", "lora")}
    batch = _batch(trainers["full"], groups, rank)
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for r in range(rounds + 1):  # round 0 warms up and is not counted
        for name in ("full", "lora") if r % 2 else ("lora", "full"):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            trainers[name].train_step(batch)
            torch.distributed.barrier()
            if r:
                times[name].append(time.perf_counter() - t0)
    # what a version of each weighs: the manifest each trainer publishes (LoRA: the adapters alone)
    version = {name: sum(s.nbytes for s in tensor_specs(t.module)) for name, t in trainers.items()}
    return {"times": times, "version_bytes": version, "precision": trainers["full"].precision}


def _memory(rank: int, model_dir: str, groups: list[Any], lora: bool, steps: int, gpus: int) -> int:
    """Bytes this rank's peak grew by while its trainer was built and stepped."""
    from services.learner.trainer import Trainer

    torch.set_num_threads(1)
    cuda = gpus > 0 and torch.cuda.is_available()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = Trainer(_config(lora, gpus), model_dir)
    batch = _batch(trainer, groups, rank)
    for _ in range(steps):
        trainer.train_step(batch)
    if cuda:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def _estimate(model_dir: Path, lora: bool, tokens: int, ranks: int, gpus: int) -> int:
    """The start-up estimate of a rank's peak for this benchmark's step (one micro-batch of 8 rows, saved)."""
    from transformers import AutoConfig

    from services.learner.memory import CUDA_CONTEXT, GiB, plan_memory

    learner = _config(lora, gpus).model_copy(update={"max_sequence_tokens": tokens, "memory_mode": "saved"})
    cuda = gpus > 0
    plan = plan_memory(
        AutoConfig.from_pretrained(model_dir),
        learner,
        "bf16" if cuda else "fp32",
        ranks,
        1024 * GiB,
        CUDA_CONTEXT if cuda else 0,
        device_type="cuda" if cuda else "cpu",
    )
    return plan.peak("saved")


def _serve(model_dir: Path) -> dict[str, Any] | None:
    """The publish-to-serve figures, or None (said) where vLLM is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: the time from publish to serve is not measured")
        return None
    from benchmarks._publish_to_serve import run_publish_to_serve
    from services.common.lora import LoraConfig

    return run_publish_to_serve(model_dir, LoraConfig(rank=RANK))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 0.5M-parameter model, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    gpus = 1 if args.device == "cuda" else 0
    ranks = 2 if args.device == "cpu" else max(1, torch.cuda.device_count())
    spec, rounds, (prompt, response) = (
        (SPEC_QUICK, 2, (16, 48)) if args.quick else (SPEC, args.rounds, (64, 192))
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec)
        params = count_parameters(model_dir)
        groups = scored_groups(model_dir, [8] * ranks, (response, response), prompt, noise=0.05)
        timed = run_ranks(_times, ranks, str(model_dir), groups, rounds, gpus, timeout_s=3600)[0]
        memory = {
            name: max(
                run_ranks(_memory, ranks, str(model_dir), groups, name == "lora", 2, gpus, timeout_s=3600)
            )
            for name in ("full", "lora")
        }
        estimate = {
            name: _estimate(model_dir, name == "lora", prompt + response, ranks, gpus) for name in memory
        }
        serve = _serve(model_dir)
    med = {name: statistics.median(timed["times"][name]) for name in ("full", "lora")}
    figures = {
        "parameters": params,
        "lora_rank": RANK,
        "version_bytes_over_full": round(timed["version_bytes"]["lora"] / timed["version_bytes"]["full"], 4),
        "step_time_over_full": round(med["lora"] / med["full"], 3),
        "peak_memory_over_full": round(memory["lora"] / memory["full"], 3),
        "estimated_peak_over_full": round(estimate["lora"] / estimate["full"], 3),
        "serve_time_over_full": round(serve["serve_time_over_full"], 3) if serve else None,
        "device": args.device,
        "precision": timed["precision"],
    }
    print(f"model: {params / 1e6:.1f}M parameters; {ranks} ranks ({args.device}, {timed['precision']})")
    print(f"step: full {med['full']:.3f}s, LoRA rank {RANK} {med['lora']:.3f}s (median of {rounds})")
    for what, d in (("measured peak memory growth", memory), ("estimated peak", estimate)):
        print(f"{what} per rank: full {d['full'] / 2**20:.0f} MiB, LoRA {d['lora'] / 2**20:.0f} MiB")
    version = timed["version_bytes"]
    print(
        f"version: LoRA (adapters) {version['lora'] / 2**20:.2f} MiB, full {version['full'] / 2**20:.1f} MiB "
        f"(target <= {TARGET_VERSION_BYTES} of full)"
    )
    if serve:
        print(
            f"publish to serve: adapter {serve['adapter']['median_s']:.3f}s, full {serve['full']['median_s']:.3f}s "
            "(median of 3 versions each)"
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
