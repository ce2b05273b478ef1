"""The launcher's watch over the learner's ranks (services/learner/ray_group.py RankWatch), on real Ray actors:
a rank process that is SIGSTOPped (alive, answering nothing) is named as hung once its call is older than the
timeout, not before; Ray's kill takes the stopped process down, as the launcher's restart of the group does."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest

from services.learner.config import LearnerServiceConfig


def _watch_until(watch: Any, seconds: float) -> tuple[str | None, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        said = watch.check()
        if said is not None:
            return said, time.monotonic() - t0
        time.sleep(0.2)
    return None, time.monotonic() - t0


def _running(pid: int) -> bool:
    """Whether the process is there and not a zombie; it may end between any two looks at /proc."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_stopped_rank_is_named_hung_after_the_timeout_and_killed_by_the_teardown(ray_local: Any) -> None:
    import ray

    from services.learner.ray_group import LearnerRankActor, RankWatch

    payload = LearnerServiceConfig().model_dump_json()
    ranks = [LearnerRankActor.options(num_cpus=0).remote(payload, i) for i in range(2)]  # type: ignore[attr-defined]
    pids = ray.get([a.pid.remote() for a in ranks], timeout=60)
    watch = RankWatch(ranks, timeout_s=3.0)
    said, _ = _watch_until(watch, 5.0)  # both answer: nothing to say, however long it watches
    assert said is None

    os.kill(pids[1], signal.SIGSTOP)
    try:
        said, after = _watch_until(watch, 30.0)
        assert said is not None and "rank 1 answered nothing" in said and "hung" in said, said
        assert "rank 0" not in said and "learner_hang_timeout_s = 3" in said
        assert 2.5 <= after < 10.0, (
            after
        )  # not before the timeout (its call went out in the loop above); soon after
    finally:
        for a in ranks:
            ray.kill(a)
    # the stopped process is gone too (the launcher's shutdown of the group kills its ranks the same way)
    deadline = time.monotonic() + 30
    while _running(pids[1]):
        assert time.monotonic() < deadline, "a SIGSTOPped rank outlived ray.kill"
        time.sleep(0.2)
