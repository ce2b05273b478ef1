"""When the sampler loop starts a group: while its requests in flight leave room for ``n`` more (the engine's
cap), and only where the lag bound admits it (the run's counter, real Redis). The engine is a stand-in that
batches as vLLM does (benchmarks/_sampler_admission.py): the logic under test is the loop's admission."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from benchmarks._sampler_admission import BatchingEngine, FixedVersion, long_tailed, stand_in_sampler
from services.sampler.config import SamplerConfig
from services.sampler.sampler import Sampler
from vcpo.v1 import common_pb2


def lengths(script: dict[tuple[int, int], int], default: int = 50) -> Any:
    """Response lengths by (group number from 1, response index); ``default`` for the rest."""

    def length(request_id: str) -> int:
        group, index = request_id.rsplit("-", 1)[1].split("/")
        return script.get((int(group), int(index)), default)

    return length


def started(engine: BatchingEngine) -> list[str]:
    """Groups the engine was given requests of, in order."""
    return list(dict.fromkeys(r.rsplit("/", 1)[0] for r in engine.added))


def test_the_cap_counts_requests_and_defaults_to_the_engines_batch_limit(redis_client: redis.Redis) -> None:
    engine = BatchingEngine(batch_limit=1000, length=lengths({}))
    sampler = stand_in_sampler(engine, redis_client, n=4, max_tokens=64, max_requests_in_flight=10)
    sampler.tick()
    assert len(sampler.groups) == 2 and len(engine.added) == 8  # a third group's 4 would make 12 > 10
    assert sampler.requests_in_flight() == 8 and sampler.status.figures["requests_in_flight"] == 8
    for _ in range(5):
        sampler.tick()
    assert len(engine.added) == 8  # nothing has finished: no seat is free

    engine = BatchingEngine(batch_limit=12, length=lengths({}))
    sampler = stand_in_sampler(engine, redis_client, n=4, max_tokens=64, run_id="default-cap")
    sampler.tick()
    assert sampler.max_requests_in_flight == 12 and len(sampler.groups) == 3  # vLLM's max_num_seqs


def test_a_cap_no_group_fits_is_refused_naming_the_key(redis_client: redis.Redis) -> None:
    engine = BatchingEngine(batch_limit=6, length=lengths({}))
    with pytest.raises(ValueError, match=r"the engine's batch limit is 6, below sampler\.n = 8.*sampler\."):
        stand_in_sampler(engine, redis_client, n=8, max_tokens=64)
    with pytest.raises(ValueError, match=r"sampler\.max_requests_in_flight is 4, below sampler\.n = 8"):
        stand_in_sampler(engine, redis_client, n=8, max_tokens=64, max_requests_in_flight=4)
    engine.batch_limit = None
    with pytest.raises(ValueError, match=r"states no batch limit: set sampler\.max_requests_in_flight"):
        stand_in_sampler(engine, redis_client, n=8, max_tokens=64)
    with pytest.raises(ValueError, match=r"max_requests_in_flight = 4 is below sampler\.n = 8"):
        SamplerConfig(n=8, max_requests_in_flight=4)
    with pytest.raises(
        ValueError, match=r"max_groups_in_flight was replaced by sampler\.max_requests_in_flight"
    ):
        SamplerConfig.model_validate({"max_groups_in_flight": 16})
    assert SamplerConfig().max_requests_in_flight == 0  # the engine's batch limit


def test_each_finished_response_frees_its_seat_before_its_group_ends(redis_client: redis.Redis) -> None:
    """Two groups of 4 fill a cap of 10 but for 2 seats; two responses of the first end after one token: a
    third group starts while the first's other two run on (whole-group slots would have waited for them)."""
    engine = BatchingEngine(batch_limit=1000, length=lengths({(1, 0): 1, (1, 1): 1}))
    sampler = stand_in_sampler(engine, redis_client, n=4, max_tokens=64, max_requests_in_flight=10)
    sampler.tick()  # admits groups 1 and 2, then one step: two of group 1's responses end
    first = started(engine)[0]
    assert sampler.groups[first].unfinished == 2 and sampler.requests_in_flight() == 6
    sampler.tick()
    assert len(started(engine)) == 3 and first in sampler.groups  # group 1 is still in flight
    assert sampler.requests_in_flight() == 10


