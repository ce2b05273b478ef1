"""Benchmarks run (quick mode) and end with one JSON object of the headline figures they quote.

The quick modes that take a minute or more (they start DeepSpeed ranks, an engine or the whole system) carry
the ``bench`` marker: ``make test`` leaves them out to keep the suite's time, ``make bench-check`` runs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent


def run_quick(script: str, *extra: str) -> tuple[list[str], dict[str, Any]]:
    """Run ``benchmarks/<script> --quick``; return its output lines and its last line's JSON figures."""
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.slow
def test_streams_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("streams.py")
    assert any(line.split()[:1] == ["saturated"] for line in lines)  # the table
    for key in ("groups_per_s", "saturated_p50_ms", "paced_1000_per_s_p99_ms", "batched_over_unbatched"):
        assert figures[key] > 0
    assert figures["group_bytes"] > 20_000  # realistic groups: 8 x 512 tokens with log-probs


@pytest.mark.slow
def test_vcpo_step_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("vcpo_step.py")
    assert any(line.startswith("brute-shared") for line in lines)  # the table
    for key in ("vcpo_over_grpo", "brute_over_vcpo", "brute_shared_over_vcpo"):
        assert figures[key] > 0
    assert figures["max_rel_err"] < 1e-4  # the norm pass agrees with brute force in float32


@pytest.mark.gpu
def test_vcpo_step_benchmark_runs_on_a_gpu() -> None:
    _, figures = run_quick("vcpo_step.py", "--device", "cuda")
    assert figures["device"] == "cuda" and figures["max_rel_err"] < 1e-3
    # the tensor cores' split products against float32 GEMMs: both float32-accurate, summed in other orders
    assert figures["split_vs_f32_gemm_norm_err"] < 1e-5 and figures["split_vs_f32_gemm_grad_err"] < 1e-5
    _, figures = run_quick("vcpo_step.py", "--device", "cuda", "--dtype", "bfloat16")
    assert figures["dtype"] == "bfloat16" and figures["vcpo_over_grpo"] > 0
    assert figures["norm_max_rel_err"] < 0.1  # bf16 round-off of two different computations
    # the same bf16 activations through both paths: float32 sums apart, then one rounding of the gradient
    assert figures["split_vs_f32_gemm_norm_err"] < 1e-4 and figures["split_vs_f32_gemm_grad_err"] < 1e-2
    assert figures["f32_gemm_over_vcpo"] > 0


@pytest.mark.gpu
def test_lora_benchmark_runs_on_a_gpu() -> None:
    _, figures = run_quick("lora.py", "--device", "cuda")
    assert (figures["device"], figures["precision"]) == ("cuda", "bf16")
    for key in ("version_bytes_over_full", "step_time_over_full", "peak_memory_over_full"):
        assert figures[key] > 0


@pytest.mark.gpu
def test_learner_step_benchmark_runs_on_a_gpu() -> None:
    _, figures = run_quick("learner_step.py", "--device", "cuda")
    assert (figures["ranks"], figures["backend"], figures["precision"]) == (1, "nccl", "bf16")
    for key in ("vcpo_over_grpo", "publish_over_step", "grpo_step_s", "vcpo_step_s", "publish_s"):
        assert figures[key] > 0


@pytest.mark.slow
@pytest.mark.bench
def test_learner_memory_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("learner_memory.py")
    assert sum(line.split()[2:3] == ["recompute"] for line in lines) == 4  # 2 lengths x 1 and 8 micro-batches
    # peaks are exact live bytes (no timing noise): the recompute path's memory is one micro-batch's, the
    # saved path's grows with the step; the start-up estimate (fake tensors) is within 15% of the real step
    assert figures["vcpo_peak_over_grpo"] <= 1.25
    assert figures["peak_growth_over_microbatches"] <= 1.1
    assert figures["saved_growth_over_microbatches"] > 2
    assert 0.85 <= figures["estimate_over_measured"] <= 1.15
    assert figures["recompute_time_over_grpo"] > 0 and figures["bytes_per_token"] > 0


