"""The RL loop of the local preset, replayed in one process with genuinely stale rollouts.

Why this exists: the whole system (``make run``) shows how VCPO behaves under lag only at the lag its
throughput produces, and on two CPU cores a few hundred steps at k = 128 would take hours. This module keeps
what decides stability, the learner's own step on rollouts that a policy ``lag`` versions old really
sampled, with that policy's true log-probs as the behaviour log-probs, and drops everything else (Redis,
gRPC, Ray, vLLM, DeepSpeed ZeRO-3):

    versions[v] = the policy after v learner steps (kept while still sampled from)
    each step t: lag_t = min(t, lag) ─► the sampler loads versions[t − lag_t]
                 groups_per_step train prompts (DatasetTasks order) x n responses sampled by it
                 (temperature 1, top-p 1, <= max_tokens tokens, cut at the stop token)
                 ─► the reward service's `math` scorer
                 ─► behaviour log-probs: the sampler's log-softmax of the tokens it drew (vLLM's processed
                    log-probs at temperature 1)
                 ─► the learner's own step: services.learner.step.backward with the given objective
                 ─► lr ← η₀ · decay(t) · lr_scale(ρ) for this step (decay: learner.lr_decay), clip at
                    grad_clip (the pre-clip norm is recorded),
                    AdamW, float32 ─► versions[t + 1]

It decides: ``lag`` is the staleness of every step once ``t ≥ lag`` (the worst case a bound of k allows, and
what a saturated asynchronous run shows at steady state: the samplers run ahead until the lag bound stops
them); before that the sampler uses version 0, the only policy that exists, as the real system does at
start-up. A step whose pre-clip gradient norm is not finite, or that the objective skipped (ρ not finite, nothing
valid), leaves the weights and AdamW's state unchanged (counted in the record as ``update_skipped``) so one bad
step cannot poison the rest of a measurement.

``benchmarks/warm_start_rl.py`` (the local preset's recipe) and ``experiments/stability.py`` (stability under
lag) both run this loop; with the same arguments it consumes the random streams in the same order as the
benchmark's original loop, so its results are unchanged.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.datasets import load_dataset
from services.common.lora import LoraConfig
from services.common.prompts import PromptEncoder
from services.learner.logprobs import token_logprobs
from services.learner.lora import apply_lora, trainable_parameters
from services.learner.lr_schedule import lr_factor
from services.learner.policy_sampling import policy_reward, sample_responses
from services.learner.step import StepInputs, TrajectoryTensors
from services.learner.step import backward as learner_backward
from services.learner.vcpo import ObjectiveConfig
from services.learner.warm_start import (
    pad_batch,
    pad_token_id,
    stop_token_ids,
)
from services.reward.scorers import ScoreInput, get_scorer
from services.sampler.tasks import DatasetTasks

# the learner's metrics a step record keeps (services.learner.vcpo.METRIC_KEYS has them all), with the
# objective's own metrics after them
LEARNER_METRICS = (
    "ess_ratio",
    "lr_scale",
    "loss",
    "log_weight_max",
    "log_weight_min",
    "log_weight_p50",
    "frac_truncated",
    "baseline_shift_mean_abs",
    "advantage_abs_mean",
    "step_skipped",
)


@dataclass(frozen=True)
class ReplaySettings:
    """The local preset's sampling and optimiser settings (deploy/presets/local.toml)."""

    groups_per_step: int = 4  # run.groups_per_step
    n: int = 8  # sampler.n: responses per prompt
    max_tokens: int = 32  # sampler.max_tokens
    max_model_len: int = 256  # sampler.max_model_len
    lr: float = 3e-4  # learner.lr: η₀
    lr_decay: str = "constant"  # learner.lr_decay (the local preset decays linearly; these stay constant)
    lr_decay_steps: int = 0  # learner.lr_decay_steps
    lr_min_ratio: float = 0.0  # learner.lr_min_ratio
    weight_decay: float = 0.0  # learner.weight_decay
    betas: tuple[float, float] = (0.9, 0.999)  # learner.betas
    grad_clip: float = 1.0  # learner.grad_clip

    @classmethod
    def from_preset(cls, preset: Any, **fields: Any) -> ReplaySettings:
        """A run file's settings (its ``[run]``, ``[sampler]`` and ``[learner]``, as the launcher validated
        them); the rate stays constant unless ``fields`` give a decay."""
        s, le = preset.sampler, preset.learner
        return cls(
            groups_per_step=preset.run.groups_per_step,
            n=s.n,
            max_tokens=s.max_tokens,
            max_model_len=s.max_model_len,
            lr=le.lr,
            weight_decay=le.weight_decay,
            betas=le.betas,
            grad_clip=le.grad_clip,
            **fields,
        )


