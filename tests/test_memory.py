"""The learner's memory estimate: the tracker, the fake-tensor simulation against the real step, the
start-up refusal, and the 7B preset and Helm values on 80 GB GPUs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.config import PROJECTIONS, LearnerConfig, LoraConfig
from services.learner.memory import (
    CUDA_CONTEXT,
    HEADROOM,
    GiB,
    LiveBytes,
    broadcast_buffer_bytes,
    drop_gradients_as_zero3,
    model_shape,
    model_state_bytes,
    plan_memory,
    run_micro_batch,
    step_memory,
)

ROOT = Path(__file__).resolve().parents[1]


def qwen25_7b_config():  # type: ignore[no-untyped-def]
    """Qwen/Qwen2.5-7B's config.json, by value (no download): tests/data/model_configs.json's entry."""
    from tests.test_shipped_fit import hf_config

    return hf_config("Qwen/Qwen2.5-7B")


def test_live_bytes_counts_what_is_allocated_and_frees_it() -> None:
    lins = torch.nn.Sequential(*[torch.nn.Linear(100, 100, bias=False) for _ in range(3)])
    x = torch.randn(10, 100)
    tracker = LiveBytes()
    with tracker:
        # three [10, 100] float32 outputs, of which the backward keeps the two that are inputs of a Linear
        # (the last is freed: sum needs only its shape); the weights' transposes are views: nothing
        y = lins(x).sum()
        assert tracker.current == 2 * 10 * 100 * 4 + 4
        assert tracker.peak == 3 * 10 * 100 * 4 + 4
        y.backward()
    del y
    # what is left: the three weight gradients
    assert tracker.current == 3 * 100 * 100 * 4
    assert tracker.peak >= tracker.current


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    return build_tiny_model(tmp_path_factory.mktemp("memory") / "model", spec)


LORA = LoraConfig(rank=8, target_modules=[*PROJECTIONS, "lm_head", "embed_tokens"], publish="merged")


@pytest.mark.parametrize(
    ("mode", "checkpointing", "chunk", "lora"),
    [
        ("saved", False, 0, False),
        ("recompute", False, 0, False),
        ("recompute", True, 32, False),
        ("grpo", False, 0, False),
        ("grpo", True, 32, False),
        ("saved", False, 0, True),
        ("recompute", True, 32, True),
    ],
)
def test_the_simulated_step_is_the_real_step(
    tiny: Path, mode: str, checkpointing: bool, chunk: int, lora: bool
) -> None:
    """Fake tensors at one and two layers, extrapolated to three, against the real three-layer step (with
    LoRA: gradients of the adapters alone, the adapters' activations beside the base's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.learner.logprobs import chunk_count
    from services.learner.lora import apply_lora

    rows, tokens = 2, 96
    estimate = step_memory(
        AutoConfig.from_pretrained(tiny),
        mode=mode,
        rows=rows,
        tokens=tokens,
        dtype=torch.float32,
        checkpointing=checkpointing,
        logit_chunk_tokens=chunk,
        lora=LORA if lora else None,
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation="sdpa"
    ).train()
    if lora:
        apply_lora(model, LORA)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    drop_gradients_as_zero3(model)
    ids = torch.randint(0, 512, (rows, tokens))
    attention = torch.ones_like(ids)
    response = torch.ones_like(ids)
    response[:, 0] = 0
    # a padded row, as in training: the model then builds an attention mask, as it must on fake tensors (it
    # cannot look at their values to see that a mask of ones needs none)
    attention[1, :5] = response[1, :6] = 0
    tracker = LiveBytes()
    with tracker:
        retained = run_micro_batch(model, mode, ids, attention, response, chunk_count(tokens, chunk), tracker)
    assert estimate.peak == pytest.approx(tracker.peak, rel=0.05), (estimate, tracker.peak)
    assert estimate.retained == pytest.approx(retained, rel=0.05)
    assert (retained > 0) == (mode == "saved")


@pytest.mark.slow
def test_a_step_that_cannot_fit_is_refused_naming_the_keys(tiny: Path) -> None:
    from transformers import AutoConfig

    learner = LearnerConfig(micro_batch_size=8, max_sequence_tokens=512)
    with pytest.raises(ValueError, match="cannot fit") as err:
        plan_memory(AutoConfig.from_pretrained(tiny), learner, "fp32", 1, budget=64 * 2**20)
    for key in (
        "learner.micro_batch_size (8)",
        "learner.max_sequence_tokens",
        "learner.activation_checkpointing",
        "learner.num_ranks",
        "learner.device_memory_gb",
    ):
        assert key in str(err.value)
    with pytest.raises(ValueError, match="max_sequence_tokens = 0"):
        plan_memory(AutoConfig.from_pretrained(tiny), LearnerConfig(), "fp32", 1, budget=GiB)
    # enough memory: auto runs saved while the step's saved activations fit, recompute beyond
    plan = plan_memory(AutoConfig.from_pretrained(tiny), learner, "fp32", 1, budget=4 * GiB)
    assert plan.mode_for([(8, 512)]) == "saved"
    assert (
        plan.saved_step_peak([(8, 512)] * 64) > plan.saved_step_peak([(8, 512)] * 2) > plan.peak("recompute")
    )
    # a budget between the recompute step and a long saved step: auto switches to recompute for the long one
    between = (plan.peak("recompute") + plan.saved_step_peak([(8, 512)] * 40)) // 2
    tight = plan_memory(
        AutoConfig.from_pretrained(tiny), learner, "fp32", 1, budget=int(between / (1 - HEADROOM))
    )
    assert tight.mode_for([(8, 512)]) == "saved" and tight.mode_for([(8, 512)] * 40) == "recompute"


def _preset(name: str) -> LearnerConfig:
    from deploy.config import SystemConfig

    return SystemConfig(**tomllib.loads((ROOT / "deploy" / "presets" / name).read_text())).learner


def _broadcast_bucket(name: str) -> int:
    """The preset's weight-group bucket when rank 0 broadcasts in the background (collective), else 0."""
    from deploy.config import SystemConfig

    wb = SystemConfig(**tomllib.loads((ROOT / "deploy" / "presets" / name).read_text())).weight_broker
    return wb.group_bucket_mb << 20 if wb.transport == "collective" else 0


@pytest.mark.parametrize("preset", ["qwen2.5-7b-math.toml", "qwen2.5-7b-simpletir.toml"])
@pytest.mark.slow
def test_the_7b_presets_fit_80gb_gpus(preset: str) -> None:
    learner = _preset(preset)
    assert learner.max_sequence_tokens >= 4096  # sized for sampler.max_model_len
    bucket = _broadcast_bucket(preset)
    assert bucket > 0  # the GPU presets broadcast: rank 0's buffers overlap the step
    plan = plan_memory(
        qwen25_7b_config(), learner, "bf16", learner.num_ranks, 80 * 10**9, CUDA_CONTEXT, bucket
    )
    assert plan.peak("recompute") <= plan.usable, plan.summary()
    # and the saved path alone could not hold a step of the preset's rows (16 per group, 4 groups per rank)
    rows = 16 * 4
    step = [(learner.micro_batch_size, learner.max_sequence_tokens)] * (rows // learner.micro_batch_size)
    assert plan.saved_step_peak(step) > plan.usable
    assert plan.mode_for(step) == "recompute"


def test_the_helm_7b_values_fit_80gb_gpus(tmp_path: Path) -> None:
    from tests.test_helm import render, run_config, scenario_args

    _, cfg = run_config(render(*scenario_args("multi-gpu-values.yaml")), tmp_path)
    assert cfg.run.model == "Qwen/Qwen2.5-7B" and cfg.learner.activation_checkpointing
    assert cfg.weight_broker.transport == "collective"
    plan = plan_memory(
        qwen25_7b_config(),
        cfg.learner,
        "bf16",
        cfg.learner.num_ranks,
        80 * 10**9,
        CUDA_CONTEXT,
        cfg.weight_broker.group_bucket_mb << 20,
    )
    assert plan.peak("recompute") <= plan.usable, plan.summary()


@pytest.mark.slow
def test_rank_0s_background_broadcast_buffers_are_counted() -> None:
    """Under NCCL rank 0 broadcasts a version while the next step runs: two buffers of at most a bucket on
    its GPU beside the step, which every piece goes through, Qwen2.5-7B's embedding (152064 x 3584 in bf16,
    1.1 GB) too: not a buffer of the largest weight's size."""
    learner = _preset("qwen2.5-7b-math.toml")
    without = plan_memory(qwen25_7b_config(), learner, "bf16", 8, 80 * 10**9, CUDA_CONTEXT)
    with_ = plan_memory(qwen25_7b_config(), learner, "bf16", 8, 80 * 10**9, CUDA_CONTEXT, 256 << 20)
    assert with_.fixed - without.fixed == 2 * (256 << 20)
    assert with_.peak("recompute") - without.peak("recompute") == with_.fixed - without.fixed
    assert "(with 0.5 GiB of weight broadcast buffers)" in with_.summary()


def test_max_sequence_tokens_follows_the_sampler() -> None:
    from services.learner.config import LearnerServiceConfig

    assert LearnerServiceConfig(sampler={"max_model_len": 3000}).learner.max_sequence_tokens == 3000  # type: ignore[call-arg]
    assert LearnerServiceConfig().learner.max_sequence_tokens == 4096  # the sampler's default
    cfg = LearnerServiceConfig(learner={"max_sequence_tokens": 777}, sampler={"max_model_len": 3000})  # type: ignore[call-arg]
    assert cfg.learner.max_sequence_tokens == 777


def test_a_rank_with_a_fraction_of_a_gpu_plans_within_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank given half a GPU (its samplers on the other half) plans its steps within half of it, not the
    whole GPU, which the samplers use too; the GPU's properties stand in for a CUDA device here."""
    from types import SimpleNamespace

    from services.learner.memory import GiB, device_budget

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB)
    )
    gpu = torch.device("cuda", 0)
    assert device_budget(LearnerConfig(gpus_per_rank=1), gpu) == 80 * GiB
    assert device_budget(LearnerConfig(gpus_per_rank=2), gpu) == 80 * GiB  # one rank, one GPU of its two
    assert device_budget(LearnerConfig(gpus_per_rank=0.5), gpu) == 40 * GiB
    assert device_budget(LearnerConfig(gpus_per_rank=0.5, device_memory_gb=70), gpu) == 70 * GiB  # as set