@pytest.mark.gpu
def test_learner_memory_benchmark_runs_on_a_gpu() -> None:
    # the tiny quick model: the allocator's 512-byte rounding of small tensors makes its peak no test of
    # the estimate; scripts/gpu_checks.sh runs the 0.5B-shaped model for that
    _, figures = run_quick("learner_memory.py", "--device", "cuda")
    assert figures["device"] == "cuda" and figures["peak_growth_over_microbatches"] <= 1.1


@pytest.mark.slow
@pytest.mark.bench
def test_weight_sync_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("weight_sync.py")  # exits non-zero if any fetcher got different bytes
    assert "all fetchers' digests equal the publisher's" in lines
    assert figures["broker_over_socket"] > 0 and figures["peak_rss_over_model"] > 0
    assert "all collective receivers' digests equal the publisher's" in lines  # else it exits non-zero
    assert figures["collective_over_socket"] > 0 and figures["collective_2_over_1"] > 0
    assert figures["collective_staged_over_socket"] > 0
    assert not any("shm" in key for key in figures)  # no /dev/shm path left to measure
    assert figures["learner_blocked_s_per_version"] > 0
    # an engine generating while it receives: the receive inside the loop's turn stalls it throughout
    assert figures["generation_stall_inline_over_transfer"] > 0.9
    assert 0 <= figures["generation_stall_over_transfer"] < figures["generation_stall_inline_over_transfer"]


@pytest.mark.slow
def test_weight_sync_gpu_benchmark_runs_its_processes_on_cpu() -> None:
    # the same publisher and loading receivers as on GPUs, over gloo and loopback sockets (it exits non-zero
    # where a version did not arrive in buffers on the receivers' own device)
    lines, figures = run_quick("weight_sync_gpu.py", "--device", "cpu")
    assert "every receiver's model equals every version it was sent" in lines  # else it exits non-zero
    assert figures["device"] == "cpu" and figures["model_bytes"] > 16_000_000
    for key in ("gbps", "received_gbps", "load_gbps", "2_over_1"):
        assert figures[f"sockets_{key}"] > 0, key
    assert figures["sockets_blocked_s"] >= 0
    assert figures["host_round_trip_gbps"] > 0 and figures["device_copy_gbps"] > 0
    # no GPU: no receive into one to quote
    assert "shared_gpu_gbps" not in figures and "receive_into_gpu_gbps" not in figures
    assert not any("host_copy" in key or "shm" in key for key in figures)


def test_weight_sync_gpu_benchmark_gives_each_nccl_receiver_a_gpu_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from benchmarks.weight_sync_gpu import Run, paths, receive_into_gpu

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    runs = paths(torch.device("cuda", 0), [1, 2, 4])
    shared = [["cuda:0"], ["cuda:0"] * 2, ["cuda:0"] * 4]
    # ranks sharing a GPU fall back to gloo in host memory; gloo given the GPU, and NCCL, receive into GPUs
    assert runs["shared_gpu"] == Run("nccl", shared, False)
    assert runs["gloo_into_gpu"] == Run("gloo", [["cuda:0"]], True)
    assert runs["nccl"] == Run("nccl", [["cuda:1"], ["cuda:1", "cuda:2"]], True)  # no 4: 2 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert set(paths(torch.device("cuda", 0), [1, 2, 4])) == {"shared_gpu", "gloo_into_gpu"}

    # the headline receive into a GPU and load: NCCL's where it ran, else gloo's into the one GPU
    figures = {"device_copy_gbps": 100.0, "gloo_into_gpu_received_gbps": 2.0, "gloo_into_gpu_load_gbps": 50.0}
    assert receive_into_gpu(figures) == {
        "receive_into_gpu_path": "gloo_into_gpu",
        "receive_into_gpu_gbps": 2.0,
        "load_gbps": 50.0,
        "load_over_device_copy": 0.5,
    }
    figures |= {"nccl_received_gbps": 20.0, "nccl_load_gbps": 80.0}
    assert receive_into_gpu(figures)["receive_into_gpu_path"] == "nccl"
    assert receive_into_gpu(figures)["receive_into_gpu_gbps"] == 20.0
    assert receive_into_gpu({"device_copy_gbps": 100.0}) == {}


