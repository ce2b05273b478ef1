"""The learner's loss (docs/research/vcpo.md §1, §2, §4, §6): one step's trajectories in, ``(loss, metrics)`` out.

Why a module of its own: every number the learner optimises comes from here, so it is pure (tensors in,
tensors and floats out; no I/O, no services, no model code) and testable to round-off. What differs between
objectives (the advantage rule, whether it needs gradient norms, std-normalisation, where the zero-signal
rule looks) each objective's module in ``objectives/`` declares; VCPO's OPOB baseline (§3) is
``objectives/vcpo.py``. The per-trajectory gradient-norm pass (§5) lives in ``grad_norms.py`` and consumes
:func:`trajectory_coefficients`; ESS and the step size (§2) are ``ess.py``.

Rules this module decides (each function's docstring repeats the ones it applies):

- Importance weights live in log space, float64: ``ℓ_i = Σ_t mask·(log π − log μ)``; positions outside the
  mask are ignored even if they hold NaN/inf (``torch.where``, never a multiply). ``exp(ℓ)`` of a large
  ``ℓ`` is never formed: the loss weight is ``exp(min(ℓ, log C))``, ESS and OPOB are log-sum-exp forms.
- Validity: bad shapes or dtypes, non-integer group ids, non-finite rewards, a loss mask that is not 0/1 and
  non-finite *current* log-probs on masked tokens raise ``ValueError`` naming the indices. A trajectory with
  an empty mask, or a non-finite *behaviour* log-prob on a masked token, is skipped and counted: coefficient
  0, excluded from ESS, baselines, group statistics and from ``B`` (``B`` = number of valid trajectories).
- The step is skipped (``step_skipped = 1``, loss ``0·Σ logπ`` so it stays differentiable) when no trajectory
  is valid, when ρ is not finite, or when a coefficient or the loss overflows the loss dtype (e.g. with
  ``C = inf`` and ``ℓ ≫ 88`` in float32). A NaN/inf loss is never returned.
- Advantages: the objective's rule (vcpo ``R − b_OPOB``; grpo ``R − mean_g``; rloo ``R_i −`` the mean of the
  other members of its group; reinforce ``R −`` the mean over the valid batch), then divided by ``σ_g``, the
  population std of the group's valid rewards, when the objective takes std-normalisation (vcpo, grpo),
  ``std_normalize`` is set and ``σ_g > 1e-8``. A rule's output is held to its contract
  (``objectives.AdvantageRule``): a floating ``[V]`` tensor, and only the metric names its objective declares
  (or the two baseline keys); anything else raises ``ValueError`` naming the objective.
- Zero-signal rule: a group whose valid rewards are all equal, or that has one valid member, gets ``Â = 0``
  exactly. An objective whose baseline is the batch's (reinforce) applies the same rule to the batch (all
  valid rewards equal, or one valid trajectory) and its groups are not zeroed.
- PPO clipping (``ppo_clip > 0``) replaces the sequence weight by per-token ratios (``w̄ ≡ 1`` everywhere,
  ``importance_weighting`` inert); the log-ratio is clamped to ``[-20, 20]`` before ``exp`` (as veRL does) so
  a wild token cannot overflow the loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args

import torch
from torch import Tensor

from services.learner import objectives
from services.learner.ess import effective_sample_size, lr_scale
from services.learner.metric_names import METRIC_KEYS as METRIC_KEYS  # kept there to be read without torch
from services.learner.objectives import AdvantageInputs, Objective
from services.learner.ops import (
    F64,
    Aggregation,
    ISMode,
    LRRule,
    Weighting,
    check_choice,
    check_finite,
    check_group_ids,
    check_truncation,
    log_loss_weight,
    positions,
    seg_extreme,
    seg_sum,
    segments,
)

STD_EPS = 1e-8  # σ_g at or below this is treated as zero: no division
PPO_LOG_RATIO_LIMIT = 20.0  # per-token log-ratio clamp under PPO clipping (veRL uses the same bound)


@dataclass(frozen=True)
class ObjectiveConfig:
    """How one step's loss is built (docs/research/vcpo.md §3–§4); every field is validated on construction."""

    objective: str = "vcpo"  # a registered objective (objectives/)
    importance_weighting: ISMode = "truncated"  # TIS = truncated, MIS = masked, none = no correction
    truncation: float = 8.0  # C (> 0, may be math.inf)
    ess_rule: LRRule = "sqrt"
    rho_base: float = 1.0  # in (0, 1]
    baseline_weighting: Weighting = "paper"
    loss_aggregation: Aggregation = "seq-mean-token-mean"
    std_normalize: bool = True  # divide by the group's population std (where the objective takes it)
    ppo_clip: float = 0.0  # ε; 0 = off
    # the objective's own settings (``[learner.objective_settings]``), validated against its settings model
    objective_settings: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # that validation's result, what the advantage rule reads: an instance of the objective's settings model
    # (its defaults where the table is silent), or None for an objective that declares none
    settings: Any = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        o = "ObjectiveConfig."
        check_choice(o, "objective", self.objective, objectives.NAMES)
        settings = objectives.settings_of(self.objective, self.objective_settings, f"{o}objective_settings")
        object.__setattr__(self, "settings", settings)
        check_choice(o, "importance_weighting", self.importance_weighting, get_args(ISMode))
        check_truncation(o, self.truncation)
        check_choice(o, "ess_rule", self.ess_rule, get_args(LRRule))
        rb = self.rho_base
        if isinstance(rb, bool) or not isinstance(rb, int | float) or not 0 < rb <= 1:
            raise ValueError(f"{o}rho_base must be in (0, 1], got {rb!r}")
        check_choice(o, "baseline_weighting", self.baseline_weighting, get_args(Weighting))
        check_choice(o, "loss_aggregation", self.loss_aggregation, get_args(Aggregation))
        if not isinstance(self.std_normalize, bool):
            raise ValueError(f"{o}std_normalize must be a bool, got {self.std_normalize!r}")
        pc = self.ppo_clip
        if isinstance(pc, bool) or not isinstance(pc, int | float) or not (math.isfinite(pc) and pc >= 0):
            raise ValueError(f"{o}ppo_clip must be a finite number >= 0, got {pc!r}")

    @property
    def spec(self) -> Objective:
        """The registered objective this config names: what its loss asks instead of comparing names."""
        return objectives.get(self.objective)


