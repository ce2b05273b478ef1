"""Rollout groups being generated: the ``n`` responses of one prompt, token by token, with their versions.

A group is admitted with the sampler's loaded version (``policy_version_start`` of every response). Each
response keeps its tokens, their behaviour log-probs and, when weights change while it is being generated,
a version segment starting at the first token the new version produced; its ``policy_version_end`` is the
version of its last token. A finished group becomes one ``TrajectoryGroup`` for the `rollouts` stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.sampler.engine import Sampling, TokenDelta
from vcpo.v1 import common_pb2, rollout_pb2


@dataclass
class Response:
    """One response of a group, as generated so far."""

    version_start: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)  # (start_token, policy_version)
    finish_reason: str | None = None
    detokenized: bool = True  # False: the engine gave no text; decode the tokens when the response is done

    def __post_init__(self) -> None:
        if not self.segments:
            self.segments.append((0, self.version_start))

    @property
    def version_end(self) -> int:
        return self.segments[-1][1]

    def extend(self, delta: TokenDelta, version: int) -> None:
        if len(delta.token_ids) != len(delta.logprobs):
            raise ValueError(
                f"request {delta.request_id}: {len(delta.token_ids)} tokens but {len(delta.logprobs)} log-probs"
            )
        if delta.token_ids and version != self.segments[-1][1]:
            if len(self.tokens) == self.segments[-1][0]:  # no token came from the previous version
                self.segments[-1] = (len(self.tokens), version)
            else:
                self.segments.append((len(self.tokens), version))
        self.tokens += delta.token_ids
        self.logprobs += delta.logprobs
        self.text.append(delta.text)
        self.detokenized &= delta.detokenized
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def to_proto(self, decode: Callable[[list[int]], str]) -> rollout_pb2.Trajectory:
        return rollout_pb2.Trajectory(
            response_tokens=self.tokens,
            behaviour_logprobs=self.logprobs,
            loss_mask=[True] * len(self.tokens),
            text="".join(self.text) if self.detokenized else decode(self.tokens),
            finish_reason=self.finish_reason or "",
            policy_version_start=self.segments[0][1],
            policy_version_end=self.version_end,
            version_segments=[
                rollout_pb2.VersionSegment(start_token=s, policy_version=v) for s, v in self.segments
            ],
            num_turns=1,
        )


@dataclass
class Group:
    """A prompt's ``n`` responses in flight; ``source`` is whatever the task feed needs to settle the task."""

    group_id: str
    task: rollout_pb2.Task
    prompt_tokens: list[int]
    version: int  # the loaded version when the group was admitted
    sampling: Sampling
    n: int
    source: Any = None
    started_unix: float = field(default_factory=time.time)
    responses: dict[str, Response] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.responses:
            self.responses = {f"{self.group_id}/{i}": Response(self.version) for i in range(self.n)}

    @property
    def request_ids(self) -> list[str]:
        return list(self.responses)

    @property
    def finished(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses.values())

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.responses.values())

    def to_proto(
        self, run_id: str, sampler_id: str, decode: Callable[[list[int]], str]
    ) -> rollout_pb2.TrajectoryGroup:
        trajectories = [r.to_proto(decode) for r in self.responses.values()]
        s = self.sampling
        return rollout_pb2.TrajectoryGroup(
            group_id=self.group_id,
            run_id=run_id,
            task=self.task,
            prompt_tokens=self.prompt_tokens,
            trajectories=trajectories,
            policy_version_start=min(t.policy_version_start for t in trajectories),
            policy_version_end=max(t.policy_version_end for t in trajectories),
            sampling=common_pb2.SamplingParams(
                n=self.n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=s.max_tokens,
                stop=list(s.stop),
                seed=s.seed or 0,
            ),
            sampler_id=sampler_id,
            started_unix=self.started_unix,
            finished_unix=time.time(),
        )
