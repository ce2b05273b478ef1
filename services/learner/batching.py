"""From scored groups on the stream to a step's tensors: validation, the lag bound, ranks, padding.

    scored entry ─► check_group ─► bad: rejected, counted by reason (the entry is acknowledged, never trained on)
                                 ─► lag t − policy_version_start > k: dropped, counted by lag
                                 ─► kept ─► StepAssembler (until groups_per_step) ─► place_groups (whole groups,
                                            balanced by tokens) ─► to_tensors per rank ─► the step

Row layout of :class:`TrajectoryTensors`: one row per trajectory, ``prompt_tokens + response_tokens``,
right-padded to the rank's longest row, in group order. Column ``c`` of ``behaviour_logprobs`` is the
sampler's log-prob of the token at column ``c`` (so response token ``j`` sits at column
``len(prompt) + j``), ``response_mask`` marks the generated tokens the loss uses (tool output is masked out),
and ``group_ids`` number the step's groups. The rank's width is only the container's: the step sorts the
rows by length and runs each micro-batch at its own longest row (``step.plan_step``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.learner.step import TrajectoryTensors
from vcpo.v1 import rollout_pb2

REJECT_REASONS = (
    "empty_group",
    "group_too_large",
    "empty_prompt",
    "length_mismatch",
    "missing_logprobs",
    "nonfinite_logprobs",
    "missing_reward",
    "nonfinite_reward",
    "bad_versions",
    "token_out_of_range",
)


def check_group(
    group: rollout_pb2.TrajectoryGroup, max_group_size: int, vocab_size: int | None = None
) -> tuple[str, str] | None:
    """``(reason, detail)`` if the group must not be trained on, else None. ``reason`` is one of REJECT_REASONS.

    With ``vocab_size``, token ids outside ``[0, vocab_size)`` (another tokenizer's output) are rejected too.
    """
    n = len(group.trajectories)
    if n == 0:
        return "empty_group", f"group {group.group_id!r} has no trajectories"
    if n > max_group_size:
        return (
            "group_too_large",
            f"group {group.group_id!r} has {n} trajectories, at most {max_group_size} allowed",
        )
    if not group.prompt_tokens:
        return "empty_prompt", f"group {group.group_id!r} has no prompt tokens"
    if vocab_size is not None:
        sources = [("prompt", group.prompt_tokens)]
        sources += [(f"trajectory {i}", t.response_tokens) for i, t in enumerate(group.trajectories)]
        for source, ids in sources:
            bad = next((tok for tok in ids if tok >= vocab_size), None)
            if bad is not None:
                return (
                    "token_out_of_range",
                    f"group {group.group_id!r}, {source}: token id {bad} outside the model's vocabulary "
                    f"of {vocab_size}",
                )
    for i, t in enumerate(group.trajectories):
        where = f"group {group.group_id!r}, trajectory {i}"
        tokens, logprobs, mask = len(t.response_tokens), len(t.behaviour_logprobs), len(t.loss_mask)
        if logprobs == 0 and tokens > 0:
            return "missing_logprobs", f"{where}: {tokens} response tokens and no behaviour log-probs"
        if not tokens == logprobs == mask:
            return "length_mismatch", f"{where}: {tokens} tokens, {logprobs} log-probs, {mask} mask entries"
        if any(not math.isfinite(lp) for lp, m in zip(t.behaviour_logprobs, t.loss_mask, strict=True) if m):
            return "nonfinite_logprobs", f"{where}: a behaviour log-prob on a trained token is not finite"
        if not t.HasField("reward"):
            return "missing_reward", f"{where}: no reward (not scored)"
        if not math.isfinite(t.reward.value):
            return "nonfinite_reward", f"{where}: reward {t.reward.value}"
        if t.policy_version_end < t.policy_version_start:
            return (
                "bad_versions",
                f"{where}: policy_version_end {t.policy_version_end} < start {t.policy_version_start}",
            )
    return None


def group_lag(group: rollout_pb2.TrajectoryGroup, version: int) -> int:
    """Lag when consumed by the step that produces ``version + 1``: ``version − policy_version_start``."""
    return version - int(group.policy_version_start)


@dataclass
class StepAssembler:
    """Collects valid groups no older than the lag bound until a step's worth is ready; counts the rest."""

    k: int
    groups_per_step: int
    max_group_size: int
    vocab_size: int | None = None
    groups: list[rollout_pb2.TrajectoryGroup] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    dropped_by_lag: Counter[int] = field(default_factory=Counter)
    last_rejection: tuple[str, str] = ("", "")  # (reason, detail) of the last rejected group

    def offer(self, group: rollout_pb2.TrajectoryGroup, version: int) -> str:
        """Take one scored group for the step producing ``version + 1``: "kept", "rejected" or "dropped"."""
        problem = check_group(group, self.max_group_size, self.vocab_size)
        if problem is not None:
            self.rejected[problem[0]] += 1
            self.last_rejection = problem
            return "rejected"
        lag = group_lag(group, version)
        if lag > self.k or lag < 0:  # too old, or from a version that does not exist yet
            self.dropped_by_lag[lag] += 1
            return "dropped"
        self.groups.append(group)
        return "kept"

    @property
    def ready(self) -> bool:
        return len(self.groups) >= self.groups_per_step

    def take(self) -> list[rollout_pb2.TrajectoryGroup]:
        """The oldest ``groups_per_step`` kept groups (the rest wait for the next step)."""
        step, self.groups = self.groups[: self.groups_per_step], self.groups[self.groups_per_step :]
        return step


def _tokens(group: rollout_pb2.TrajectoryGroup) -> int:
    return sum(len(group.prompt_tokens) + len(t.response_tokens) for t in group.trajectories)


def place_groups(groups: Sequence[rollout_pb2.TrajectoryGroup], world_size: int) -> list[list[int]]:
    """Indices of the groups each rank trains on: whole groups (OPOB needs a group on one rank), largest
    first onto the least loaded rank, so ranks get similar token counts."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(groups)), key=lambda i: -_tokens(groups[i])):
        r = min(range(world_size), key=lambda r: (load[r], len(ranks[r])))
        ranks[r].append(i)
        load[r] += _tokens(groups[i])
    return [sorted(r) for r in ranks]


def to_tensors(groups: Sequence[rollout_pb2.TrajectoryGroup], pad_token_id: int = 0) -> TrajectoryTensors:
    """The groups' trajectories as right-padded rows (see the module docstring for the layout)."""
    rows = [(g, t, gi) for gi, g in enumerate(groups) for t in g.trajectories]
    if not rows:
        raise ValueError("no trajectories to train on")
    width = max(len(g.prompt_tokens) + len(t.response_tokens) for g, t, _ in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    response = torch.zeros((b, width), dtype=torch.long)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    rewards = torch.empty(b, dtype=torch.float32)
    group_ids = torch.empty(b, dtype=torch.long)
    for r, (g, t, gi) in enumerate(rows):
        p, n = len(g.prompt_tokens), len(t.response_tokens)
        input_ids[r, :p] = torch.tensor(list(g.prompt_tokens), dtype=torch.long)
        if n:
            input_ids[r, p : p + n] = torch.tensor(list(t.response_tokens), dtype=torch.long)
            response[r, p : p + n] = torch.tensor(list(t.loss_mask), dtype=torch.long)
            behaviour[r, p : p + n] = torch.tensor(list(t.behaviour_logprobs), dtype=torch.float32)
        attention[r, : p + n] = 1
        rewards[r] = t.reward.value
        group_ids[r] = gi
    return TrajectoryTensors(input_ids, attention, response, behaviour, rewards, group_ids)
