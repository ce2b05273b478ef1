"""VCPO's advantage (docs/research/vcpo.md §3): the reward minus the off-policy optimal baseline (OPOB) of its group.

``b_g = Σ_g W_i R_i / Σ_g W_i`` weighs each trajectory by its importance weight and its squared score-gradient
norm ``‖∇θ log π(τ_i)‖²``, so this objective needs the norm pass; ``Â = (R − b_g)/σ_g`` with
``std_normalize``, and the zero-signal rule applies per group. The weights are handled in log space (a
weight like ``e^2000`` is fine) and a group whose weights are unusable falls back to its plain mean.

torch (and ``ops``, which needs it) is imported inside the functions: the config's validation imports an
objective's module to read its declaration, and must not need torch for it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, get_args

from services.learner.objectives import AdvantageInputs, Objective

if TYPE_CHECKING:
    from torch import Tensor

    from services.learner.vcpo import ObjectiveConfig


def _opob_groups(
    rewards: Tensor,
    log_weights: Tensor,
    sq_grad_norms: Tensor,
    inv: Tensor,
    n_groups: int,
    weighting: str,
    truncation: float,
    lengths: Tensor | None,
    aggregation: str,
    importance_weighting: str,
) -> tuple[Tensor, int]:
    """Per-group ``b_g`` (float64 ``[G]``) and the number of groups that fell back to their mean."""
    import torch

    from services.learner.ops import F64, log_loss_weight, seg_extreme, seg_sum

    r, lw, g = rewards.to(F64), log_weights.to(F64), sq_grad_norms.detach().to(F64)
    nan = torch.full_like(g, math.nan)
    log_g = torch.where(torch.isnan(g), nan, torch.where(g > 0, torch.log(g), torch.full_like(g, -math.inf)))
    if weighting == "paper":
        log_big_w = 2.0 * lw + log_g
    else:
        log_wbar = log_loss_weight(lw, importance_weighting, truncation)
        if weighting == "exact":
            log_a = log_wbar
            if aggregation == "seq-mean-token-mean":
                assert lengths is not None
                log_a = log_wbar - torch.log(lengths.to(F64))
            log_big_w = 2.0 * log_a + log_g
        else:  # released
            log_big_w = 2.0 * log_wbar + log_g + 2.0 * lw
    bad = torch.isnan(log_big_w) | torch.isposinf(log_big_w)
    clean = torch.where(bad, torch.full_like(log_big_w, -math.inf), log_big_w)
    gmax = seg_extreme(clean, inv, n_groups, "amax")
    fallback = (seg_sum(bad.to(F64), inv, n_groups) > 0) | torch.isneginf(gmax)
    e = torch.exp(clean - torch.where(fallback, torch.zeros_like(gmax), gmax)[inv])
    count = seg_sum(torch.ones_like(r), inv, n_groups)
    mean = seg_sum(r, inv, n_groups) / count
    weighted = seg_sum(e * r, inv, n_groups) / torch.where(fallback, count, seg_sum(e, inv, n_groups))
    lo, hi = seg_extreme(r, inv, n_groups, "amin"), seg_extreme(r, inv, n_groups, "amax")
    return torch.minimum(torch.maximum(torch.where(fallback, mean, weighted), lo), hi), int(fallback.sum())


def opob_baseline_with_stats(
    rewards: Tensor,
    log_weights: Tensor,
    sq_grad_norms: Tensor,
    group_ids: Tensor,
    weighting: str = "paper",
    *,
    truncation: float = 8.0,
    lengths: Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    importance_weighting: str = "truncated",
) -> tuple[Tensor, int]:
    """:func:`opob_baseline` and the number of groups that fell back to their plain mean."""
    import torch

    from services.learner.ops import (
        F64,
        Aggregation,
        ISMode,
        Weighting,
        check_choice,
        check_finite,
        check_group_ids,
        check_truncation,
        positions,
        segments,
    )

    owner = "opob_baseline "
    check_choice(owner, "weighting", weighting, get_args(Weighting))
    check_choice(owner, "aggregation", aggregation, get_args(Aggregation))
    check_choice(owner, "importance_weighting", importance_weighting, get_args(ISMode))
    truncation = check_truncation(owner, truncation)
    n = rewards.shape[0] if rewards.dim() == 1 else -1
    names = ("rewards", "log_weights", "sq_grad_norms", "group_ids", "lengths")
    for name, t in zip(names, (rewards, log_weights, sq_grad_norms, group_ids, lengths), strict=True):
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"opob_baseline: {name} must have shape [B] = [{n}], got {tuple(t.shape)}")
    check_group_ids(group_ids, "opob_baseline group_ids")
    check_finite(rewards, "opob_baseline rewards")
    if weighting == "exact" and aggregation == "seq-mean-token-mean":
        if lengths is None:
            raise ValueError("opob_baseline: weighting 'exact' with seq-mean-token-mean needs `lengths`")
        if bool((~(lengths > 0)).any()):
            raise ValueError(f"opob_baseline: lengths must be > 0, bad at {positions(~(lengths > 0))}")
    if n == 0:
        return torch.zeros(0, dtype=F64, device=rewards.device), 0
    inv, n_groups = segments(group_ids)
    args = (weighting, truncation, lengths, aggregation, importance_weighting)
    b, fallbacks = _opob_groups(rewards, log_weights, sq_grad_norms, inv, n_groups, *args)
    return b[inv], fallbacks


def opob_baseline(
    rewards: Tensor,
    log_weights: Tensor,
    sq_grad_norms: Tensor,
    group_ids: Tensor,
    weighting: str = "paper",
    *,
    truncation: float = 8.0,
    lengths: Tensor | None = None,
    aggregation: str = "seq-mean-token-mean",
    importance_weighting: str = "truncated",
) -> Tensor:
    """Each trajectory's group baseline ``b_g = Σ_g W_i R_i / Σ_g W_i`` (float64 ``[B]``, docs/research/vcpo.md §3).

    ``log W_i`` per weighting (``g_i`` = squared score-gradient norm, ``w̄`` per ``importance_weighting``):
    paper ``2ℓ_i + log g_i``; exact ``2 log a_i + log g_i`` with ``log a_i = log w̄_i − log L_i`` for
    seq-mean-token-mean (``lengths`` required) else ``log w̄_i``; released ``2 log w̄_i + log g_i + 2ℓ_i``.
    ``g_i ≤ 0`` is weight 0. The weighted mean is a per-group softmax of ``log W`` (log space: a weight like
    ``e^2000`` is fine). A group whose weights are all zero, or hold any NaN/+inf (``g`` NaN/inf, ``ℓ`` NaN),
    falls back to its plain mean. ``b_g`` is clamped into ``[min R_g, max R_g]`` against round-off.
    """
    return opob_baseline_with_stats(
        rewards,
        log_weights,
        sq_grad_norms,
        group_ids,
        weighting,
        truncation=truncation,
        lengths=lengths,
        aggregation=aggregation,
        importance_weighting=importance_weighting,
    )[0]


def advantages(inputs: AdvantageInputs, config: ObjectiveConfig) -> tuple[Tensor, dict[str, float]]:
    """``R − b_g`` with the OPOB weighting of ``config``, how many groups fell back to their mean, and how far
    the baselines moved from those means."""
    assert inputs.sq_grad_norms is not None
    # under PPO the loss carries no sequence weight: w̄ ≡ 1 in the exact and released weights too
    is_mode = "none" if config.ppo_clip > 0 else config.importance_weighting
    b, fallbacks = _opob_groups(
        inputs.rewards,
        inputs.log_weights,
        inputs.sq_grad_norms,
        inputs.groups,
        inputs.n_groups,
        config.baseline_weighting,
        config.truncation,
        inputs.lengths,
        config.loss_aggregation,
        is_mode,
    )
    stats = {
        "baseline_fallbacks": float(fallbacks),
        "baseline_shift_mean_abs": float((b - inputs.mean).abs().mean()),
    }
    return inputs.rewards - b[inputs.groups], stats


OBJECTIVE = Objective("vcpo", advantages, needs_sq_grad_norms=True, std_normalize=True)
