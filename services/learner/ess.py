"""ESS and the step's learning-rate scale (docs/research/vcpo.md §2), in float64 log space, local or across ranks.

``ρ = ESS / B`` with ``log ESS = 2·logsumexp(ℓ) − logsumexp(2ℓ)`` over the step's trajectories, all
data-parallel ranks together: every rank must obtain the same ρ, so a distributed learner all-reduces the
max of ``ℓ`` and then the shifted partial sums (:func:`distributed_effective_sample_size`). A non-finite ρ
never means "no damping": :func:`lr_scale` turns it into 0, i.e. a skipped step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_F64 = torch.float64


def _as_log_weights(log_weights: Tensor) -> Tensor:
    if log_weights.dim() != 1:
        raise ValueError(f"log_weights must be 1-D, got shape {tuple(log_weights.shape)}")
    return log_weights.detach().to(_F64)


def ess_partial_sums(log_weights: Tensor, shift: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(Σ exp(ℓ−shift), Σ exp(2(ℓ−shift)), count)`` as float64 scalars: what ranks all-reduce (SUM).

    ``shift`` must be the MAX of ``ℓ`` over all ranks (so no term exceeds 1 and every rank agrees);
    ``ℓ = -inf`` (weight 0) contributes 0 even when ``shift = -inf``. NaN/+inf in ``ℓ`` propagate.
    """
    lw = _as_log_weights(log_weights)
    z = torch.where(torch.isneginf(lw), lw, lw - shift)
    count = torch.tensor(float(lw.numel()), dtype=_F64, device=lw.device)
    return torch.exp(z).sum(), torch.exp(2.0 * z).sum(), count


def ess_from_partial_sums(
    s1: Tensor | float, s2: Tensor | float, count: Tensor | float
) -> tuple[float, float]:
    """``(ESS, ρ)`` from (all-reduced) partial sums: ``ESS = s1²/s2 = exp(2·log s1 − log s2)``, ``ρ = ESS/n``.

    With the max shift ``1 ≤ s2 ≤ s1 ≤ n``, so ``(s1/s2)·s1`` neither overflows nor underflows and is exact
    for equal weights (``exp(log 5)`` is not 5); the log form is the fallback for any other shift. Both are
    clamped to their bounds (``ESS ≤ n``, ``ρ ≤ 1``) against round-off. An empty batch, all-zero weights or
    any non-finite sum gives ``(nan, nan)``.
    """
    a, b, n = float(s1), float(s2), float(count)
    if not (n > 0 and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0 and math.isfinite(n)):
        return math.nan, math.nan
    ess = (a / b) * a
    if not (math.isfinite(ess) and ess > 0):
        ess = math.exp(2.0 * math.log(a) - math.log(b))
    if not (math.isfinite(ess) and ess > 0):
        return math.nan, math.nan
    ess = min(ess, n)
    return ess, min(1.0, ess / n)


def effective_sample_size(log_weights: Tensor) -> tuple[float, float]:
    """``(ESS, ESS/B)`` of a 1-D tensor of log weights, computed in float64 log space (docs/research/vcpo.md §2).

    Finite for any finite ``ℓ`` (the shift by ``max ℓ`` keeps every term in [0, 1]). Empty input, any NaN or
    +inf → ``(nan, nan)``; ``-inf`` entries are zero weights but still count in ``B``.
    """
    lw = _as_log_weights(log_weights)
    if lw.numel() == 0 or bool((torch.isnan(lw) | torch.isposinf(lw)).any()):
        return math.nan, math.nan
    return ess_from_partial_sums(*ess_partial_sums(lw, float(lw.max())))


def distributed_effective_sample_size(log_weights: Tensor, group: object = None) -> tuple[float, float]:
    """``(ESS, ρ)`` over the local log weights of every rank of ``group``; identical on every rank.

    With ``torch.distributed`` initialised: one all-reduce MAX of ``[local max, any NaN/+inf]``, then (unless
    some rank had a bad weight, in which case every rank returns ``(nan, nan)`` without the second call) one
    all-reduce SUM of the shifted partial sums. A rank with no trajectories contributes max ``-inf`` and zero
    sums. ``log_weights`` must be on the device the backend communicates on (CUDA for NCCL). Without an
    initialised process group this is :func:`effective_sample_size`.
    """
    lw = _as_log_weights(log_weights)
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return effective_sample_size(lw)
    bad = torch.isnan(lw) | torch.isposinf(lw)
    local_max = float(torch.where(bad, -math.inf, lw).max()) if lw.numel() else -math.inf
    head = torch.tensor([local_max, float(bool(bad.any()))], dtype=_F64, device=lw.device)
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    if float(head[1]) > 0:
        return math.nan, math.nan
    sums = torch.stack(ess_partial_sums(lw, float(head[0])))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return ess_from_partial_sums(sums[0], sums[1], sums[2])


def lr_scale(ess_ratio: float, base_ratio: float = 1.0, rule: str = "sqrt") -> float:
    """The step's learning-rate factor: ``sqrt(min(1, ρ/ρ_base))`` | ``min(1, ρ/ρ_base)`` | 1.0 (``off``).

    A non-finite ρ gives 0.0 under every rule, ``off`` included: it means "skip the step", never "no damping".
    A negative ρ, a rule outside sqrt/linear/off or ``base_ratio ∉ (0, 1]`` raises ``ValueError``.
    """
    if rule not in ("sqrt", "linear", "off"):
        raise ValueError(f"lr_scale rule must be one of ['sqrt', 'linear', 'off'], got {rule!r}")
    if isinstance(base_ratio, bool) or not 0 < base_ratio <= 1:
        raise ValueError(f"lr_scale base_ratio must be in (0, 1], got {base_ratio!r}")
    rho = float(ess_ratio)
    if not math.isfinite(rho):
        return 0.0
    if rho < 0:
        raise ValueError(f"lr_scale ess_ratio must be >= 0, got {rho!r}")
    if rule == "off":
        return 1.0
    x = min(1.0, rho / base_ratio)
    return math.sqrt(x) if rule == "sqrt" else x
