"""One optimizer step's gradient: the model-facing half of the objective (VCPO.md §4–§5).

    TrajectoryTensors (prompt+response rows, behaviour log-probs, rewards, group ids)
      │
      ├─ objective "vcpo" without PPO clipping:
      │    per micro-batch: norm_pass → log π (detached), ‖∇ log π(τ_i)‖², saved activations
      │    whole step:      trajectory_coefficients → c_i, ESS, ρ, OPOB, metrics   (vcpo.py, pure)
      │    per micro-batch: accumulate_weighted_gradients(c_i) → .grad              (no second backward)
      │
      └─ any other objective (GRPO, RLOO, REINFORCE) or PPO clipping (per-token weights):
           [vcpo: norms by the norm pass, activations released]
           per micro-batch: forward → policy_loss → backward                       (ordinary autograd)

Both leave the step's gradient in the parameters' ``.grad`` and return the metrics; the caller applies
``metrics["lr_scale"]`` to the learning rate for this one step, clips and steps the optimizer. For a
distributed learner, ``ess_ratio`` is the all-reduced global ρ (``distributed_effective_sample_size``).
The VCPO path keeps every micro-batch's activations until the coefficients are known; that is the memory
of one batched forward of the step's trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from services.learner.config import LearnerConfig
from services.learner.grad_norms import micro_batches, norm_pass, per_trajectory_sq_grad_norms, token_logprobs
from services.learner.vcpo import ObjectiveConfig, PolicyBatch, policy_loss, trajectory_coefficients


@dataclass
class TrajectoryTensors:
    """A step's trajectories as model inputs; every [B, T] tensor is aligned with ``input_ids``."""

    input_ids: Tensor  # [B, T] prompt + response tokens, padded left or right
    attention_mask: Tensor  # [B, T] 1 for real tokens
    response_mask: Tensor  # [B, T] 1 for tokens the model generated and is trained on
    behaviour_logprobs: Tensor  # [B, T] sampler's log-prob of token t at column t (ignored where mask is 0)
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B]

    def rows(self, start: int, stop: int) -> TrajectoryTensors:
        return TrajectoryTensors(
            self.input_ids[start:stop],
            self.attention_mask[start:stop],
            self.response_mask[start:stop],
            self.behaviour_logprobs[start:stop],
            self.rewards[start:stop],
            self.group_ids[start:stop],
        )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def objective_config(learner: LearnerConfig) -> ObjectiveConfig:
    """The pure module's objective settings from the learner's ``[learner]`` config section."""
    return ObjectiveConfig(
        objective=learner.objective,
        importance_weighting=learner.importance_weighting,
        truncation=learner.truncation,
        ess_rule=learner.ess_rule,
        rho_base=learner.rho_base,
        baseline_weighting=learner.baseline_weighting,
        loss_aggregation=learner.loss_aggregation,
        std_normalize=learner.std_normalize,
        ppo_clip=learner.ppo_clip,
    )


def backward(
    model: nn.Module,
    batch: TrajectoryTensors,
    config: ObjectiveConfig,
    micro_batch_size: int | None = None,
    ess_ratio: float | None = None,
) -> dict[str, float]:
    """The step's gradient by the right path for ``config``: the norm pass for VCPO, autograd otherwise."""
    if config.objective == "vcpo" and config.ppo_clip == 0:
        return vcpo_backward(model, batch, config, micro_batch_size, ess_ratio)
    norms = None
    if config.objective == "vcpo":  # with PPO clipping: the norm pass's norms, then the per-token loss
        norms = per_trajectory_sq_grad_norms(
            model, batch.input_ids, batch.attention_mask, batch.response_mask, micro_batch_size
        )
    return policy_gradient_backward(model, batch, config, micro_batch_size, ess_ratio, norms)


def vcpo_backward(
    model: nn.Module,
    batch: TrajectoryTensors,
    config: ObjectiveConfig,
    micro_batch_size: int | None = None,
    ess_ratio: float | None = None,
) -> dict[str, float]:
    """Accumulate the VCPO gradient of ``batch`` into ``.grad`` by the norm pass; return the step's metrics."""
    if config.objective != "vcpo" or config.ppo_clip > 0:
        raise ValueError(
            "vcpo_backward needs objective 'vcpo' without PPO clipping; use policy_gradient_backward"
        )
    spans = micro_batches(len(batch), micro_batch_size)
    passes = [norm_pass(model, *_ids(batch.rows(a, b)), batch.response_mask[a:b]) for a, b in spans]
    logprobs = torch.cat([p.token_logprobs for p in passes])
    policy = _policy(batch, logprobs, torch.cat([p.sq_grad_norms for p in passes]))
    coefficients, metrics = trajectory_coefficients(policy, config, ess_ratio)
    for p, (a, b) in zip(passes, spans, strict=True):
        p.accumulate_weighted_gradients(coefficients[a:b])
    return metrics


def policy_gradient_backward(
    model: nn.Module,
    batch: TrajectoryTensors,
    config: ObjectiveConfig,
    micro_batch_size: int | None = None,
    ess_ratio: float | None = None,
    sq_grad_norms: Tensor | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of any objective by ordinary forward/backward per micro-batch.

    The objective's statistics (baselines, ESS) need the whole step, so log-probs are first computed without
    a graph for all rows, then each micro-batch is re-run with one and weighted by the whole-step values.
    With one micro-batch (the default) the first pass is skipped.
    """
    if config.objective == "vcpo" and sq_grad_norms is None:
        raise ValueError(
            "objective 'vcpo' needs per-trajectory gradient norms: use vcpo_backward or backward"
        )
    spans = micro_batches(len(batch), micro_batch_size)
    if len(spans) == 1:
        logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask)
        loss, metrics = policy_loss(_policy(batch, logprobs, sq_grad_norms), config, ess_ratio)
        loss.backward()
        return metrics
    with torch.no_grad():
        detached = torch.cat([token_logprobs(model, *_ids(batch.rows(a, b))) for a, b in spans])
    _, metrics = policy_loss(_policy(batch, detached, sq_grad_norms), config, ess_ratio)
    # every micro-batch's loss is the whole-step loss restricted to its rows, with the whole-step statistics:
    # run the full-batch loss with the graph only through this micro-batch's log-probs
    for a, b in spans:
        live = token_logprobs(model, *_ids(batch.rows(a, b)))
        logprobs = torch.cat([detached[:a], live, detached[b:]])
        loss, _ = policy_loss(
            _policy(batch, logprobs, sq_grad_norms),
            config,
            metrics["ess_ratio"] if ess_ratio is None else ess_ratio,
        )
        loss.backward()
    return metrics


def _ids(batch: TrajectoryTensors) -> tuple[Tensor, Tensor]:
    return batch.input_ids, batch.attention_mask


def _policy(batch: TrajectoryTensors, logprobs: Tensor, sq_grad_norms: Tensor | None) -> PolicyBatch:
    return PolicyBatch(
        logprobs=logprobs,
        behaviour_logprobs=batch.behaviour_logprobs,
        loss_mask=batch.response_mask.bool(),
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        sq_grad_norms=sq_grad_norms,
    )
