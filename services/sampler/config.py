"""Configuration of the sampler service (the ``[sampler]`` table of a run file)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, SecretStr, model_validator

from services.common.config import Section, ServiceConfig
from services.common.lora import LoraConfig, check_adapter_transport
from services.common.tls import ClientTls, ServerTls
from services.reward.config import RewardConfig
from services.sampler.agents.config import AgentsConfig
from services.weight_transport import WeightBrokerConfig

EVAL_SET_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


class EnvironmentConfig(Section):
    """A tool-use environment registered when the sampler starts: RegisterEnvironment's EnvironmentSpec fields,
    zeros taking the registry's defaults, except that the bearer token the endpoint wants is named, not written:
    ``auth_token_file`` or ``auth_token_env``, read by the sampler when it registers the environment. Run files
    are committed, shared and written into the run directory (config.resolved.json), so a token written in
    one would travel with them; a file is what a Kubernetes Secret or a credentials store mounts, a variable
    what a shell or CI job exports."""

    name: str = Field(description="The name tasks refer to (Task.environment).")
    endpoint: str = Field("", description="host:port of a vcpo.v1.Environment server (or give builtin).")
    builtin: str = Field("", description="A built-in environment type, e.g. 'python' (or give endpoint).")
    max_concurrency: int = Field(0, ge=0, description="Episodes open at once per sampler replica; 0: 4 x n.")
    reset_timeout_seconds: float = Field(0, ge=0, description="Deadline of Reset; 0: 30 s.")
    step_timeout_seconds: float = Field(0, ge=0, description="Deadline of Step; 0: 60 s.")
    scorer: str = Field("", description="Default scorer of its tasks; 'environment': its own reward.")
    weight: float = Field(0, ge=0, description="Share of sampling across environments; 0: 1.")
    max_turns: int = Field(0, ge=0, description="Model turns per episode; 0: 8.")
    max_episode_tokens: int = Field(0, ge=0, description="Tokens per episode; 0: what max_model_len allows.")
    tool_parser: str = Field("", description="'fenced_code' (default), 'json' or 'turn'.")
    tls: bool = Field(
        False,
        description="Call the endpoint over TLS, trusting sampler.env_tls.ca_file (else the system's roots) and "
        "presenting sampler.env_tls's certificate if it has one.",
    )
    auth_token_file: str = Field(
        "",
        description="A file holding the token the endpoint wants, sent as `authorization: Bearer <token>` on "
        "every call (surrounding whitespace stripped); read when the sampler registers the environment. Or "
        "auth_token_env; empty (both): no token.",
    )
    auth_token_env: str = Field(
        "",
        pattern=r"^([A-Za-z_][A-Za-z0-9_]*)?$",
        description="An environment variable of the sampler's processes holding that token (instead of "
        "auth_token_file).",
    )

    @model_validator(mode="after")
    def _one_token_source(self) -> EnvironmentConfig:
        where = f"[[sampler.environments]] {self.name!r}"
        if self.auth_token_file and self.auth_token_env:
            raise ValueError(
                f"{where}: auth_token_file and auth_token_env both set; give the token one way (remove one)"
            )
        if self.builtin and (self.tls or self.auth_token_file or self.auth_token_env):
            raise ValueError(
                f"{where}: tls, auth_token_file and auth_token_env are for an endpoint; builtin "
                f"{self.builtin!r} runs in the sampler"
            )
        return self

    def auth_token(self, environ: Mapping[str, str] | None = None) -> str:
        """The endpoint's token, read now from auth_token_file or auth_token_env ("" when neither is set);
        ValueError naming the key when it cannot be read or is empty."""
        where = f"[[sampler.environments]] {self.name!r}"
        if self.auth_token_file:
            try:
                token = Path(self.auth_token_file).read_text().strip()
            except OSError as exc:
                raise ValueError(
                    f"{where}: auth_token_file = {self.auth_token_file!r} cannot be read ({exc.strerror}): "
                    "point it at the file holding the environment's token, readable where the samplers run"
                ) from None
            if not token:
                raise ValueError(f"{where}: auth_token_file = {self.auth_token_file!r} is empty")
            return token
        if self.auth_token_env:
            token = (os.environ if environ is None else environ).get(self.auth_token_env, "").strip()
            if not token:
                raise ValueError(
                    f"{where}: auth_token_env = {self.auth_token_env!r}, but the sampler's environment has no "
                    f"(or an empty) {self.auth_token_env}: export it where the samplers run"
                )
            return token
        return ""


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
        0.9,
        gt=0,
        le=1,
        description="Fraction of accelerator memory (of RAM on the CPU build) vLLM reserves. With the collective "
        "weight transport under NCCL, the rest must also hold a whole weight version (every GPU worker receives "
        "one there before loading it) and about 2 GiB more for NCCL's buffers and vLLM's reload of a layer: "
        "0.75 for a 7B model in bf16 on 80 GB GPUs.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Engine dtype.")
    weight_update: Literal["pause", "in_flight"] = Field(
        "pause",
        description="How new weights enter a running engine: pause at a safe point, or swap in flight and "
        "record each token's version.",
    )
    max_requests_in_flight: int = Field(
        0,
        ge=0,
        description="Training requests (responses being generated) a replica keeps in its engine: a new group "
        "of n starts while the unfinished responses of the groups in flight plus n stay within it, so each "
        "response that finishes frees its seat at once. 0: the engine's batch limit (vLLM's max_num_seqs: "
        "1024 on an H100/H200, 256 on smaller GPUs, 256 per worker on CPU). Shared evaluation's requests "
        "(evaluation.max_requests_in_flight) come on top and are queued by vLLM as seats free. The lag bound "
        "(run.k) gates every group besides.",
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
    dataset_environment: str = Field(
        "", description="Run every dataset task as a multi-turn episode of this registered environment."
    )
    environments: list[EnvironmentConfig] = Field(
        default_factory=list,
        description="Environments registered at start-up (clients may register more over gRPC).",
    )
    prompt_field: str = Field(
        "prompt", description="Dataset column holding the prompt (a dotted path reaches into nested columns)."
    )
    answer_field: str = Field(
        "answer",
        description="Dataset column holding the reference answer; a dotted path reaches into nested columns "
        "(veRL's parquet: 'reward_model.ground_truth').",
    )
    source_field: str = Field(
        "data_source", description="The column whose value scorer_by_source maps to a task's scorer."
    )
    scorer_by_source: dict[str, str] = Field(
        default_factory=dict,
        description="Each dataset row's scorer, by its source_field value (veRL's data_source names, e.g. "
        "{'openai/gsm8k' = 'gsm8k', 'lighteval/MATH' = 'math_verl', countdown = 'countdown'}); applies to the "
        "evaluation sets too. A row whose source it lacks fails the load. Empty: tasks name no scorer "
        "(reward.default_scorer, or an evaluation set's own).",
    )
    api_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token every client-facing call (EnvironmentRegistry) must carry. Set it from the "
        "environment (VCPO_SAMPLER__API_TOKEN, e.g. from a Kubernetes Secret), not in a file. Empty: "
        "api_token_file, else <run_dir>/api_token (created with a random token).",
    )
    api_token_file: str = Field(
        "", description="A file holding the API token (used when api_token is empty)."
    )
    max_request_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="Largest gRPC message a client of the registry API may send.",
    )
    api_tls: ServerTls = Field(
        default_factory=ServerTls,
        description="TLS of the registry API and status server ([sampler.api_tls]: cert_file, key_file, and "
        "client_ca_file to require client certificates); empty: plaintext.",
    )
    env_tls: ClientTls = Field(
        default_factory=ClientTls,
        description="What the sampler trusts and presents when it calls environments registered with tls = "
        "true ([sampler.env_tls]: ca_file, cert_file, key_file).",
    )
    env_max_message_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="Largest message exchanged with an environment server (a Reset or Step reply, a task "
        "sent to Reset); a larger reply fails its group, naming this setting.",
    )
    env_threads: int = Field(
        64, ge=1, description="Threads calling environments (a hanging call holds one until its deadline)."
    )
    env_failures_to_open: int = Field(
        3, ge=1, description="Groups an environment fails in a row before its circuit breaker pauses it."
    )
    env_cooldown_s: float = Field(
        30.0, gt=0, description="First pause of a failing environment; doubles while it keeps failing."
    )
    env_max_attempts: int = Field(
        3, ge=1, description="Times a task is tried in its environment before it is dead-lettered."
    )
    grpc_port: int = Field(50051, ge=0, le=65535, description="Client-facing gRPC API port; 0 = a free port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")
    port_per_replica: bool = Field(
        True,
        description="Add the replica index to grpc_port and metrics_port, so replicas sharing a host do not "
        "collide; false: every replica binds them as given (one replica per pod, as the Helm chart places "
        "them behind one Service port).",
    )
    ray_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica asks for besides CPU and GPU, e.g. {vcpo_sampler = 1}: "
        "replicas run only on the nodes that offer them (the Helm chart's sampler pods offer 1 each).",
    )

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_groups_in_flight" in data:
            raise ValueError(
                "sampler.max_groups_in_flight was replaced by sampler.max_requests_in_flight, a cap in requests "
                "(groups x sampler.n; 0, the default: the engine's batch limit): a group's finished responses "
                "now free their seats before its last one ends"
            )
        return data

    @model_validator(mode="after")
    def _cap_fits_a_group(self) -> SamplerConfig:
        if 0 < self.max_requests_in_flight < self.n:
            raise ValueError(
                f"sampler.max_requests_in_flight = {self.max_requests_in_flight} is below sampler.n = {self.n}: "
                f"no group could ever start; raise it to at least {self.n} (or 0: the engine's batch limit)"
            )
        return self


class EvalSetConfig(Section):
    """One validation set (``[[evaluation.sets]]``): its data, scorer and sampling settings."""

    name: str = Field(description="Label of its results and metrics (lower case letters, digits, _ . -).")
    dataset: str = Field(description="A .jsonl or .parquet path, or 'builtin:<name>' (the training readers).")
    split: str = Field(
        "test", description="Split label of its tasks; for a builtin dataset it picks the held-out rows."
    )
    prompt_field: str = Field("", description="Column holding the prompt; empty: sampler.prompt_field.")
    answer_field: str = Field("", description="Column holding the answer; empty: sampler.answer_field.")
    scorer: str = Field(
        "",
        description="Scorer of its responses; empty: a task's own, else its environment's, else 'environment' "
        "for an episode the environment rewarded, else reward.default_scorer.",
    )
    environment: str = Field(
        "",
        description="Run each task as a multi-turn episode of this environment (one of sampler.environments), "
        "as training runs its tasks; empty: single-turn.",
    )
    n: int = Field(4, ge=1, description="Samples per task: mean@n and pass@n are over these.")
    temperature: float = Field(0.8, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(0.7, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(0, ge=0, description="Longest response; 0: sampler.max_tokens.")
    limit: int = Field(0, ge=0, description="Evaluate only the first this many tasks; 0: all of them.")
    every: int = Field(0, ge=0, description="Versions between its evaluations; 0: evaluation.every.")
    correct_at: float = Field(
        1.0, description="A response counts as correct when its reward is at least this."
    )


class EvaluationConfig(Section):
    """Held-out evaluation during training (``[evaluation]``): which sets, how often, on whose capacity."""

    sets: list[EvalSetConfig] = Field(
        default_factory=list, description="Validation sets; none: no evaluation during training."
    )
    every: int = Field(50, ge=1, description="Evaluate the first version of every `every` versions.")
    at_start: bool = Field(True, description="Evaluate version 0 too (the model the run starts from).")
    placement: Literal["shared", "dedicated"] = Field(
        "shared",
        description="shared: sampler replica engines run it beside training generation; dedicated: an "
        "evaluator of its own (its own engine and GPUs) follows the published versions.",
    )
    max_delay_s: float = Field(
        30.0,
        ge=0,
        description="shared: the longest a sampler holds a newer version back to finish an evaluation at the "
        "version it serves; past it the evaluation is abandoned (counted) and training goes on. The evaluator "
        "refuses to start where a round's worst case exceeds it (services/evaluator/capacity.py).",
    )
    max_requests_in_flight: int = Field(
        0,
        ge=0,
        description="Evaluation requests in an engine at once; 0: the engine's batch limit (vLLM's max_num_seqs: "
        "1024 on an H100/H200, 256 on smaller GPUs and per CPU worker). Shared: vLLM queues them with "
        "training's and runs both first come, first served, so a round gets about half the engine's batch.",
    )
    assumed_tokens_per_s: float = Field(
        0,
        ge=0,
        description="Decode speed of one sequence in a full engine, for the start-up check that a shared round "
        "can finish within max_delay_s (services/evaluator/capacity.py); 0: 25 on a GPU (an H100 at a 7B "
        "model in bf16 with several hundred sequences), 20 on CPU (the tiny test model).",
    )
    shard_samples: int = Field(
        64,
        ge=1,
        description="shared: a round is cut into shards of about this many samples (whole tasks), which the "
        "replicas serving its version take as their engines have room.",
    )
    shard_lease_s: float = Field(
        30.0,
        gt=0,
        description="shared: a shard whose replica stops renewing its lease (it died) is taken by another "
        "replica serving the version after this long.",
    )
    gpus: float = Field(0, ge=0, description="dedicated: GPUs the evaluator asks Ray for (0 on CPU).")
    ray_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict, description="dedicated: custom Ray resources the evaluator asks for."
    )
    metrics_port: int = Field(9105, ge=0, le=65535, description="dedicated: /metrics port; 0 = a free port.")

    @model_validator(mode="after")
    def _names(self) -> EvaluationConfig:
        seen: set[str] = set()
        for s in self.sets:
            if not EVAL_SET_NAME.match(s.name):
                raise ValueError(
                    f"evaluation set name {s.name!r} must match {EVAL_SET_NAME.pattern} (it labels metrics)"
                )
            if s.name in seen:
                raise ValueError(f"evaluation set name {s.name!r} is used twice")
            seen.add(s.name)
        return self


def eval_set_environment(sampler: SamplerConfig, spec: EvalSetConfig) -> EnvironmentConfig | None:
    """The run-file environment an evaluation set's episodes run in (None: single-turn); a ValueError naming
    the set if it names one that is not in ``[[sampler.environments]]``."""
    if not spec.environment:
        return None
    for env in sampler.environments:
        if env.name == spec.environment:
            return env
    names = ", ".join(e.name for e in sampler.environments) or "none"
    raise ValueError(
        f"evaluation set {spec.name!r}: environment {spec.environment!r} is not one of "
        f"[[sampler.environments]] ({names}): its episodes need it registered"
    )


class SamplerServiceConfig(ServiceConfig):
    """Everything the sampler reads: the shared sections, ``[sampler]``, ``[evaluation]`` (which runs on
    sampler engines) and the scoring settings of ``[reward]`` (evaluation scores with the same scorers)."""

    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    weight_broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)  # where versions come from
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    agents: AgentsConfig = Field(default_factory=AgentsConfig)
    learner: LearnerLora = Field(default_factory=lambda: LearnerLora())  # what a version is

    @model_validator(mode="after")
    def _adapters_through_the_broker(self) -> SamplerServiceConfig:
        check_adapter_transport(self.learner.lora, self.weight_broker.transport)
        return self


class LearnerLora(BaseModel):
    """The sampler's view of ``[learner]``: ``[learner.lora]``, which says whether a version is an adapter (the
    learner checks the rest of its table)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    lora: LoraConfig = Field(default_factory=LoraConfig)
