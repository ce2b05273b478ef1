"""The learner's scored feed on real Redis: a stop between two steps acknowledges only what a step trained on;
the groups kept for the unfinished step are offered again after the restart, once."""

from __future__ import annotations

from pathlib import Path

import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.learner.feed import ScoredFeed
from services.learner.local_ranks import scored_groups
from vcpo.v1 import rollout_pb2


def _feed(client: redis.Redis) -> ScoredFeed:
    spec = stream_specs(RunConfig(run_id="feed"), StreamsConfig())["scored"]
    return ScoredFeed(client, spec, k=1, groups_per_step=2, max_group_size=8)


def test_groups_kept_for_an_unfinished_step_survive_a_stop(
    redis_client: redis.Redis, tiny_model_dir: Path
) -> None:
    spec = stream_specs(RunConfig(run_id="feed"), StreamsConfig())["scored"]
    groups = scored_groups(tiny_model_dir, [2, 2, 2, 2], seed=3)
    for i, g in enumerate(groups):
        g.group_id = f"g{i}"
    producer = StreamProducer[rollout_pb2.TrajectoryGroup](redis_client, spec)
    producer.put_many([(g, 0) for g in groups[:3]])

    feed = _feed(redis_client)
    feed.resume(None)
    step, _ = feed.poll(0, block_ms=50)
    assert step is not None and [g.group_id for g in step] == ["g0", "g1"]
    step, offered = feed.poll(1, block_ms=50)  # g2 is kept for the next step; nothing else comes
    assert step is None and [o.group_id for o in offered] == ["g2"]
    state = feed.checkpointed()  # the stop's checkpoint
    assert state.consumed == 2 and state.trained_groups == 2
    assert feed.acknowledge(state) == 2
    assert redis_client.xlen(spec.key) == 1  # g2 is still there, pending

    restarted = _feed(redis_client)
    assert restarted.resume(state) == 1  # g2 is replayed
    producer.put_many([(groups[3], 1)])
    step, _ = restarted.poll(1, block_ms=50)
    assert step is not None and [g.group_id for g in step] == ["g2", "g3"]
    final = restarted.checkpointed()
    assert final.consumed == 4 and final.trained_groups == 4
    assert restarted.acknowledge(final) == 2 and redis_client.xlen(spec.key) == 0
