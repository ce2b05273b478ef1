"""Peak memory and time of a learner step: VCPO (saved and recompute paths) against GRPO.

A Qwen2-architecture model built from a config with random weights (no download), sized for the machine:
on the CPU about 7M parameters with a vocabulary of 8192 (32 x the width, like Qwen2.5-7B's 42x), fp32;
with ``--device cuda`` Qwen2.5-0.5B's shape (or --size 1.5b) in bf16 at 2k tokens. For each sequence length
and each count of micro-batches per step (``--rows`` trajectories each, every other one left-padded by 8
tokens, so the model builds an attention mask as in training), one step's gradient by:

  grpo       the ordinary path: score all rows without a graph (whole-step statistics), then forward +
             backward per micro-batch
  saved      VCPO keeping every micro-batch's activations until the step's coefficients are known
  recompute  VCPO with the streaming norm pass per micro-batch, then forward + backward per micro-batch

all with the same activation checkpointing (--checkpointing) and output-head slices (--chunk tokens), every
gradient freed as it is formed (as ZeRO-3's reduce-scatter frees it). Peak memory is what the step allocates
beyond the model and its batch: on the CPU the live bytes of every tensor storage (memory.LiveBytes, the
count an allocator would see; the process's RSS moves in larger steps), on CUDA
``torch.cuda.max_memory_allocated``. Time: median over --repeats, the three paths alternating, measured
without the byte counter. ``estimate`` is the learner's start-up estimate (memory.step_memory, fake tensors)
of the recompute step at one micro-batch, over the measured peak.

The last line is one JSON object: vcpo_peak_over_grpo (recompute over GRPO, the worst length; target
<= 1.25), peak_growth_over_microbatches (recompute, 8 micro-batches over 1 at the longest length; target
<= 1.1), recompute_time_over_grpo (at 8 micro-batches and the longest length; target <= 1.6),
recompute_time_over_grpo_one_micro_batch (where GRPO needs no scoring pass), saved_growth_over_microbatches, estimate_over_measured, bytes_per_token (recompute, longest length).

    python benchmarks/learner_memory.py [--quick] [--device cuda] [--size 0.5b|1.5b] [--lengths 256 512 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vcpo_step import make_batch
from services.learner.memory import LiveBytes, drop_gradients_as_zero3, step_memory
from services.learner.step import MemoryOptions, StepInputs, backward
from services.learner.vcpo import ObjectiveConfig

TARGETS = {"vcpo_peak_over_grpo": 1.25, "peak_growth_over_microbatches": 1.1, "recompute_time_over_grpo": 1.6}
# Qwen2 configs (random weights): the CPU's, the quick one, and Qwen2.5-0.5B's and -1.5B's shapes (tied
# embeddings, as those models have)
SPEC_CPU = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=704,
    vocab_size=8192,
    tie_word_embeddings=False,
)
SPEC_QUICK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    vocab_size=2048,
    tie_word_embeddings=False,
)
SPECS_GPU = {
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
PATHS = ("grpo", "saved", "recompute")


def _step(model: nn.Module, batch: Any, path: str, rows: int, chunk: int) -> None:
    objective = ObjectiveConfig(objective="grpo" if path == "grpo" else "vcpo")
    memory = MemoryOptions("saved" if path == "saved" else "recompute", chunk)
    backward(StepInputs(model, batch, objective, rows, memory=memory))


def _peak(model: nn.Module, batch: Any, path: str, rows: int, chunk: int, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, batch, path, rows, chunk)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    tracker = LiveBytes()
    with tracker:
        _step(model, batch, path, rows, chunk)
    return tracker.peak


def _time(model: nn.Module, batch: Any, path: str, rows: int, chunk: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    _step(model, batch, path, rows, chunk)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and short rows (the test suite's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=list(SPECS_GPU), default="0.5b", help="the model on CUDA")
    parser.add_argument("--lengths", type=int, nargs="+", help="tokens per trajectory")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8], help="micro-batches per step")
    parser.add_argument(
        "--rows", type=int, default=0, help="trajectories per micro-batch (default 2; 1 quick)"
    )
    parser.add_argument("--chunk", type=int, default=0, help="output-head slice tokens (default length / 4)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per path (default 3; 1 quick)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        spec, lengths, rows, dtype = SPEC_QUICK, args.lengths or [64, 128], args.rows or 1, torch.float32
    elif args.device == "cuda":
        spec, lengths, rows, dtype = (
            SPECS_GPU[args.size],
            args.lengths or [1024, 2048],
            args.rows or 2,
            torch.bfloat16,
        )
    else:
        spec, lengths, rows, dtype = SPEC_CPU, args.lengths or [256, 512, 1024], args.rows or 2, torch.float32
    repeats = args.repeats or (1 if args.quick else 3)
    micro = sorted(set(args.micro_batches))

    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    hf_config = Qwen2Config(**spec)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    model = model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    drop_gradients_as_zero3(model)
    print(
        f"model: {sum({id(p): p.numel() for p in model.parameters()}.values()) / 1e6:.1f}M parameters, {spec['num_hidden_layers']} layers, width "
        f"{spec['hidden_size']}, vocabulary {spec['vocab_size']}, {str(dtype).removeprefix('torch.')} on {args.device}; "
        f"{rows} rows per micro-batch; checkpointing {args.checkpointing}"
    )
    print(f"{'tokens':>6} {'micro':>5} {'path':>9} {'peak MiB':>9} {'bytes/token':>11} {'step s':>8}")
    peaks: dict[tuple[int, int, str], int] = {}
    times: dict[tuple[int, int, str], float] = {}
    estimates: dict[int, int] = {}
    for length in lengths:
        chunk = args.chunk or max(length // 4, 1)
        for n in micro:
            batch = make_batch(model, rows * n, length, length // 4, seed=length + n)
            # ragged rows, as in training: every other row is left-padded, so the model builds an attention mask
            batch.attention_mask[1::2, :8] = 0
            batch.response_mask[1::2, :8] = 0
            for path in PATHS:
                peaks[length, n, path] = _peak(model, batch, path, rows, chunk, args.device)
            samples: dict[str, list[float]] = {p: [] for p in PATHS}
            for r in range(repeats):
                for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                    samples[path].append(_time(model, batch, path, rows, chunk, args.device))
            for path in PATHS:
                times[length, n, path] = statistics.median(samples[path])
                tokens = rows * n * length
                print(
                    f"{length:>6} {n:>5} {path:>9} {peaks[length, n, path] / 2**20:>9.1f} "
                    f"{peaks[length, n, path] / tokens:>11.0f} {times[length, n, path]:>8.3f}"
                )
        estimates[length] = step_memory(
            hf_config,
            mode="recompute",
            rows=rows,
            tokens=length,
            dtype=dtype,
            checkpointing=args.checkpointing,
            logit_chunk_tokens=chunk,
            device_type=torch.device(args.device).type,
        ).peak
    longest, few, many = max(lengths), micro[0], micro[-1]
    figures = {
        "vcpo_peak_over_grpo": max(
            peaks[t, n, "recompute"] / peaks[t, n, "grpo"] for t in lengths for n in micro
        ),
        "peak_growth_over_microbatches": peaks[longest, many, "recompute"] / peaks[longest, few, "recompute"],
        "recompute_time_over_grpo": times[longest, many, "recompute"] / times[longest, many, "grpo"],
        # GRPO's one-micro-batch step skips its scoring pass, so there recompute is about two GRPO steps
        "recompute_time_over_grpo_one_micro_batch": times[longest, few, "recompute"]
        / times[longest, few, "grpo"],
        "saved_growth_over_microbatches": peaks[longest, many, "saved"] / peaks[longest, few, "saved"],
        "saved_peak_over_grpo": peaks[longest, many, "saved"] / peaks[longest, many, "grpo"],
        "saved_time_over_grpo": times[longest, many, "saved"] / times[longest, many, "grpo"],
        "estimate_over_measured": estimates[longest] / peaks[longest, few, "recompute"],
        "bytes_per_token": peaks[longest, few, "recompute"] / (rows * few * longest),
        "micro_batches": [few, many],
        "longest": longest,
        "device": args.device,
    }
    for key, target in TARGETS.items():
        print(f"{key} = {figures[key]:.3f} (target <= {target})")
    print(
        f"estimate_over_measured = {figures['estimate_over_measured']:.3f} (the start-up estimate, recompute)"
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
