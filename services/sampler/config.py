"""Configuration of the sampler service (the ``[sampler]`` table of a run file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config import Section, ServiceConfig
from services.weight_broker.config import WeightBrokerConfig


class SamplerConfig(Section):
    """Generation engine, sampling settings, task source and the sampler's endpoints."""

    engine: Literal["vllm"] = Field("vllm", description="Generation engine implementation.")
    replicas: int = Field(1, ge=1, description="Sampler replicas; they share one admission counter.")
    n: int = Field(8, ge=1, description="Responses per prompt: the size of each rollout group.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_tokens: int = Field(512, ge=1, description="Longest response (per turn in multi-turn episodes).")
    max_model_len: int = Field(4096, ge=16, description="Longest prompt + response the engine accepts.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per sampler replica (vLLM tensor parallel).")
    gpus_per_replica: float = Field(
        0,
        ge=0,
        description="GPUs each replica asks Ray for: tensor_parallel_size on a GPU cluster, 0 on CPU.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of accelerator memory (of RAM on the CPU build) vLLM reserves."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Engine dtype.")
    weight_update: Literal["pause", "in_flight"] = Field(
        "pause",
        description="How new weights enter a running engine: pause at a safe point, or swap in flight and "
        "record each token's version.",
    )
    max_groups_in_flight: int = Field(
        16, ge=1, description="Groups a replica generates at once (n requests each, batched by the engine)."
    )
    stop: list[str] = Field(
        default_factory=list, description="Extra stop strings (the tokenizer's EOS always stops)."
    )
    system_prompt: str = Field("", description="System message put before each prompt by the chat template.")
    kv_cache_memory_bytes: int = Field(
        0,
        ge=0,
        description="KV-cache size in bytes; 0 = sized by gpu_memory_utilization. Set it on CPU machines.",
    )
    enforce_eager: bool = Field(False, description="Skip CUDA graph capture (faster start, slower decode).")
    weight_poll_interval_s: float = Field(
        0.2, gt=0, description="How often the background thread looks for a newer policy version."
    )
    dataset: str = Field(
        "",
        description="Training prompts: a .jsonl or .parquet path, or 'builtin:<name>'. Empty: only the "
        "`tasks` stream (gRPC submissions).",
    )
    prompt_field: str = Field("prompt", description="Dataset column holding the prompt.")
    answer_field: str = Field("answer", description="Dataset column holding the reference answer.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="Client-facing gRPC API port; 0 = a free port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")


class SamplerServiceConfig(ServiceConfig):
    """Everything the sampler reads: the shared sections and ``[sampler]``."""

    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    weight_broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)  # where versions come from
