"""The run's ledger: every group the samplers wrote, followed to what the learner did with it.

Taken after every service has stopped (the learner's last checkpoint acknowledged what it consumed), from
three independent records that must agree:

    Redis streams   rollouts: entries ever added, how many of them the samplers wrote (<key>:produced, raised
                    with each XADD), still there, dead-lettered; the same for scored (written by the reward
                    service)
    the learner     its checkpointed feed state: entries consumed, groups trained, rejected, dropped by lag
    the audit log   learner/steps.jsonl, last line per step: the id of every group trained on, and its lag

    nothing lost:      rollouts added = scored by the reward service + rollouts left + rollouts dead-lettered
                       scored added   = learner consumed + scored left + scored dead-lettered
    counted apart:     foreign entries (added - produced: written by anything but the services, e.g. a
                       person's XADD), which the consumers dead-letter when malformed; "groups sampled" is
                       what the samplers produced, of which agents (the agent API) played
                       ``agent_groups_produced``
    nothing counted twice: consumed = trained + rejected + dropped; the audit log's trained group ids are all
                       distinct and as many as the learner's trained count
    the lag bound:     every trained group's lag is at most k
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis

from deploy.progress import entries_added
from services.common.streams.specs import agent_groups_key, produced_key


def take_ledger(
    client: redis.Redis,
    stream_keys: dict[str, str],
    dead_letter_keys: dict[str, str],
    feed: dict[str, Any] | None,
    steps: dict[int, dict[str, Any]],
    k: int,
) -> dict[str, Any]:
    """The ledger as a JSON-able dict; ``balanced`` is True only when every check holds, ``problems`` says
    which did not."""
    counts: dict[str, Any] = {}
    problems: list[str] = []
    for name in ("rollouts", "scored"):
        added = entries_added(client, stream_keys[name])
        raw = client.get(produced_key(stream_keys[name]))
        # no counter: a stream written before the services counted what they produced (all of it theirs)
        produced = added if raw is None else int(raw)
        counts[f"{name}_added"] = added
        counts[f"{name}_produced"] = produced
        counts[f"{name}_foreign"] = added - produced
        counts[f"{name}_left"] = int(client.xlen(stream_keys[name]))
        counts[f"{name}_dead_lettered"] = int(client.xlen(dead_letter_keys[name]))
        if produced > added:
            problems.append(f"{name}: the services counted {produced} entries written, the stream {added}")
    counts["agent_groups_produced"] = int(client.get(agent_groups_key(stream_keys["rollouts"])) or 0)
    if counts["agent_groups_produced"] > counts["rollouts_produced"]:
        problems.append(
            f"the samplers counted {counts['agent_groups_produced']} agents' groups written of "
            f"{counts['rollouts_produced']} in all"
        )
    scored_out = counts["scored_produced"] + counts["rollouts_left"] + counts["rollouts_dead_lettered"]
    if counts["rollouts_added"] != scored_out:
        problems.append(
            f"rollouts added {counts['rollouts_added']} != scored {counts['scored_produced']} + left in "
            f"rollouts {counts['rollouts_left']} + dead-lettered {counts['rollouts_dead_lettered']}"
        )
    trained_ids = [g for s in steps.values() for g in s.get("groups", [])]
    lags = [int(x) for s in steps.values() for x in s.get("lags", [])]
    repeated = sorted(g for g, n in Counter(trained_ids).items() if n > 1)
    counts.update(
        trained_in_audit_log=len(trained_ids),
        distinct_trained=len(set(trained_ids)),
        max_trained_lag=max(lags, default=0),
        k=k,
        steps=len(steps),
    )
    if repeated:
        problems.append(f"{len(repeated)} group(s) trained on in two steps: {repeated[:5]}")
    if lags and max(lags) > k:
        problems.append(f"a trained group had lag {max(lags)} > k = {k}")
    if feed is None:
        problems.append("the learner reported no feed state (did it stop cleanly?)")
    else:
        consumed, trained = int(feed["consumed"]), int(feed["trained_groups"])
        rejected = sum(int(v) for v in feed.get("rejected", {}).values())
        dropped = sum(int(v) for v in feed.get("dropped_by_lag", {}).values())
        counts.update(consumed=consumed, trained=trained, rejected=rejected, dropped_by_lag=dropped)
        left = counts["scored_left"] + counts["scored_dead_lettered"]
        if counts["scored_added"] != consumed + left:
            problems.append(
                f"scored added {counts['scored_added']} != consumed by the learner {consumed} + left in scored "
                f"{counts['scored_left']} + dead-lettered {counts['scored_dead_lettered']}"
            )
        if consumed != trained + rejected + dropped:
            problems.append(
                f"consumed {consumed} != trained {trained} + rejected {rejected} + dropped {dropped}"
            )
        if trained != len(trained_ids):
            problems.append(
                f"the learner trained {trained} groups but its audit log names {len(trained_ids)}"
            )
    return {"balanced": not problems, "problems": problems, **counts}