@pytest.mark.gpu
def test_weight_sync_gpu_benchmark_runs_on_a_gpu() -> None:
    import torch

    # it exits non-zero where a version did not arrive where its path says (a GPU, or host memory)
    lines, figures = run_quick("weight_sync_gpu.py", "--device", "cuda")
    assert "every receiver's model equals every version it was sent" in lines
    assert figures["device"] == "cuda" and figures["host_round_trip_gbps"] > 0
    assert figures["shared_gpu_gbps"] > 0 and figures["shared_gpu_2_over_1"] > 0
    assert figures["shared_gpu_over_round_trip"] > 0 and figures["gloo_into_gpu_gbps"] > 0
    assert ("nccl_gbps" in figures) == (torch.cuda.device_count() > 1)
    # the version received into a GPU's buffers, then loaded from them device to device
    path = "nccl" if torch.cuda.device_count() > 1 else "gloo_into_gpu"
    assert figures["receive_into_gpu_path"] == path
    assert figures["receive_into_gpu_gbps"] > 0 and figures["load_gbps"] > 0
    assert figures["load_over_device_copy"] > 0


@pytest.mark.slow
@pytest.mark.bench
def test_learner_step_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("learner_step.py")
    assert any(line.startswith("publish") for line in lines)  # the table
    assert figures["ranks"] == 2
    for key in ("vcpo_over_grpo", "publish_over_step", "grpo_step_s", "vcpo_step_s", "publish_s"):
        assert figures[key] > 0


@pytest.mark.slow
@pytest.mark.bench
def test_learner_step_benchmark_mixed_lengths_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("learner_step.py", "--mixed")
    assert any(line.startswith("padded") for line in lines)  # the table
    assert figures["ranks"] == 2 and figures["rows"] == 64 and figures["rows_at_maximum"] >= 1
    # positions run through the model (every forward, counted by a hook) over their real tokens: each
    # micro-batch at its own longest row, where one truncated response widened every micro-batch
    assert figures["computed_over_real_tokens"] <= 1.2
    assert figures["padded_computed_over_real_tokens"] > 1.5
    assert figures["step_time_over_padded"] > 0 and figures["trimmed_step_s"] > 0


@pytest.mark.gpu
def test_learner_step_benchmark_mixed_lengths_runs_on_a_gpu() -> None:
    _, figures = run_quick("learner_step.py", "--mixed", "--device", "cuda")
    assert (figures["ranks"], figures["backend"], figures["precision"]) == (1, "nccl", "bf16")
    assert figures["computed_over_real_tokens"] <= 1.2 and figures["step_time_over_padded"] > 0


@pytest.mark.slow
@pytest.mark.bench
def test_sampler_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("sampler.py")
    assert any(line.startswith("service") for line in lines)  # the table
    assert (figures["groups"], figures["n"], figures["max_tokens"]) == (8, 4, 16)
    for key in (
        "service_over_engine",
        "service_over_engine_raw",
        "engine_tokens_per_s",
        "service_tokens_per_s",
    ):
        assert figures[key] > 0
    for key in ("engine_tokens", "service_tokens"):
        assert 0 < figures[key] <= 8 * 4 * 16


@pytest.mark.slow
def test_reward_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("reward.py")  # exits non-zero if a group was lost, doubled or mis-scored
    assert any(line.startswith("countdown_2") for line in lines)  # the table
    for case in ("math_1", "math_2", "countdown_1", "countdown_2"):
        assert figures["groups_per_s"][case] > 0
    assert set(figures["scaling_2_over_1"]) == {"math", "countdown"}
    assert all(ratio > 0 for ratio in figures["scaling_2_over_1"].values())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(660)  # run_quick gives the script 600 s