def test_requests_in_flight_stay_within_the_cap_and_keep_the_engine_full(redis_client: redis.Redis) -> None:
    """Long-tailed lengths, many ticks: the requests in flight never exceed the cap, and the batch the engine
    runs stays close to it once the first set has turned over."""
    cap, n, max_tokens = 64, 8, 64
    engine = BatchingEngine(batch_limit=cap, length=long_tailed(max_tokens, seed=1))
    sampler = stand_in_sampler(engine, redis_client, n=n, max_tokens=max_tokens)
    for _ in range(6 * max_tokens):
        sampler.tick()
        assert sampler.requests_in_flight() <= cap
        assert len(engine.running) + len(engine.waiting) == sampler.requests_in_flight()
    sampler.shutdown()
    steady = engine.running_per_step[max_tokens:]
    assert sum(steady) / len(steady) >= 0.9 * cap
    assert sampler.emitted > 0 and all(lag == 0 for lag in sampler.lags)


class Recording:
    """The admission counter, with every decision it gave recorded."""

    def __init__(self, counter: Any) -> None:
        self.counter, self.decisions = counter, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.counter, name)

    def try_admit(self, policy_version: int, n: int = 1, holder: str = "") -> Any:
        decision = self.counter.try_admit(policy_version, n, holder)
        self.decisions.append((holder, policy_version, decision.admitted))
        return decision


def test_the_lag_bound_still_gates_every_group_whatever_the_engine_has_room_for(
    redis_client: redis.Redis,
) -> None:
    """Two replicas share the run's counter (k = 1, 2 groups per step) with room for many groups each and
    responses that end unevenly: at version v no more than (v + k + 1) x 2 groups start in all, every group
    started passed the counter at the version it was started with, a refused replica waits, and a group that
    became too old for any step is given up, never written."""
    k, per_step, n = 1, 2, 4
    replicas: list[tuple[Sampler, BatchingEngine, Recording]] = []
    for i in range(2):
        engine = BatchingEngine(batch_limit=64, length=long_tailed(16, seed=i))
        sampler = stand_in_sampler(
            engine,
            redis_client,
            n=n,
            max_tokens=16,
            k=k,
            groups_per_step=per_step,
            run_id="lag",
            replica_id=f"sampler-{i}",
            sync=FixedVersion(0),
        )
        sampler.admission = Recording(sampler.admission)  # type: ignore[assignment]
        replicas.append((sampler, engine, sampler.admission))  # type: ignore[arg-type]
    counter = replicas[0][2].counter

    def run(ticks: int) -> None:
        for _ in range(ticks):
            for sampler, _, _ in replicas:
                sampler.tick()
                assert counter.started() <= counter.bound(sampler.engine.loaded_version or 0)

    for version in range(3):
        for sampler, engine, _ in replicas:
            engine.loaded_version = version
            sampler.sync.newest_known = version  # type: ignore[attr-defined]
        run(40)
        assert counter.started() == (version + k + 1) * per_step  # the bound, not the cap, stopped them
        assert all(s.status.state == common_pb2.ServiceStatus.WAITING for s, _, _ in replicas)

    for sampler, engine, recording in replicas:
        admitted = [(v, ok) for holder, v, ok in recording.decisions if ok]
        assert len(admitted) == len(started(engine))  # every group started was admitted by the counter
        assert sum(len(g.trajectories) for g in sampler.rollouts.groups) == n * sampler.emitted  # type: ignore[attr-defined]
        assert all(lag <= k for lag in sampler.lags)

    # a newer version published while groups of version 2 run: those that cannot finish within the bound go
    engine = BatchingEngine(batch_limit=64, length=lengths({}, default=1000))
    sampler = stand_in_sampler(engine, redis_client, n=n, max_tokens=2000, k=k, run_id="stale")
    sampler.tick()
    in_flight = len(sampler.groups)
    sampler.sync.newest_known = k + 1  # type: ignore[attr-defined]
    sampler.tick()
    assert not sampler.groups and sampler.aborted == {"lag": in_flight} and sampler.emitted == 0
    assert sampler.requests_in_flight() == 0 and not engine.running and not engine.waiting
    assert sampler.feed.retried == in_flight  # type: ignore[attr-defined]  (their tasks are tried again)
