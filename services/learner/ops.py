"""What the loss (``vcpo.py``) and the objectives (``objectives/``) share: the settings' choices, per-group
reductions over a step's trajectories, the loss weight w̄, and input checks.

Pure and small on purpose: tensors in, tensors out. A check's error names the bad value and where it is.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

ISMode = Literal["truncated", "masked", "none"]
Aggregation = Literal["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"]
Weighting = Literal["paper", "exact", "released"]
LRRule = Literal["sqrt", "linear", "off"]

F64 = torch.float64


def check_choice(owner: str, name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}{name} must be one of {list(choices)}, got {value!r}")


def check_truncation(owner: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value <= 0:
        raise ValueError(f"{owner}truncation must be a number > 0 (math.inf allowed), got {value!r}")
    return float(value)


def positions(bad: Tensor, limit: int = 5) -> str:
    """``bad``'s true indices, the first ``limit`` of them, for an error message."""
    idx = bad.nonzero().tolist()
    shown = [tuple(i) if len(i) > 1 else i[0] for i in idx[:limit]]
    more = f" (first {limit} of {len(idx)})" if len(idx) > limit else ""
    return f"{shown}{more}"


def check_group_ids(group_ids: Tensor, what: str) -> None:
    dt = group_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise ValueError(f"{what} must have an integer dtype, got {dt}")


def check_finite(t: Tensor, what: str, where: Tensor | None = None) -> None:
    bad = ~torch.isfinite(t) if where is None else where & ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(f"{what} are non-finite at {positions(bad)}")


def segments(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index per trajectory (ids may be any integers) and the number of groups."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def seg_sum(x: Tensor, inv: Tensor, n: int) -> Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inv, x)


def seg_extreme(x: Tensor, inv: Tensor, n: int, reduce: str) -> Tensor:
    fill = -math.inf if reduce == "amax" else math.inf
    out = torch.full((n,), fill, dtype=x.dtype, device=x.device)
    return out.scatter_reduce_(0, inv, x, reduce, include_self=False)


def log_loss_weight(log_w: Tensor, mode: str, truncation: float) -> Tensor:
    """``log w̄``: truncated ``min(ℓ, log C)``; masked ``ℓ`` if ``ℓ ≤ log C`` else ``-inf``; none ``0``."""
    log_c = math.log(truncation)
    if mode == "truncated":
        return torch.clamp(log_w, max=log_c)
    if mode == "masked":
        return torch.where(log_w <= log_c, log_w, torch.full_like(log_w, -math.inf))
    return torch.zeros_like(log_w)
