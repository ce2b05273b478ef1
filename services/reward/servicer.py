"""The reward service's gRPC API for clients that want scoring alone: Score, ScoreBatch, ListScorers.

A request names its scorer (``scorer``, else ``task.scorer``, else the service's default). An unknown scorer
or an oversized batch is the client's mistake and answers INVALID_ARGUMENT naming it; a scorer that fails
or times out on a response is not: that response gets the fallback reward with ``failed`` and the reason,
exactly as on the streams.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.reward.loop import reward_of
from services.reward.pool import Outcome, ScoringPool
from services.reward.scorers import ScoreInput, UnknownScorerError, get_scorer, scorer_names
from vcpo.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

MAX_BATCH = 4096


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(
        self, pool: ScoringPool, default_scorer: str, record: Callable[[Outcome], None] | None = None
    ) -> None:
        self.pool, self.default_scorer, self.record = pool, default_scorer, record

    def _scored(self, outcomes: list[Outcome]) -> list[rollout_pb2.Reward]:
        if self.record:
            for outcome in outcomes:
                self.record(outcome)
        return [reward_of(o) for o in outcomes]

    def _job(self, request: reward_pb2.ScoreRequest, where: str) -> tuple[str, ScoreInput]:
        name = request.scorer or request.task.scorer or self.default_scorer
        try:
            get_scorer(name)
        except UnknownScorerError as exc:
            raise ValueError(f"{where}{exc}") from None
        task: rollout_pb2.Task = request.task
        env = request.environment_reward if request.HasField("environment_reward") else None
        item = ScoreInput(
            response=request.response_text,
            reference=task.reference,
            task_id=task.task_id,
            metadata=dict(task.metadata),
            payload_json=task.payload_json,
            environment_reward=env,
        )
        return name, item

    def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        try:
            name, item = self._job(request, "")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return reward_pb2.ScoreResponse(reward=self._scored([self.pool.score(name, item)])[0])

    def score_batch(self, request: reward_pb2.ScoreBatchRequest) -> reward_pb2.ScoreBatchResponse:
        """Score a batch (also what the Serve deployment answers); ValueError names a bad request."""
        if len(request.requests) > MAX_BATCH:
            raise ValueError(f"batch of {len(request.requests)} requests; at most {MAX_BATCH} per call")
        jobs = [self._job(r, f"request {i}: ") for i, r in enumerate(request.requests)]
        return reward_pb2.ScoreBatchResponse(rewards=self._scored(self.pool.score_many(jobs)))

    def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        try:
            return self.score_batch(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort() raises; this tells type checkers so

    def ListScorers(
        self, request: reward_pb2.ListScorersRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ListScorersResponse:
        return reward_pb2.ListScorersResponse(scorers=scorer_names())
