"""One evaluation round: what it asks the engine for, what comes back, and how it is scored.

A round holds the samples of the sets due at one version that one engine generates: all of them, or in a
round the sampler replicas share (shards.py) the tasks of the shards this replica took. A single-turn task's n
samples are n requests; an environment set's task is one group of n episodes run by an agent loop. Scoring
turns the responses into one :class:`TaskTally` per task with the reward service's scorers, and the tallies of
every task of a set (from one engine or from several) into its
:class:`~services.evaluator.metrics.SetResult`: the same figures however the round was split.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
    shards: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # shared: shard -> its tasks here

    @property
    def generated(self) -> bool:
        return not self.pending and not self.in_flight and not self.episodes

    def running(self) -> int:
        """Samples being generated: requests in the engine, and the n of each group of episodes under way."""
        return len(self.in_flight) + sum(e.group.n for e in self.episodes.values())

    def outstanding(self) -> int:
        """Samples not generated yet (an episode group counts its n)."""
        return sum(x.group.n if isinstance(x, TaskEpisodes) else 1 for x in self.pending) + self.running()


@dataclass
class TaskTally:
    """One task's scored samples: what a round's accuracy is computed from, whichever engine generated them."""

    rewards: list[float]  # one per sample, in sample order
    failed_scores: int = 0  # samples whose scorer failed (scored as failures)
    tokens: int = 0  # tokens its samples generated
    env_failed: bool = False  # its environment failed: every sample scored 0, counted as failed episodes


def tally_round(
    r: EvalRound, sets: Sequence[EvalSet], score_many: ScoreMany, decode: Callable[[list[int]], str]
) -> dict[tuple[int, int], TaskTally]:
    """Score the generated round ``r`` (``sets``: the evaluator's, which ``r`` indexes): one tally per task
    it generated. A task whose environment failed is not scored: its samples count 0 and as failed episodes."""
    jobs: list[tuple[str, ScoreInput]] = []
    keys: list[Key] = []
    tallies: dict[tuple[int, int], TaskTally] = {}
    for key, response in sorted(r.responses.items()):
        s = sets[key[0]]
        tally = tallies.setdefault(key[:2], TaskTally([0.0] * s.n, env_failed=key[:2] in r.failed))
        tally.tokens += len(response.tokens)
        if tally.env_failed:
            continue
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
    for task_key in r.failed:  # a failed environment task may have produced no response at all
        tallies.setdefault(task_key, TaskTally([0.0] * sets[task_key[0]].n, env_failed=True))
    outcomes = score_many(jobs) if jobs else []
    for key, outcome in zip(keys, outcomes, strict=True):
        tally = tallies[key[:2]]
        tally.rewards[key[2]] = outcome.value
        tally.failed_scores += outcome.failed
    return tallies


def set_results(
    tallies: Mapping[tuple[int, int], TaskTally],
    sets: Sequence[EvalSet],
    chosen: Sequence[int],
    version: int,
    seconds: float,
) -> list[SetResult]:
    """One result per set of ``chosen`` (indices into ``sets``) from its tasks' tallies, however many engines
    generated them: a task with no tally (none can be missing from a whole round) counts 0."""
    results = []
    for si in chosen:
        s = sets[si]
        rewards: list[list[float]] = [[0.0] * s.n for _ in s.tasks]
        failed = tokens = failed_tasks = 0
        for (tsi, ti), tally in tallies.items():
            if tsi != si:
                continue
            rewards[ti] = list(tally.rewards)
            failed += tally.failed_scores
            tokens += tally.tokens
            failed_tasks += tally.env_failed
        mean_at_n, pass_at_n, reward_mean = accuracy(rewards, s.correct_at)
        results.append(
            SetResult(
                s.name,
                version,
                s.n,
                len(s.tasks),
                mean_at_n,
                pass_at_n,
                reward_mean,
                failed,
                seconds,
                tokens,
                rewards,
                s.n * failed_tasks,
            )
        )
    return results


def score_round(
    r: EvalRound, sets: Sequence[EvalSet], score_many: ScoreMany, decode: Callable[[list[int]], str]
) -> list[SetResult]:
    """One result per set of the generated round ``r`` (``sets``: the evaluator's, which ``r`` indexes), all
    of whose tasks it generated."""
    tallies = tally_round(r, sets, score_many, decode)
    return set_results(tallies, sets, r.sets, r.version, time.monotonic() - r.started)
