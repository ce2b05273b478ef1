"""The learner's side of the ``scored`` stream: exactly-once consumption across crashes and restarts.

    scored stream ──XREADGROUP (consumer "learner", only as many as the step still needs)──► offer
        offer: StepAssembler (batching.py) keeps, rejects (counted by reason) or drops (counted by lag)
        every offered entry id is "consumed" by the step being assembled, in stream order
    after a checkpoint that includes them: XACK + XDEL of the consumed ids

    a checkpoint records the feed as it stood when the last step was formed: entries offered since (kept for
    the next step, or dropped/rejected while assembling it) stay pending and are offered again after a restart,
    so a stop between two steps never acknowledges a group that no step trained on
    restart: the checkpoint's FeedState says the last consumed id L and the counters up to it
        own pending entries ≤ L  → acknowledged now (the crash came between checkpoint and ack)
        own pending entries > L  → offered again, in order, before any new entry
    so the restarted learner forms exactly the steps the crashed one formed after its checkpoint.

Reads ask only for the groups the step still lacks, so no kept group ever waits past the step it was
judged for: the lag ``t − policy_version_start`` is always checked against the version ``t`` the step
trains from. Only rank 0 runs a feed; it hands each step's groups to the other ranks.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import redis

from services.common.admission import AdmissionCounter
from services.common.streams.consumer import StreamConsumer
from services.common.streams.metrics import StreamMetrics
from services.common.streams.specs import Entry, StreamSpec
from services.learner.batching import StepAssembler
from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)

CONSUMER = "learner"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class FeedState:
    """What a checkpoint records about consumption: the last consumed entry and the counters up to it."""

    last_entry_id: str = "0-0"
    consumed: int = 0
    trained_groups: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    dropped_by_lag: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "last_entry_id": self.last_entry_id,
            "consumed": self.consumed,
            "trained_groups": self.trained_groups,
            "rejected": dict(self.rejected),
            "dropped_by_lag": {str(k): v for k, v in self.dropped_by_lag.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeedState:
        return cls(
            str(data["last_entry_id"]),
            int(data["consumed"]),
            int(data["trained_groups"]),
            {str(k): int(v) for k, v in data["rejected"].items()},
            {int(k): int(v) for k, v in data["dropped_by_lag"].items()},
        )


@dataclass
class Offered:
    """One entry offered to the assembler and what became of it (for metrics and the audit log)."""

    entry_id: str
    group_id: str
    outcome: str  # "kept" | "rejected" | "dropped"
    lag: int
    reason: str = ""  # why not kept: a REJECT_REASONS entry, or "lag"
    detail: str = ""


class ScoredFeed:
    """Rank 0's reader of scored groups; see the module docstring for the exactly-once rules."""

    def __init__(
        self,
        client: redis.Redis,
        spec: StreamSpec[rollout_pb2.TrajectoryGroup],
        k: int,
        groups_per_step: int,
        max_group_size: int,
        vocab_size: int | None = None,
        metrics: StreamMetrics | None = None,
        consumer: str = CONSUMER,
        admission: AdmissionCounter | None = None,
    ) -> None:
        self.consumer = StreamConsumer(client, spec, consumer, metrics)
        self.admission = admission  # a group that will not be trained on gives its admission slot back
        self.assembler = StepAssembler(k, groups_per_step, max_group_size, vocab_size)
        self.state = FeedState()
        self._at_step = FeedState()  # the state as of the last step formed: what a checkpoint records
        self._replay: deque[Entry[rollout_pb2.TrajectoryGroup]] = deque()
        self._unacked: list[str] = []

    def resume(self, state: FeedState | None) -> int:
        """Start from a checkpoint's state (None: from scratch); returns how many entries will be replayed."""
        self.state = state or FeedState()
        self._at_step = FeedState.from_json(self.state.to_json())
        self.assembler.rejected = Counter(self.state.rejected)
        self.assembler.dropped_by_lag = Counter(self.state.dropped_by_lag)
        done = _id_key(self.state.last_entry_id)
        cursor, stale = "0", list[Entry[rollout_pb2.TrajectoryGroup]]()
        while True:
            page = self.consumer.pending(count=256, after=cursor)
            if not page:
                break
            for entry in page:
                if _id_key(entry.id) <= done:
                    stale.append(entry)
                else:
                    self._replay.append(entry)
            cursor = page[-1].id
        self.consumer.ack([e.id for e in stale])
        if stale or self._replay:
            log.info(
                "resuming after entry %s: %d pending entries already checkpointed (acknowledged now), "
                "%d to replay",
                self.state.last_entry_id,
                len(stale),
                len(self._replay),
            )
        return len(self._replay)

    def poll(
        self, version: int, block_ms: int
    ) -> tuple[list[rollout_pb2.TrajectoryGroup] | None, list[Offered]]:
        """Offer entries for the step training from ``version`` until it is complete or one blocking read
        comes back empty; returns the step's groups (or None: not complete yet) and what was offered."""
        offered: list[Offered] = []
        while not self.assembler.ready:
            need = self.assembler.groups_per_step - len(self.assembler.groups)
            replayed = bool(self._replay)  # offered before the restart: its slot was given back then
            if replayed:
                entries = [self._replay.popleft() for _ in range(min(need, len(self._replay)))]
            else:
                entries = self.consumer.read(count=need, block_ms=block_ms)
                if not entries:
                    return None, offered
            for entry in entries:
                offered.append(self._offer(entry, version))
                if offered[-1].outcome != "kept" and self.admission is not None and not replayed:
                    self.admission.release(1)
        groups = self.assembler.take()
        self.state.trained_groups += len(groups)
        self.state.rejected = dict(self.assembler.rejected)
        self.state.dropped_by_lag = dict(self.assembler.dropped_by_lag)
        self._at_step = FeedState.from_json(self.state.to_json())
        return groups, offered

    def _offer(self, entry: Entry[rollout_pb2.TrajectoryGroup], version: int) -> Offered:
        group = entry.message
        outcome = self.assembler.offer(group, version)
        self.state.last_entry_id = entry.id
        self.state.consumed += 1
        self._unacked.append(entry.id)
        lag = version - int(group.policy_version_start)
        if outcome == "rejected":
            reason, detail = self.assembler.last_rejection
            log.warning("rejected scored entry %s (%s): %s", entry.id, reason, detail)
            return Offered(entry.id, group.group_id, outcome, lag, reason, detail)
        return Offered(entry.id, group.group_id, outcome, lag, "lag" if outcome == "dropped" else "")

    def checkpointed(self) -> FeedState:
        """The state to put in a checkpoint now: as of the last step formed (call :meth:`acknowledge` once it
        is durable). Entries offered since are not in it; they are offered again after a restart."""
        return FeedState.from_json(self._at_step.to_json())

    def acknowledge(self, state: FeedState) -> int:
        """Acknowledge (and delete) every consumed entry up to ``state.last_entry_id``: a checkpoint has them."""
        done = _id_key(state.last_entry_id)
        ids = [i for i in self._unacked if _id_key(i) <= done]
        self._unacked = [i for i in self._unacked if _id_key(i) > done]
        return self.consumer.ack(ids)