class Replay:
    """One simulated run: call :meth:`step` once per learner step, :meth:`evaluate` whenever wanted.

    ``seed`` generates the dataset (as the run's seed does) and drives the task order and the sampling.
    """

    def __init__(
        self,
        model_dir: Path,
        dataset: str,
        objective: ObjectiveConfig,
        *,
        seed: int,
        lag: int,
        settings: ReplaySettings | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lag < 0:
            raise ValueError(f"Replay: lag must be >= 0, got {lag}")
        self.settings = settings or ReplaySettings()
        self.objective, self.lag, self.dataset = objective, lag, dataset
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if lora is not None and lora.enabled:  # the learner's adapters (services/learner/lora.py) on both
            torch.manual_seed(seed)  # peft's initialization of lora_A draws from the global generator
            apply_lora(self.model, lora)
            apply_lora(self.sampler, lora)
        s = self.settings
        self.encoder = PromptEncoder(self.tokenizer, s.max_model_len, s.max_tokens)
        self.stops = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.pad = pad_token_id(self.tokenizer)
        self.score = get_scorer("math")
        self.tasks = DatasetTasks(load_dataset(dataset, split="train", seed=seed), seed=seed)
        self.trained = trainable_parameters(self.model)  # every weight, or the adapters alone
        self.optimizer = torch.optim.AdamW(self.trained, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
        self.generator = torch.Generator().manual_seed(seed)
        self.versions: list[dict[str, Any]] = [copy.deepcopy(self.model.state_dict())]  # [v]: after v steps
        self.t = 0

    def step(self) -> dict[str, float]:
        """One learner step on rollouts of version ``t − min(t, lag)``; the step's record (module docstring)."""
        s, started = self.settings, time.monotonic()
        lag = min(self.t, self.lag)
        self.sampler.load_state_dict(self.versions[self.t - lag])
        batch = [self.tasks.next() for _ in range(s.groups_per_step)]
        prompts = [self.encoder.encode(task) for task in batch]
        responses = sample_responses(
            self.sampler,
            prompts,
            n=s.n,
            max_tokens=s.max_tokens,
            stop_ids=self.stops,
            pad_id=self.pad,
            generator=self.generator,
        )
        rows = [(prompt, r) for prompt, group in zip(prompts, responses, strict=True) for r in group]
        rewards = [
            self.score(ScoreInput(self.tokenizer.decode(r, skip_special_tokens=True), task.reference)).value
            for task, group in zip(batch, responses, strict=True)
            for r in group
        ]
        ids, attention, response_mask = pad_batch(rows, self.pad)
        with torch.no_grad():  # the sampler's log-probs: at temperature 1, vLLM's processed log-probs
            behaviour = token_logprobs(self.sampler, ids, attention)
        trajectories = TrajectoryTensors(
            ids, attention, response_mask, behaviour, torch.tensor(rewards), torch.arange(len(rows)) // s.n
        )
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = learner_backward(StepInputs(self.model, trajectories, self.objective))
        base_lr = s.lr * lr_factor(self.t, s.lr_decay, s.lr_decay_steps, s.lr_min_ratio)
        for group in self.optimizer.param_groups:  # lr ← η₀ · decay(t) · s(ρ), as the learner sets it
            group["lr"] = base_lr * metrics["lr_scale"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trained, s.grad_clip))
        finite = math.isfinite(grad_norm)
        update = (
            finite and not metrics["step_skipped"]
        )  # a skipped step leaves AdamW alone, as the learner's does
        if update:
            self.optimizer.step()
        self.t += 1
        self.versions.append(copy.deepcopy(self.model.state_dict()))
        if len(self.versions) > self.lag + 1:
            self.versions[-self.lag - 2] = {}  # no longer sampled from
        groups = [rewards[i : i + s.n] for i in range(0, len(rewards), s.n)]
        record = {
            "step": float(self.t - 1),
            "lag": float(lag),
            "reward": statistics.fmean(rewards),
            "grad_norm": grad_norm,
            "update_skipped": float(not update),
            "zero_signal_groups": float(sum(max(g) == min(g) for g in groups)),
            "response_tokens": float(response_mask.sum()) / len(rows),
            "seconds": time.monotonic() - started,
        }
        spec = self.objective.spec  # and the objective's own metrics, whatever it declares
        record.update(
            {key: float(metrics[key]) for key in (*LEARNER_METRICS, *spec.metrics, *spec.summed_metrics)}
        )
        return record

    def evaluate(self, tasks: list[Any], *, n_samples: int, seed: int, temperature: float = 1.0) -> float:
        """The sampled reward of the learner's current policy (version ``t``) on ``tasks``, as RL samples
        (at ``temperature``)."""
        self.model.eval()
        return policy_reward(
            self.model,
            self.tokenizer,
            tasks,
            n_samples=n_samples,
            temperature=temperature,
            seed=seed,
            max_tokens=self.settings.max_tokens,
            max_model_len=self.settings.max_model_len,
        )
