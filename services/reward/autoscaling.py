"""Ray Serve autoscaling of the reward replicas on the depth of the `rollouts` queue.

Ray Serve's default policy scales on requests in flight, but the reward replicas' work does not arrive as
Serve requests: each replica pulls groups from the `rollouts` stream. So every replica reports the queue's
depth (``record_autoscaling_stats``), and this policy asks for ``ceil(depth / target_queue_depth)``
replicas within the deployment's bounds; Serve's own upscale/downscale delays still apply on top.

Kept free of heavy imports: Ray pickles this module by value into its controller.
"""

from __future__ import annotations

import math
from typing import Any

QUEUE_DEPTH_METRIC = "queue_depth"


def replicas_for_depth(depth: float, target_queue_depth: int, low: int, high: int) -> int:
    """Replicas that keep about ``target_queue_depth`` unscored groups each, clamped to ``[low, high]``."""
    if target_queue_depth < 1:
        raise ValueError(f"target_queue_depth must be >= 1, got {target_queue_depth}")
    wanted = math.ceil(max(depth, 0.0) / target_queue_depth)
    return max(low, min(high, wanted))


class QueueDepthPolicy:
    """A Serve autoscaling policy (class form, so ``target_queue_depth`` arrives as a policy kwarg)."""

    def __init__(self, target_queue_depth: int = 16) -> None:
        self.target_queue_depth = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        reported = (ctx.aggregated_metrics or {}).get(QUEUE_DEPTH_METRIC, {})
        if not reported:  # no replica has reported yet: keep what we have
            return ctx.target_num_replicas, {}
        depth = max(reported.values())  # every replica sees the same stream; the newest view is the largest
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return replicas_for_depth(depth, self.target_queue_depth, low, high), {"queue_depth": depth}
