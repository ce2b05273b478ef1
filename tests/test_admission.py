"""The admission counter: the lag bound holds under concurrent samplers hammering one Redis."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import redis

from services.common.admission import AdmissionCounter

K, GPS = 2, 4


def _hammer(url: str, version: int, attempts: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    counter = AdmissionCounter(redis.Redis.from_url(url), "hammer", K, GPS)
    admitted = 0
    for _ in range(attempts):
        result = counter.try_admit(version)
        if result.admitted:
            admitted += 1
            assert result.started <= result.bound, result
    out.put(admitted)


def test_eight_clients_never_admit_beyond_the_bound(redis_url: str) -> None:
    version = 3
    bound = (version + K + 1) * GPS
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(redis_url, version, 200, out)) for _ in range(8)]
    for p in procs:
        p.start()
    totals = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(totals) == bound  # exactly the bound: none lost, none beyond
    assert AdmissionCounter(redis.Redis.from_url(redis_url), "hammer", K, GPS).started() == bound


def _advance_and_admit(url: str, worker: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Samplers with different loaded versions racing; each records the bound it was admitted under."""
    client = redis.Redis.from_url(url)
    counter = AdmissionCounter(client, "race", K, GPS)
    log = []
    for attempt in range(300):
        version = min(int(client.get("vcpo:race:test:version") or 0), 50)
        if worker == 0 and attempt % 10 == 0:
            client.incr("vcpo:race:test:version")  # a "learner" publishing versions meanwhile
        result = counter.try_admit(version)
        if result.admitted:
            log.append((result.started, version))
    out.put(log)


def test_concurrent_versions_admit_only_under_their_own_bound(redis_url: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_advance_and_admit, args=(redis_url, w, out)) for w in range(8)]
    for p in procs:
        p.start()
    logs = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    admitted = [entry for log in logs for entry in log]
    slots = sorted(started for started, _ in admitted)
    assert slots == list(range(1, len(slots) + 1))  # every admission got its own slot number
    for started, version in admitted:  # the group in slot `started` was started by weights `version`
        assert started <= (version + K + 1) * GPS


def test_k_zero_is_synchronous(redis_client: redis.Redis) -> None:
    counter = AdmissionCounter(redis_client, "sync", 0, GPS)
    assert all(counter.try_admit(0).admitted for _ in range(GPS))  # the groups of step 0
    refused = counter.try_admit(0)
    assert not refused.admitted and refused.started == GPS and refused.bound == GPS
    assert "lag bound reached" in refused.reason
    assert counter.try_admit(1).admitted  # after version 1 is loaded: the groups of step 1


def test_batch_admission_is_all_or_nothing_and_release_gives_slots_back(redis_client: redis.Redis) -> None:
    counter = AdmissionCounter(redis_client, "batch", 1, 4)  # bound at v=0: 8
    assert counter.try_admit(0, n=6).admitted
    assert not counter.try_admit(0, n=3).admitted  # 9 > 8: none admitted
    assert counter.started() == 6
    assert counter.release(2) == 4  # two aborted groups given back
    assert counter.try_admit(0, n=4).admitted and counter.started() == 8
    assert counter.release(100) == 0  # never below zero


def test_slots_a_dead_holder_held_are_reclaimed_once(redis_client: redis.Redis) -> None:
    counter = AdmissionCounter(redis_client, "holders", 0, 4)  # bound at v=0: 4, k = 0 (a lost slot stalls)
    for _ in range(3):
        assert counter.try_admit(0, holder="sampler-0").admitted
    assert counter.try_admit(0, holder="sampler-1").admitted
    counter.settle("sampler-0")  # one group of sampler-0 written: it keeps its slot
    assert counter.release(1, holder="sampler-0") == 3  # one given up
    assert counter.held() == {"sampler-0": 1, "sampler-1": 1} and counter.started() == 3
    # sampler-0 is killed with one group in flight; its restart gives that slot back, and only that one
    assert counter.reclaim("sampler-0") == 1
    assert counter.started() == 2 and counter.held() == {"sampler-1": 1}
    assert counter.reclaim("sampler-0") == 0  # nothing twice
    assert counter.try_admit(0, n=2, holder="sampler-0").admitted  # the step can be completed again
    # a launcher starting a run over a previous one's Redis gives back whatever every holder still held
    assert counter.reclaim() == 3 and counter.held() == {} and counter.started() == 1
    counter.settle("sampler-9")  # settling what was never held changes nothing
    assert counter.started() == 1 and counter.held() == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"k": -1, "groups_per_step": 1}, "k must be >= 0, got -1"), ({"k": 0, "groups_per_step": 0}, "got 0")],
)
def test_bad_counter_settings_are_named(
    redis_client: redis.Redis, kwargs: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        AdmissionCounter(redis_client, "bad", **kwargs)


def test_bad_requests_are_named(redis_client: redis.Redis) -> None:
    counter = AdmissionCounter(redis_client, "bad", 1, 1)
    with pytest.raises(ValueError, match="policy_version must be >= 0, got -2"):
        counter.try_admit(-2)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        counter.try_admit(0, n=0)
