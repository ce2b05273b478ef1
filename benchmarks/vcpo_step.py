"""Cost of a VCPO step against plain GRPO and against brute-force per-trajectory gradients.

On a Qwen2 model of about 10M parameters (built by code), one step's batch of 16 trajectories of 256
tokens (2 groups of 8; 64 prompt + 192 response tokens), on CPU, timed side by side in one run:

  grpo          plain GRPO: one forward + one backward of the policy-gradient loss
  vcpo          the VCPO step: norm pass (forward + backward to layer outputs + ghost norms), coefficients
                (ESS, OPOB), and the weighted gradient formed from the saved activations
  brute         the public code's method: one forward + backward per trajectory (micro-batch 1), each
                trajectory's gradient norm from its .grad, and running gradient buffers per group so the
                same final gradient is formed once the group's baseline is known
  brute-shared  per-trajectory autograd on one batched forward (retain_graph, B backward passes), then the
                weighted backward: the naive way to write it
  vcpo-f32-gemm (CUDA only) the VCPO step with its float32 products as float32 GEMMs on the CUDA cores,
                instead of from bf16 parts on the tensor cores (services/learner/mm32.py); the two paths'
                norms and gradients are compared (split_vs_f32_gemm_*)

The VCPO and brute-force gradients and norms are compared (max_rel_err). Reported: median seconds of
--repeats runs per method, and ratios. The last line is one JSON object with the headline figures.

    python benchmarks/vcpo_step.py [--quick] [--threads 2] [--device cuda --dtype bfloat16 --size 200m]

In bfloat16 the comparison with brute force measures bf16 round-off of two different computations, not an
error of the norm pass (tests/test_grad_norms.py checks its float32 reductions against float64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.tiny_model import TinyModelSpec, build_tiny_model, count_parameters
from services.learner.logprobs import token_logprobs
from services.learner.mm32 import products
from services.learner.step import StepInputs, TrajectoryTensors, policy_gradient_backward, vcpo_backward
from services.learner.vcpo import ObjectiveConfig, PolicyBatch, trajectory_coefficients

SPEC_10M = TinyModelSpec(
    hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024
)
SPEC_QUICK = TinyModelSpec(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
# for a GPU: 0.25B parameters in 16 layers of width 1024 (head_dim 64), the shape of a small real model
SPEC_200M = TinyModelSpec(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=4096,
    vocab_size=1024,
)
SPECS = {"10m": SPEC_10M, "200m": SPEC_200M}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_batch(model: nn.Module, rows: int, length: int, prompt: int, seed: int = 0) -> TrajectoryTensors:
    """Rows of random tokens; behaviour log-probs = the model's own plus noise (a slightly stale policy)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=g).to(device)
    attention = torch.ones_like(ids)
    response = torch.zeros(rows, length, dtype=torch.long, device=device)
    response[:, prompt:] = 1
    with torch.no_grad():
        current = token_logprobs(model, ids, attention)
    behaviour = current + 0.05 * torch.randn(current.shape, generator=g).to(device)  # ℓ ~ N(0, 0.05·√L)
    rewards = torch.randint(0, 2, (rows,), generator=g).float().to(device)
    groups = (torch.arange(rows) // 8).to(device)
    return TrajectoryTensors(ids, attention, response, behaviour, rewards, groups)


def grads_of(model: nn.Module) -> list[Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def run_grpo(model: nn.Module, batch: TrajectoryTensors) -> None:
    model.zero_grad(set_to_none=True)
    policy_gradient_backward(StepInputs(model, batch, ObjectiveConfig(objective="grpo")))


def run_vcpo(model: nn.Module, batch: TrajectoryTensors) -> None:
    model.zero_grad(set_to_none=True)
    vcpo_backward(StepInputs(model, batch, ObjectiveConfig()))


def brute_norms(model: nn.Module, batch: TrajectoryTensors) -> tuple[Tensor, Tensor]:
    """Per-trajectory forward + backward at micro-batch 1: each trajectory's squared norm from its .grad."""
    norms = torch.zeros(len(batch), dtype=torch.float64, device=batch.input_ids.device)
    logprobs = torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
    for r in range(len(batch)):
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, batch.input_ids[r : r + 1], batch.attention_mask[r : r + 1])
        torch.where(batch.response_mask[r : r + 1].bool(), lp, 0.0).sum().backward()
        logprobs[r] = lp.detach()[0]
        norms[r] = sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)
    return norms, logprobs