def objective_config(settings: object) -> ObjectiveConfig:
    """The objective settings held by ``settings`` (the learner's ``[learner]`` config section): every field
    of :class:`ObjectiveConfig`, read by its name."""
    return ObjectiveConfig(**{f.name: getattr(settings, f.name) for f in fields(ObjectiveConfig) if f.init})


@dataclass
class PolicyBatch:
    """One step's trajectories on one rank; response positions aligned, padding anywhere outside the mask."""

    logprobs: Tensor  # [B, T] current-policy log-probs of the response tokens (may require grad)
    behaviour_logprobs: Tensor  # [B, T] sampler's log-probs
    loss_mask: Tensor  # [B, T] bool (or 0/1): tokens the model generated and is trained on
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B] integer ids; trajectories of one prompt group share an id
    sq_grad_norms: Tensor | None = None  # [B] ‖∇θ log π(τ_i)‖², required when the objective needs them


# ---------------------------------------------------------------- §1 log weights


def sequence_log_weights(logprobs: Tensor, behaviour_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """``ℓ_i = Σ_t mask·(log π − log μ)`` in float64, detached, shape ``[B]``.

    Positions outside the mask are ignored even if they hold NaN/inf. A non-finite log-prob on a masked token
    makes ``ℓ_i`` non-finite (callers skip such trajectories).
    """
    if logprobs.dim() != 2 or logprobs.shape != behaviour_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            "logprobs, behaviour_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(behaviour_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    diff = logprobs.detach().to(F64) - behaviour_logprobs.detach().to(F64)
    return torch.where(loss_mask.bool(), diff, torch.zeros_like(diff)).sum(dim=-1)


# ---------------------------------------------------------------- validation and advantages


def _validate(batch: PolicyBatch, config: ObjectiveConfig) -> Tensor:
    """Raise ``ValueError`` on a malformed batch; return the loss mask as bool."""
    lp, mask = batch.logprobs, batch.loss_mask
    if lp.dim() != 2 or not lp.dtype.is_floating_point:
        raise ValueError(
            f"PolicyBatch.logprobs must be a 2-D float tensor [B, T], got {lp.dtype} {tuple(lp.shape)}"
        )
    b = lp.shape[0]
    for name in ("behaviour_logprobs", "loss_mask"):
        if getattr(batch, name).shape != lp.shape:
            got = tuple(getattr(batch, name).shape)
            raise ValueError(f"PolicyBatch.{name} must have shape {tuple(lp.shape)}, got {got}")
    for name in ("rewards", "group_ids", "sq_grad_norms"):
        t = getattr(batch, name)
        if t is not None and (t.dim() != 1 or t.shape[0] != b):
            raise ValueError(f"PolicyBatch.{name} must have shape [B] = [{b}], got {tuple(t.shape)}")
    if config.spec.needs_sq_grad_norms and batch.sq_grad_norms is None:
        raise ValueError(
            f"PolicyBatch.sq_grad_norms is required for objective {config.objective!r} (its baseline weights)"
        )
    check_group_ids(batch.group_ids, "PolicyBatch.group_ids")
    if mask.dtype != torch.bool:
        not01 = (mask != 0) & (mask != 1)
        if bool(not01.any()):
            raise ValueError(f"PolicyBatch.loss_mask must be bool or 0/1, bad values at {positions(not01)}")
        mask = mask != 0
    check_finite(batch.rewards, "PolicyBatch.rewards")
    check_finite(lp.detach(), "PolicyBatch.logprobs on masked tokens", mask)
    return mask


def _rule_output(
    objective: Objective, adv: object, own: object, r: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """The advantage rule's ``(Â, metrics)`` checked against its contract (objectives.AdvantageRule): a
    floating ``[V]`` tensor (as float64) and only the metric names its objective may set, as floats."""
    who = f"objective {objective.name!r}'s advantage rule"
    if not isinstance(adv, Tensor) or not adv.dtype.is_floating_point or adv.shape != r.shape:
        got = f"{adv.dtype} {tuple(adv.shape)}" if isinstance(adv, Tensor) else type(adv).__name__
        raise ValueError(
            f"{who} must return a floating tensor of shape {tuple(r.shape)} (one Â per valid "
            f"trajectory), got {got}"
        )
    if not isinstance(own, dict):
        raise ValueError(f"{who} must return its metrics as a dict, got {type(own).__name__}")
    undeclared = sorted(k for k in own if k not in objective.metric_names)
    if undeclared:
        raise ValueError(
            f"{who} returned metrics {undeclared} that its OBJECTIVE does not declare: name them in "
            f"Objective(metrics=...) (or summed_metrics=... for counts); it may set {list(objective.metric_names)}"
        )
    return adv.to(F64), {k: float(v) for k, v in own.items()}


def _advantages(
    config: ObjectiveConfig,
    r: Tensor,
    inv: Tensor,
    n_groups: int,
    log_w: Tensor,
    lengths: Tensor,
    g: Tensor | None,
) -> tuple[Tensor, dict[str, float]]:
    """``Â`` (float64) over valid trajectories by the objective's rule, and the baseline metrics (module
    rules)."""
    count = seg_sum(torch.ones_like(r), inv, n_groups)
    mean = seg_sum(r, inv, n_groups) / count
    dev = r - mean[inv]
    std = torch.sqrt(seg_sum(dev * dev, inv, n_groups) / count)
    single = count == 1
    zero_group = (seg_extreme(r, inv, n_groups, "amax") == seg_extreme(r, inv, n_groups, "amin")) | single
    stats = {
        "baseline_fallbacks": 0.0,
        "baseline_shift_mean_abs": 0.0,
        "singleton_groups": float(single.sum()),
    }
    objective = config.spec
    inputs = AdvantageInputs(r, inv, n_groups, count, mean, log_w, lengths, g)
    adv, own = _rule_output(objective, *objective.advantages(inputs, config), r)
    stats.update(own)
    if objective.zero_signal == "batch":  # the batch is the baseline's "group"
        zero_group = torch.full_like(zero_group, bool(r.max() == r.min()))
    if objective.std_normalize and config.std_normalize:
        s = std[inv]
        adv = torch.where(s > STD_EPS, adv / torch.where(s > STD_EPS, s, torch.ones_like(s)), adv)
    return torch.where(zero_group[inv], torch.zeros_like(adv), adv), stats


# ---------------------------------------------------------------- §4 coefficients and the loss


@dataclass
class _Step:
    """Everything both loss forms share: validity, log weights, advantages, metrics."""

    mask: Tensor  # [B, T] bool, rows of skipped trajectories cleared
    valid: Tensor  # [B] bool
    lengths: Tensor  # [B] float64 loss tokens per trajectory (0 for skipped ones)
    log_w: Tensor  # [B] float64 ℓ (0 for skipped ones)
    adv: Tensor  # [B] float64 Â (0 for skipped ones)
    skip: bool
    metrics: dict[str, float]


def _validity(batch: PolicyBatch, config: ObjectiveConfig) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(mask, valid, lengths, nonempty, beh_ok)``: the loss mask with skipped rows cleared, and why rows skip."""
    mask = _validate(batch, config)
    beh = batch.behaviour_logprobs.detach()
    lengths = mask.sum(dim=-1).to(F64)
    nonempty = lengths > 0
    beh_ok = ~(mask & ~torch.isfinite(beh)).any(dim=-1)
    valid = nonempty & beh_ok
    mask = mask & valid[:, None]
    lengths = torch.where(valid, lengths, torch.zeros_like(lengths))
    return mask, valid, lengths, nonempty, beh_ok


def valid_log_weights(batch: PolicyBatch, config: ObjectiveConfig) -> Tensor:
    """ℓ (float64) of the trajectories the step keeps, the ones ESS is taken over: what a distributed
    learner all-reduces (:func:`distributed_effective_sample_size`) to pass the global ρ to the loss."""
    mask, valid, *_ = _validity(batch, config)
    return sequence_log_weights(batch.logprobs, batch.behaviour_logprobs.detach(), mask)[valid]


def _prepare(batch: PolicyBatch, config: ObjectiveConfig, ess_ratio: float | None) -> _Step:
    mask, valid, lengths, nonempty, beh_ok = _validity(batch, config)
    beh = batch.behaviour_logprobs.detach()
    log_w_all = sequence_log_weights(batch.logprobs, beh, mask)
    lw, r = log_w_all[valid], batch.rewards.detach().to(F64)[valid]
    n_valid = int(valid.sum())
    ess, local_rho = effective_sample_size(lw)
    rho = local_rho if ess_ratio is None else float(ess_ratio)
    if math.isfinite(rho) and not 0 <= rho <= 1:
        raise ValueError(f"ess_ratio must be in [0, 1], got {rho!r}")
    nan = math.nan
    spec = config.spec
    m: dict[str, float] = dict.fromkeys((*METRIC_KEYS, *spec.metrics, *spec.summed_metrics), 0.0)
    m.update(ess=ess, ess_ratio=rho, lr_scale=lr_scale(rho, config.rho_base, config.ess_rule))
    m.update(skipped_empty=float((~nonempty).sum()), skipped_nonfinite=float((nonempty & ~beh_ok).sum()))
    m.update(num_trajectories=float(valid.numel()), num_valid=float(n_valid), num_tokens=float(lengths.sum()))
    if n_valid:
        q = torch.quantile(lw, torch.tensor([0.5, 0.9, 0.99], dtype=F64, device=lw.device)).tolist()
        m.update(log_weight_max=float(lw.max()), log_weight_min=float(lw.min()))
        m.update(log_weight_p50=q[0], log_weight_p90=q[1], log_weight_p99=q[2])
        m["frac_truncated"] = float((lw > math.log(config.truncation)).to(F64).mean())
        inv, n_groups = segments(batch.group_ids[valid])
        g = None if batch.sq_grad_norms is None else batch.sq_grad_norms[valid]
        adv_v, stats = _advantages(config, r, inv, n_groups, lw, lengths[valid], g)
        m.update(stats)
        m["advantage_abs_mean"] = float(adv_v.abs().mean())
    else:
        m.update(
            log_weight_max=nan, log_weight_min=nan, log_weight_p50=nan, log_weight_p90=nan, log_weight_p99=nan
        )
        adv_v = r
    adv = torch.zeros_like(log_w_all).masked_scatter_(valid, adv_v)
    log_w = torch.where(valid, log_w_all, torch.zeros_like(log_w_all))
    skip = n_valid == 0 or not math.isfinite(rho)
    return _Step(mask, valid, lengths, log_w, adv, skip, m)


def _zero_loss(logprobs: Tensor, mask: Tensor) -> Tensor:
    """``0·Σ logπ`` over masked tokens: zero, finite, and still connected to the graph."""
    return torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum() * 0.0


def _masked_seq_sums(logprobs: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum(dim=-1)


def _coefficients(
    batch: PolicyBatch, config: ObjectiveConfig, ess_ratio: float | None
) -> tuple[Tensor, _Step]:
    step = _prepare(batch, config, ess_ratio)
    dtype = batch.logprobs.dtype
    if step.skip:
        return torch.zeros_like(step.log_w, dtype=dtype), step
    n_valid = step.metrics["num_valid"]
    wbar = torch.exp(log_loss_weight(step.log_w, config.importance_weighting, config.truncation))
    if config.loss_aggregation == "seq-mean-token-mean":
        denom = n_valid * torch.where(step.valid, step.lengths, torch.ones_like(step.lengths))
    elif config.loss_aggregation == "seq-mean-token-sum":
        denom = torch.full_like(step.lengths, n_valid)
    else:
        denom = torch.full_like(step.lengths, step.metrics["num_tokens"])
    # Â = 0 wins over an overflowing w̄ (C = inf): 0·inf must not turn a zero-signal trajectory into NaN
    live = step.valid & (step.adv != 0)
    coef64 = torch.where(live, -step.adv * wbar / denom, torch.zeros_like(step.adv))
    coef = coef64.to(dtype)
    # the coefficients and the loss they imply must be representable in the loss dtype
    value = (coef * _masked_seq_sums(batch.logprobs.detach(), step.mask)).sum()
    if not (bool(torch.isfinite(coef).all()) and math.isfinite(float(value))):
        step.skip = True
        return torch.zeros_like(coef), step
    return coef, step


def _finish(step: _Step) -> dict[str, float]:
    step.metrics["step_skipped"] = float(step.skip)
    if step.skip:
        step.metrics["lr_scale"] = 0.0
    return step.metrics


def trajectory_coefficients(
    batch: PolicyBatch, config: ObjectiveConfig, ess_ratio: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Detached ``coef [B]`` (``batch.logprobs``' dtype) with ``loss = Σ_i coef_i · Σ_t mask_it · logπ_it``.

    ``coef_i = −Â_i·w̄_i/(B·L_i)`` (seq-mean-token-mean), ``−Â_i·w̄_i/B`` (seq-mean-token-sum),
    ``−Â_i·w̄_i/ΣL`` (token-mean); ``B`` and ``ΣL`` count valid trajectories only, skipped ones get 0, and a
    skipped step gives all zeros. ``w̄``: truncated ``exp(min(ℓ, log C))``, masked ``exp(ℓ)·[ℓ ≤ log C]``,
    none 1. ``ess_ratio`` is the global ρ when given, else this batch's. Raises ``ValueError`` when
    ``config.ppo_clip > 0`` (per-token coefficients have no per-trajectory form).
    """
    if config.ppo_clip > 0:
        raise ValueError(f"trajectory_coefficients: ppo_clip={config.ppo_clip} has per-token coefficients")
    coef, step = _coefficients(batch, config, ess_ratio)
    m = _finish(step)
    m["loss"] = float((coef * _masked_seq_sums(batch.logprobs.detach(), step.mask)).sum())
    return coef, m


def _ppo_loss(batch: PolicyBatch, config: ObjectiveConfig, step: _Step) -> tuple[Tensor, float]:
    """The clipped per-token surrogate and the share of loss tokens where the clip binds (zero gradient)."""
    lp, mask, eps = batch.logprobs, step.mask, config.ppo_clip
    beh = batch.behaviour_logprobs.detach().to(lp.dtype)
    log_ratio = torch.where(mask, lp - torch.where(mask, beh, torch.zeros_like(beh)), torch.zeros_like(lp))
    ratio = torch.exp(torch.clamp(log_ratio, -PPO_LOG_RATIO_LIMIT, PPO_LOG_RATIO_LIMIT))
    adv = step.adv.to(lp.dtype)[:, None]
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1.0 - eps, 1.0 + eps) * adv
    term = torch.where(mask, torch.minimum(unclipped, clipped), torch.zeros_like(lp))
    binds = mask & (clipped.detach() < unclipped.detach())
    seq = term.sum(dim=-1)
    n_valid, n_tok = step.metrics["num_valid"], step.metrics["num_tokens"]
    if config.loss_aggregation == "seq-mean-token-mean":
        lengths = torch.where(step.valid, step.lengths, torch.ones_like(step.lengths)).to(lp.dtype)
        total = (seq / lengths).sum() / n_valid
    elif config.loss_aggregation == "seq-mean-token-sum":
        total = seq.sum() / n_valid
    else:
        total = seq.sum() / n_tok
    return -total, float(binds.sum()) / n_tok


def policy_loss(
    batch: PolicyBatch, config: ObjectiveConfig, ess_ratio: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The step's scalar loss (differentiable through ``batch.logprobs``, its dtype) and metrics.

    ``ppo_clip == 0``: ``Σ_i coef_i Σ_t mask·logπ`` with :func:`trajectory_coefficients`' coefficients (same
    code). ``ppo_clip = ε > 0``: token term ``min(r_t·Â_i, clip(r_t, 1−ε, 1+ε)·Â_i)`` with
    ``r_t = exp(clamp(logπ_t − logμ_t, ±20))``, aggregated per ``loss_aggregation``, negated; no sequence
    weight, so ``w̄ ≡ 1`` wherever it appears (also in the exact and released OPOB weights) and
    ``importance_weighting`` has no effect. ``ess_ratio``: the global ρ when given (in [0, 1], or non-finite
    to skip), else this batch's; it drives ``lr_scale`` and the skip, while ``metrics["ess"]`` is always this
    batch's own ESS. A skipped step (module rules) returns ``0·Σ logπ`` and ``metrics["step_skipped"] = 1``,
    ``lr_scale = 0``. Metric keys, in order: :data:`METRIC_KEYS`, then the objective's own ``metrics`` and
    ``summed_metrics`` (0 where its rule did not run or set them); undefined statistics (ESS and log-weight
    quantiles of a batch with no valid trajectory) are NaN, the loss never is.
    """
    lp = batch.logprobs
    if config.ppo_clip == 0:
        coef, step = _coefficients(batch, config, ess_ratio)
        loss = (coef * _masked_seq_sums(lp, step.mask)).sum()
    else:
        step = _prepare(batch, config, ess_ratio)
        loss = lp.new_zeros(())
        if not step.skip:
            loss, step.metrics["ppo_clip_fraction"] = _ppo_loss(batch, config, step)
            step.skip = not math.isfinite(float(loss.detach()))
    if step.skip:
        loss = _zero_loss(lp, step.mask)
        step.metrics["ppo_clip_fraction"] = 0.0
    m = _finish(step)
    m["loss"] = float(loss.detach())
    return loss, m