@pytest.mark.slow
def test_a_lora_learner_counts_the_frozen_base_and_the_adapters_optimizer_state() -> None:
    """Qwen2.5-7B with rank-16 adapters on every projection: ~40M trained weights (fp32 master, AdamW moments,
    gradient) beside a frozen bf16 base; one 80 GB GPU holds the learner, which full fine-tuning cannot."""
    cfg = qwen25_7b_config()
    lora = LoraConfig(rank=16)
    full, adapted = model_shape(cfg), model_shape(cfg, lora)
    # per layer: r·(in + out) for q, k, v, o, gate, up and down
    h, kv, ffn = (
        cfg.hidden_size,
        cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads),
        18944,
    )
    per_layer = 16 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + ffn))
    assert adapted.trainable_params == cfg.num_hidden_layers * per_layer == 40_370_176
    assert adapted.num_params == full.num_params + adapted.trainable_params
    states = model_state_bytes(adapted, "bf16", 1)
    assert states["partitions"] == full.num_params * 2 + adapted.trainable_params * (2 + 4 + 8 + 4)
    assert model_state_bytes(full, "bf16", 1)["partitions"] > 80 * 10**9  # full fine-tuning's states alone
    learner = LearnerConfig(
        micro_batch_size=4,
        max_sequence_tokens=4096,
        activation_checkpointing=True,
        memory_mode="recompute",
        lora=lora,
    )
    plan = plan_memory(cfg, learner, "bf16", 1, 80 * 10**9, CUDA_CONTEXT)
    assert plan.peak("recompute") <= plan.usable, plan.summary()
    # a background broadcast's two buffers hold no more than a version: the adapters alone (bf16), or with
    # publish = "merged" the base's weights, more than two buckets
    bucket = 256 << 20
    assert broadcast_buffer_bytes(adapted, "bf16", bucket, lora) == 2 * adapted.trainable_params * 2
    merged = lora.model_copy(update={"publish": "merged"})
    assert broadcast_buffer_bytes(adapted, "bf16", bucket, merged) == 2 * bucket
    assert broadcast_buffer_bytes(adapted, "bf16", 1 << 40, merged) == 2 * full.num_params * 2
    broadcasting = plan_memory(
        cfg, learner, "bf16", 1, 80 * 10**9, CUDA_CONTEXT, broadcast_bucket_bytes=bucket
    )
    assert broadcasting.states["weight_broadcast"] == 2 * adapted.trainable_params * 2