def weighted_backward(model: nn.Module, batch: TrajectoryTensors, norms: Tensor, logprobs: Tensor) -> None:
    """The step's gradient by one ordinary batched forward + backward with the VCPO coefficients."""
    coef, _ = trajectory_coefficients(_policy(batch, logprobs, norms), ObjectiveConfig())
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask)
    (coef * torch.where(batch.response_mask.bool(), lp, 0.0).sum(1)).sum().backward()


def run_brute(model: nn.Module, batch: TrajectoryTensors) -> Tensor:
    """Brute force: norms by one backward per trajectory (micro-batch 1), then the weighted pass."""
    norms, logprobs = brute_norms(model, batch)
    weighted_backward(model, batch, norms, logprobs)
    return norms


def run_brute_shared(model: nn.Module, batch: TrajectoryTensors) -> Tensor:
    """Per-trajectory autograd on one batched graph (B backward passes), then the weighted pass."""
    params = [p for p in model.parameters() if p.requires_grad]
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask)
    per_row = torch.where(batch.response_mask.bool(), lp, 0.0).sum(1)
    norms = torch.zeros(len(batch), dtype=torch.float64, device=batch.input_ids.device)
    for r in range(len(batch)):
        grads = torch.autograd.grad(per_row[r], params, retain_graph=r + 1 < len(batch), allow_unused=True)
        norms[r] = sum(g.double().pow(2).sum() for g in grads if g is not None)
    weighted_backward(model, batch, norms, lp.detach())
    return norms


def _policy(batch: TrajectoryTensors, logprobs: Tensor, norms: Tensor) -> PolicyBatch:
    return PolicyBatch(
        logprobs, batch.behaviour_logprobs, batch.response_mask.bool(), batch.rewards, batch.group_ids, norms
    )


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel_err(a: Tensor, reference: Tensor) -> float:
    """The largest element-wise relative error (per-trajectory norms)."""
    return float(((a - reference).abs() / reference.abs()).max())


def max_grad_err(grads: list[Tensor], reference: list[Tensor]) -> float:
    """The largest relative error (in norm) of any parameter's gradient."""
    return max(rel(g, r) for g, r in zip(grads, reference, strict=True))


