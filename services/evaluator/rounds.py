"""One evaluation round: what it asks the engine for, what comes back, and how it is scored.

A round holds every sample of the sets due at one version. A single-turn task's n samples are n requests;
an environment set's task is one group of n episodes run by an agent loop. Scoring turns the responses into
one :class:`~services.evaluator.metrics.SetResult` per set with the reward service's scorers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.evaluator.metrics import SetResult, accuracy
from services.evaluator.sets import EvalSet
from services.reward.pool import Outcome
from services.reward.scorers import ScoreInput
from services.sampler.engine import Sampling
from services.sampler.groups import Group
from services.sampler.groups import Response as EpisodeResponse

ScoreMany = Callable[[Sequence[tuple[str, ScoreInput]]], list[Outcome]]
Key = tuple[int, int, int]  # (set index, task index, sample index)


@dataclass
class Response:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class SampleRequest:
    """One sample of a single-turn task: one engine request."""

    request_id: str
    key: Key
    prompt: list[int]
    sampling: Sampling


@dataclass
class TaskEpisodes:
    """One task of an environment set: its n samples as one group of episodes, run by the agent loop."""

    key: tuple[int, int]  # (set index, task index)
    group: Group


@dataclass
class EvalRound:
    version: int
    pending: deque[SampleRequest | TaskEpisodes]
    sets: list[int]  # indices of the evaluator's sets in this round
    started: float = field(default_factory=time.monotonic)
    in_flight: dict[str, SampleRequest] = field(default_factory=dict)
    episodes: dict[str, TaskEpisodes] = field(default_factory=dict)  # group id -> a task's episodes under way
    responses: dict[Key, Response | EpisodeResponse] = field(default_factory=dict)
    failed: dict[tuple[int, int], str] = field(default_factory=dict)  # tasks whose environment failed: why

    @property
    def generated(self) -> bool:
        return not self.pending and not self.in_flight and not self.episodes

    def running(self) -> int:
        """Samples being generated: requests in the engine, and the n of each group of episodes under way."""
        return len(self.in_flight) + sum(e.group.n for e in self.episodes.values())

    def outstanding(self) -> int:
        """Samples not generated yet (an episode group counts its n)."""
        return sum(x.group.n if isinstance(x, TaskEpisodes) else 1 for x in self.pending) + self.running()


def score_round(
    r: EvalRound, sets: Sequence[EvalSet], score_many: ScoreMany, decode: Callable[[list[int]], str]
) -> list[SetResult]:
    """One result per set of the generated round ``r`` (``sets``: the evaluator's, which ``r`` indexes). A
    task whose environment failed is not scored: its samples count 0 and as failed episodes."""
    jobs: list[tuple[str, ScoreInput]] = []
    keys: list[Key] = []
    for key, response in sorted(r.responses.items()):
        if key[:2] in r.failed:  # its environment failed: scored 0, counted
            continue
        s = sets[key[0]]
        task = s.tasks[key[1]]
        env_reward = response.environment_reward if isinstance(response, EpisodeResponse) else None
        item = ScoreInput(
            response=decode(response.tokens),
            reference=task.reference,
            task_id=task.task_id,
            metadata=dict(task.metadata),
            payload_json=task.payload_json,
            environment_reward=env_reward,
        )
        jobs.append((s.scorer_of(task, env_reward), item))
        keys.append(key)
    outcomes = score_many(jobs) if jobs else []
    seconds = time.monotonic() - r.started
    results = []
    for si in r.sets:
        s = sets[si]
        rewards: list[list[float]] = [[0.0] * s.n for _ in s.tasks]
        failed = 0
        for key, outcome in zip(keys, outcomes, strict=True):
            if key[0] == si:
                rewards[key[1]][key[2]] = outcome.value
                failed += outcome.failed
        mean_at_n, pass_at_n, reward_mean = accuracy(rewards, s.correct_at)
        tokens = sum(len(v.tokens) for k, v in r.responses.items() if k[0] == si)
        failed_episodes = s.n * sum(1 for key in r.failed if key[0] == si)
        results.append(
            SetResult(
                s.name,
                r.version,
                s.n,
                len(s.tasks),
                mean_at_n,
                pass_at_n,
                reward_mean,
                failed,
                seconds,
                tokens,
                rewards,
                failed_episodes,
            )
        )
    return results