def test_eval_overhead_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("eval_overhead.py")  # two whole launcher runs (without, with evaluation)
    assert any(line.startswith("with ") for line in lines)  # the table
    assert (figures["steps"], figures["every"], figures["responses_per_round"]) == (40, 20, 800)
    assert figures["rounds_done"] >= 2 and figures["eval_versions"][0] == 0
    for key in ("step_s_without", "step_s_with", "slowdown", "round_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])
    assert 0 <= figures["hold_s_per_round"] <= figures["max_delay_s"] and 0 <= figures["held_fraction"] < 1


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(660)  # run_quick gives the script 600 s
def test_async_speedup_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("async_speedup.py")  # two whole launcher runs (k = 0, k = 4): minutes
    assert any(line.startswith("async ") for line in lines)  # the table
    assert (figures["steps"], figures["k_async"]) == (8, 4)
    for key in (
        "async_over_sync_speedup",
        "fraction_of_ideal",
        "ideal_speedup",
        "sync_step_s",
        "async_step_s",
    ):
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(660)  # run_quick gives the script 600 s
def test_startup_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("startup.py")  # two whole launcher runs: sequential, then side by side
    assert any(line.startswith("side-by-side") for line in lines)  # the table
    assert (figures["repeats"], figures["steps"]) == (1, 3)
    for mode in ("sequential", "side_by_side"):
        assert 0 < figures["services_s"][mode] < figures["ready_s"][mode], figures
    assert figures["side_by_side_over_sequential"] > 0


def test_vcpo_step_benchmark_builds_its_batch_on_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor of the batch lives where the model does (``--device cuda`` failed: the response mask
    stayed on the CPU). The meta device stands in for a GPU here: nothing is computed (the model's log-probs
    are zeros on its device), devices are checked."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import vcpo_step
    from benchmarks.vcpo_step import SPEC_QUICK, make_batch
    from services.common.tiny_model import build_tiny_model

    monkeypatch.setattr(
        vcpo_step, "token_logprobs", lambda m, ids, a: torch.zeros(ids.shape, device=ids.device)
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", SPEC_QUICK)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("meta")
    batch = make_batch(model, rows=8, length=32, prompt=8)
    devices = {name: str(getattr(batch, name).device) for name in batch.__dataclass_fields__}
    assert set(devices.values()) == {"meta"}, devices


@pytest.mark.slow
def test_sampler_benchmark_keeps_the_engine_batch_full_under_long_tailed_lengths() -> None:
    """``active_over_cap``: the requests running per step over the cap, the real sampler loop over a
    stand-in engine that batches as vLLM does. Admitting by requests in flight keeps the batch full while a
    group's longest responses run on; whole-group slots (each freed by its last response) give about 0.45 in
    this setting."""
    lines, figures = run_quick("sampler.py", "--admission-only")
    assert any(line.startswith("admission:") for line in lines)
    setting = figures["admission"]
    assert (setting["cap"], setting["n"], setting["max_tokens"]) == (128, 8, 128)
    assert 0.03 <= setting["share_at_max"] <= 0.08 and setting["mean_length_over_max"] < 0.5  # long-tailed
    assert figures["active_over_cap"] >= 0.9 and figures["meets_active_over_cap"], figures


@pytest.mark.slow
@pytest.mark.bench
def test_agents_benchmark_quick_mode_prints_its_figures() -> None:
    lines, figures = run_quick("agents.py")
    assert any(line.startswith("endpoint_over_inprocess ") for line in lines)
    assert figures["endpoint_over_inprocess"] > 0 and figures["endpoint_over_inprocess_same_load"] > 0
    assert (
        figures["turns_timed"] == 4 * 4 * 2
    )  # every episode's every turn, one round: 4 groups of 4, 2 turns
    assert 0 <= figures["added_latency_ms"]["p50"] <= figures["added_latency_ms"]["p99"]