def vcpo_result(model: nn.Module, batch: TrajectoryTensors) -> tuple[dict[str, float], list[Tensor], Tensor]:
    """One VCPO step's metrics, its gradient, and the per-trajectory squared gradient norms."""
    from services.learner.grad_norms import per_trajectory_sq_grad_norms

    model.zero_grad(set_to_none=True)
    metrics = vcpo_backward(StepInputs(model, batch, ObjectiveConfig()))
    grads = grads_of(model)
    return (
        metrics,
        grads,
        per_trajectory_sq_grad_norms(model, batch.input_ids, batch.attention_mask, batch.response_mask),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small model and batch; runs in seconds")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=0, help="timed runs per method (default 3; quick 1)")
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (brute force at micro-batch 1 underuses a GPU)"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the model's dtype")
    parser.add_argument("--size", choices=list(SPECS), default="10m", help="the model (without --quick)")
    parser.add_argument("--length", type=int, default=256, help="tokens per trajectory (without --quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        spec, rows, length, prompt = SPEC_QUICK, 8, 64, 16
    else:
        spec, rows, length, prompt = SPECS[args.size], 16, args.length, args.length // 4
    repeats = args.repeats or (1 if args.quick else 3)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec)
        n_params = count_parameters(model_dir)
        model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).train().to(args.device)
        )
    batch = make_batch(model, rows, length, prompt)

    # correctness first: the same norms and the same gradient
    metrics, vcpo_grads, vcpo_norms = vcpo_result(model, batch)
    brute = run_brute(model, batch)
    norm_err, grad_err = max_rel_err(vcpo_norms, brute), max_grad_err(vcpo_grads, grads_of(model))

    methods: dict[str, Callable[[], object]] = {
        "grpo": lambda: run_grpo(model, batch),
        "vcpo": lambda: run_vcpo(model, batch),
        "brute": lambda: run_brute(model, batch),
        "brute-norms-only": lambda: brute_norms(model, batch),
        "brute-shared": lambda: run_brute_shared(model, batch),
    }
    extra: dict[str, float] = {}
    if torch.device(args.device).type == "cuda":
        # the floor under any comparison of two runs: the same path again (the CUDA backward is not deterministic)
        _, again_grads, again_norms = vcpo_result(model, batch)
        extra["rerun_norm_err"] = max_rel_err(vcpo_norms, again_norms)
        extra["rerun_grad_err"] = max_grad_err(vcpo_grads, again_grads)
        with products("plain"):
            _, plain_grads, plain_norms = vcpo_result(model, batch)
        extra["split_vs_f32_gemm_norm_err"] = max_rel_err(vcpo_norms, plain_norms)
        extra["split_vs_f32_gemm_grad_err"] = max_grad_err(vcpo_grads, plain_grads)

        def run_plain() -> None:
            with products("plain"):
                run_vcpo(model, batch)

        methods["vcpo-f32-gemm"] = run_plain
    for fn in methods.values():  # warm-up
        fn()
    seconds = {name: timed(fn, repeats) for name, fn in methods.items()}

    print(
        f"model: Qwen2, {n_params / 1e6:.2f}M parameters; batch {rows} x {length} tokens ({length - prompt} response)"
    )
    print(f"device {args.device}, {args.dtype}, threads {torch.get_num_threads()}, median of {repeats} runs")
    print(f"{'method':<18} {'seconds':>8} {'x grpo':>7} {'x vcpo':>7}")
    for name, sec in seconds.items():
        print(f"{name:<18} {sec:>8.3f} {sec / seconds['grpo']:>7.2f} {sec / seconds['vcpo']:>7.2f}")
    print(f"vcpo vs brute force: norms max rel err {norm_err:.2e}, gradient max rel err {grad_err:.2e}")
    if extra:
        print(
            f"tensor-core split vs float32 GEMMs: norms max rel err {extra['split_vs_f32_gemm_norm_err']:.2e}, "
            f"gradient max rel err {extra['split_vs_f32_gemm_grad_err']:.2e} (the same path run again: "
            f"{extra['rerun_norm_err']:.2e}, {extra['rerun_grad_err']:.2e})"
        )
        extra["f32_gemm_over_vcpo"] = seconds["vcpo-f32-gemm"] / seconds["vcpo"]
    print(
        f"step: ESS ratio {metrics['ess_ratio']:.3f}, LR scale {metrics['lr_scale']:.3f}, loss {metrics['loss']:.4f}"
    )
    print(
        json.dumps(
            {
                "vcpo_over_grpo": round(seconds["vcpo"] / seconds["grpo"], 3),
                "brute_over_vcpo": round(seconds["brute"] / seconds["vcpo"], 3),
                "brute_norms_only_over_vcpo": round(seconds["brute-norms-only"] / seconds["vcpo"], 3),
                "brute_shared_over_vcpo": round(seconds["brute-shared"] / seconds["vcpo"], 3),
                "max_rel_err": float(f"{max(norm_err, grad_err):.3e}"),
                "norm_max_rel_err": float(f"{norm_err:.3e}"),
                "grad_max_rel_err": float(f"{grad_err:.3e}"),
                "params": n_params,
                "batch": [rows, length],
                "threads": torch.get_num_threads(),
                "device": args.device,
                "dtype": args.dtype,
                "targets": {"vcpo_over_grpo": "<= 1.5", "brute_over_vcpo": ">= 3"},
                **{k: float(f"{v:.3e}") for k, v in extra.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
