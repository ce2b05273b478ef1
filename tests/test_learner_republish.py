"""Learner rank 0 republishes through the broker only when the broker lost versions it was given: not because
the weight group carried newer ones the broker never had (under NCCL a broker without a GPU is no member).
Unit tests of LearnerRank's decision and its publish path, with the transports stubbed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.learner import service
from services.learner.service import LearnerRank


class Broker:
    def __init__(self, latest: int | None) -> None:
        self.latest_version: int | None = latest
        self.where = "broker"

    def latest(self) -> int | None:
        if self.latest_version == -1:
            raise ConnectionError("broker unreachable")
        return self.latest_version


def rank0(latest: int | None, given: int, version: int) -> Any:
    rank = LearnerRank.__new__(LearnerRank)
    rank.transport = Broker(latest)  # type: ignore[assignment]
    rank.trainer = SimpleNamespace(version=version, module=None)  # type: ignore[assignment]
    rank._given_broker, rank._broker_checked = given, 0.0
    return rank


@pytest.mark.parametrize(
    ("latest", "given", "version", "lost"),
    [
        (0, 0, 12, False),  # versions 1..12 went through the group only: the broker never had them
        (12, 12, 12, False),
        (None, 0, 12, True),  # restarted with memory storage: it holds nothing
        (3, 5, 9, True),  # holds less than the learner gave it
        (-1, 5, 9, False),  # no answer: no verdict (its clients retry)
    ],
)
def test_republish_only_when_the_broker_lost_what_it_was_given(
    latest: int | None, given: int, version: int, lost: bool
) -> None:
    assert rank0(latest, given, version)._broker_lost_version(every_s=10.0) is lost


def test_the_broker_is_asked_at_most_every_interval() -> None:
    rank = rank0(None, 0, 4)
    assert rank._broker_lost_version(every_s=10.0)
    assert not rank._broker_lost_version(every_s=10.0)  # asked a moment ago


def test_a_republish_goes_through_the_broker_and_counts_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(service, "publish_collective", lambda *a, **k: calls.append("collective"))
    monkeypatch.setattr(service, "publish_version", lambda *a, **k: calls.append("broker"))
    rank = rank0(0, 0, 7)
    rank.collective, rank._superseded, rank.rank = True, -1, 0
    rank.coordinator = SimpleNamespace(  # type: ignore[assignment]
        publisher=lambda ready=False: object(), members=frozenset({"sampler-0.a"})
    )
    rank.learner = SimpleNamespace(publish_bucket_mb=1)  # type: ignore[assignment]
    rank.cfg = SimpleNamespace(weight_broker=SimpleNamespace(publish_retry_s=1.0))  # type: ignore[assignment]
    rank.clock, rank.metrics = None, None
    assert rank._publish()[1] == "collective" and rank._given_broker == 0
    assert rank._carried_to == {"sampler-0.a"}  # the members that hold version 7 now
    assert rank._publish(via_broker=True)[1] == "broker" and rank._given_broker == 7
    assert calls == ["collective", "broker"]


def test_a_sampler_that_joined_after_the_current_version_went_into_the_group_gets_it_through_the_broker(
    redis_client: Any,
) -> None:
    """Under NCCL a broker without a GPU is not in the weight group: it holds only what went through its own
    path (version 3 here), not version 7, which the group carried. A sampler that starts or restarts catches up
    from the broker to version 3, whose groups the feed drops as too old; with no other sampler serving version
    7 (one sampler, or every one restarted) no step comes to publish version 8, and the run waited for good.
    While it waits for groups, learner rank 0 sees a receiver the current version did not reach and republishes
    it through the broker, once; not while every receiver holds it, nor where the broker holds it."""
    import time

    from services.weight_transport.group_control import GroupCoordinator
    from services.weight_transport.seats import GroupRegistry, Member

    registry = GroupRegistry(redis_client, f"joiner-{time.monotonic_ns()}", ttl_s=10.0)
    rank = rank0(3, 3, 7)
    rank.coordinator = GroupCoordinator(registry, "127.0.0.1", "nccl")
    rank._carried_to, rank._joiners_checked = frozenset({"sampler-0.a"}), 0.0
    registry.heartbeat(Member("sampler-0.a", devices="cuda"))  # holds version 7
    registry.heartbeat(Member("broker.x", kind="broker", devices="cpu"))  # no GPU: never in the NCCL group
    try:
        assert not rank._joiner_behind(every_s=0.0)
        registry.heartbeat(Member("sampler-1.b", devices="cuda"))  # a sampler restarted: a new member
        assert rank._joiner_behind(every_s=0.0)
        assert not rank._joiner_behind(every_s=60.0)  # looked a moment ago
        rank.transport.latest_version = 7  # the broker holds it (a catch-up republished it)
        assert not rank._joiner_behind(every_s=0.0)
        rank.transport.latest_version, rank._given_broker = 3, 7  # what the republish does
        assert not rank._joiner_behind(every_s=0.0)
        rank._given_broker = 3
        rank.transport.latest_version = -1  # the broker does not answer: asked again later
        assert not rank._joiner_behind(every_s=0.0)
    finally:
        rank.coordinator.close()


def test_a_version_rank_0_could_not_stage_goes_through_the_broker_and_the_group_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's own error before it announced anything (no host memory for the staging copy) left the weight
    group untouched, yet was counted as a failed broadcast: the healthy group was dropped, and formed again
    only a heartbeat lifetime later. The version goes through the broker, and the group stays."""
    from torch import nn

    from services.learner.publish import VersionNotSent

    class NoRoom:
        def send_background(self, version: int, specs: Any, tensors: Any) -> float:
            raise OSError(12, "Cannot allocate memory")

    with pytest.raises(VersionNotSent, match=r"version 7: .*Cannot allocate memory"):
        service.publish_collective(nn.Linear(4, 4), NoRoom(), 7, 0, background=True)  # type: ignore[arg-type]

    def cannot_stage(*a: Any, **k: Any) -> None:
        raise VersionNotSent("version 7: [Errno 12] Cannot allocate memory")

    calls: list[str] = []
    monkeypatch.setattr(service, "publish_collective", cannot_stage)
    monkeypatch.setattr(service, "publish_version", lambda *a, **k: calls.append("broker"))
    failed: list[BaseException] = []
    rank = rank0(0, 0, 7)
    rank.collective, rank._superseded, rank.rank = True, -1, 0
    rank.coordinator = SimpleNamespace(  # type: ignore[assignment]
        publisher=lambda ready=False: object(),
        members=frozenset({"sampler-0.a"}),
        failed=failed.append,
    )
    rank.learner = SimpleNamespace(publish_bucket_mb=1)  # type: ignore[assignment]
    rank.cfg = SimpleNamespace(weight_broker=SimpleNamespace(publish_retry_s=1.0))  # type: ignore[assignment]
    rank.clock, rank.metrics = None, None
    assert rank._publish()[1] == "broker" and calls == ["broker"] and rank._given_broker == 7
    assert failed == []  # not a failed broadcast: the group is not dropped
