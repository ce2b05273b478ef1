"""A shared evaluation round cut into shards, so that every sampler replica serving its version takes part.

One engine cannot generate a held-out round of thousands of samples inside the hold a newer version grants it
(``max_delay_s``), so a round at version v is not one replica's work: its tasks, in the order of its sets and
of their tasks, are cut into shards of about ``evaluation.shard_samples`` samples (whole tasks: a task's n
samples are scored together, and an environment task is one group of episodes), and every replica whose engine
serves v takes shards one at a time while its engine has room (work stealing: a fast replica takes more).

    Redis, under vcpo:<run>:eval:round:<v>
      (hash)       layout: the sets, their task counts, the shard bounds and the round's start (written once,
                   HSETNX, by the first replica to open the round; the others read it); recorded: who recorded
      :lease:<i>   who generates shard i now (SET NX PX evaluation.shard_lease_s), renewed by its holder's
                   loop. A replica that dies stops renewing, so the shard is free once the lease lapses; one that
                   moves to a newer version, or gives its part up, deletes its leases at once
      :done        shard -> its tasks' tallies (rounds.TaskTally); HSETNX: the first result of a shard counts

    claim  (one script): the first shard with neither a result nor a live lease ─► a lease on it
    submit (one script): the shard's result in; the submission that makes the number of results equal to the
           number of shards, and only it, records the round (``recorded`` refuses anything after it)

A shard generated twice (its lease lapsed while the holder stalled, and both finished) costs generation only:
the second result is dropped. A replica that records the round computes the figures with
rounds.set_results from every task's tally, exactly as a round generated in one engine computes them.
Each step is a Lua script, atomic against the other replicas, as the admission counter's are
(services/common/admission.py); a lock service would add a moving part and still need the count of results
checked with the write.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from services.evaluator.rounds import TaskTally
from services.evaluator.sets import EvalSet

log = logging.getLogger(__name__)

Task = tuple[int, int]  # (set index, task index) in the evaluator's sets

# KEYS[1] results, KEYS[2] round hash, KEYS[3..] every shard's lease; ARGV: owner, lease ms.
# Returns {the shard taken (from 0) or -1, the number of results in (-1: the round is recorded)}.
_CLAIM_LUA = """
if redis.call('HEXISTS', KEYS[2], 'recorded') == 1 then return {-1, -1} end
local done = redis.call('HLEN', KEYS[1])
for i = 3, #KEYS do
  if redis.call('HEXISTS', KEYS[1], tostring(i - 3)) == 0
      and redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return {i - 3, done}
  end
end
return {-1, done}
"""

# KEYS: leases; ARGV: owner, lease ms. A lease still the owner's is extended, one that lapsed with nobody
# taking it is taken again; returns how many the owner holds.
_RENEW_LUA = """
local held = 0
for i = 1, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    held = held + 1
  elseif not holder then
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
    held = held + 1
  end
end
return held
"""

# KEYS: leases; ARGV: owner. Deletes those the owner holds.
_RELEASE_LUA = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
"""

# KEYS[1] results, KEYS[2] round hash, KEYS[3] the shard's lease; ARGV: shard, result, owner, shards.
# Returns 1 if this result completed the round (its submitter records it), else 0.
_SUBMIT_LUA = """
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
if redis.call('HEXISTS', KEYS[2], 'recorded') == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
if redis.call('HLEN', KEYS[1]) < tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[2], 'recorded', ARGV[3])
return 1
"""

RESULTS_TTL_S = 86400  # a recorded round's shard results are kept a day (the recorded mark stays)


def pack(sizes: Sequence[int], shard_samples: int) -> list[int]:
    """Shard bounds over tasks of ``sizes`` samples each: shard i is tasks ``[bounds[i], bounds[i + 1])``, of at
    most ``shard_samples`` samples unless one task alone has more."""
    if shard_samples < 1:
        raise ValueError(f"evaluation.shard_samples must be >= 1, got {shard_samples}")
    bounds, filled = [0], 0
    for i, size in enumerate(sizes):
        if filled and filled + size > shard_samples:
            bounds.append(i)
            filled = 0
        filled += size
    if sizes:
        bounds.append(len(sizes))
    return bounds


@dataclass(frozen=True)
class Layout:
    """A shared round: its version, its sets (indices into the evaluator's sets), its tasks in order, its
    shards as bounds over them, and when it was opened (unix seconds)."""

    version: int
    sets: tuple[int, ...]
    names: tuple[str, ...]  # of the sets: how results name them in Redis
    tasks: tuple[Task, ...]
    bounds: tuple[int, ...]
    started: float

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    def shard(self, i: int) -> list[Task]:
        return list(self.tasks[self.bounds[i] : self.bounds[i + 1]])


@dataclass
class ShardBoard:
    """One replica's side of the shared rounds: it opens (joins) the round at the version its engine serves,
    claims shards of it, keeps their leases alive, gives them back, and submits their results."""

    client: redis.Redis
    run_id: str
    owner: str
    shard_samples: int = 64
    lease_s: float = 30.0
    poll_s: float = 1.0  # how often a replica with nothing to generate asks for a shard that became free
    joined: Layout | None = None  # the round at the loaded version this replica takes part in
    held: dict[int, set[int]] = field(default_factory=dict)  # version -> shards whose leases it holds
    layouts: dict[int, Layout] = field(
        default_factory=dict
    )  # versions it holds leases of, and the joined one
    _next_claim: float = 0.0
    _next_renew: float = 0.0

    def __post_init__(self) -> None:
        if self.lease_s <= 0:
            raise ValueError(f"evaluation.shard_lease_s must be > 0, got {self.lease_s}")
        self._claim = self.client.register_script(_CLAIM_LUA)
        self._renew = self.client.register_script(_RENEW_LUA)
        self._release = self.client.register_script(_RELEASE_LUA)
        self._submit = self.client.register_script(_SUBMIT_LUA)

    # ------------------------------------------------------------------ keys
    def _round(self, version: int) -> str:
        return f"vcpo:{self.run_id}:eval:round:{version}"

    def _results(self, version: int) -> str:
        return f"{self._round(version)}:done"

    def _lease(self, version: int, shard: int) -> str:
        return f"{self._round(version)}:lease:{shard}"

    # ------------------------------------------------------------------ a replica's part
    def join(self, version: int, chosen: Sequence[int], sets: Sequence[EvalSet]) -> Layout:
        """Open the round at ``version`` of the sets ``chosen`` (indices into ``sets``), as the first replica
        lays it out or as it was laid out already; from now on :meth:`take` claims its shards."""
        proposal: dict[str, Any] = {
            "sets": [sets[si].name for si in chosen],
            "tasks": [len(sets[si].tasks) for si in chosen],
            "bounds": pack([sets[si].n for si in chosen for _ in sets[si].tasks], self.shard_samples),
            "started": time.time(),
        }
        key = self._round(version)
        self.client.hsetnx(key, "layout", json.dumps(proposal))
        raw = self.client.hget(key, "layout")
        stored = json.loads(raw) if raw is not None else proposal
        index = {s.name: i for i, s in enumerate(sets)}
        for name, count in zip(stored["sets"], stored["tasks"], strict=True):
            if name not in index or len(sets[index[name]].tasks) != count:
                raise ValueError(
                    f"the shared evaluation round at version {version} has set {name!r} of {count} tasks, which "
                    "this replica does not have: every replica must read the same [evaluation] sets"
                )
        picked = tuple(index[name] for name in stored["sets"])
        tasks = tuple((si, ti) for si in picked for ti in range(len(sets[si].tasks)))
        layout = Layout(
            version, picked, tuple(stored["sets"]), tasks, tuple(stored["bounds"]), float(stored["started"])
        )
        self.joined = self.layouts[version] = layout
        self._next_claim = 0.0
        return layout

    def leave(self) -> None:
        """Stop taking shards of the joined round (the engine moved on); leases held stay until given back."""
        if self.joined is not None and not self.held.get(self.joined.version):
            self.layouts.pop(self.joined.version, None)
        self.joined = None

    def take(self, loaded_version: int | None) -> tuple[int, list[Task]] | None:
        """A shard of the joined round, now leased to this replica, and its tasks; None when the engine does not
        serve the round's version or no shard is free (then asked again after ``poll_s``)."""
        layout = self.joined
        if layout is None or time.monotonic() < self._next_claim:
            return None
        if loaded_version != layout.version:
            self.leave()
            return None
        version = layout.version
        keys = [self._results(version), self._round(version)]
        keys += [self._lease(version, i) for i in range(layout.shards)]
        shard, done = (int(x) for x in self._claim(keys=keys, args=[self.owner, int(self.lease_s * 1000)]))
        if shard < 0:
            if done < 0 or done >= layout.shards:  # every shard is in: nothing left to wait for
                self.leave()
            else:
                self._next_claim = time.monotonic() + self.poll_s
            return None
        self.held.setdefault(version, set()).add(shard)
        return shard, layout.shard(shard)

    def renew(self) -> None:
        """Keep the leases this replica holds alive (at most every third of a lease)."""
        now = time.monotonic()
        if now < self._next_renew or not any(self.held.values()):
            return
        self._next_renew = now + self.lease_s / 3
        keys = [self._lease(v, i) for v, shards in self.held.items() for i in sorted(shards)]
        self._renew(keys=keys, args=[self.owner, int(self.lease_s * 1000)])

    def release(self, version: int, shards: Sequence[int]) -> None:
        """Give shards back unfinished: any replica serving ``version`` may claim them now."""
        if shards:
            self._release(keys=[self._lease(version, i) for i in shards], args=[self.owner])
        self._drop(version, shards)

    def submit(
        self, version: int, results: Mapping[int, Mapping[Task, TaskTally]]
    ) -> tuple[Layout, dict[Task, TaskTally]] | None:
        """Hand in the results of shards (shard -> its tasks' tallies) of the round at ``version``. When they
        complete the round: its layout and every task's tally, which this replica alone then records."""
        layout = self.layouts[version]
        names = dict(zip(layout.sets, layout.names, strict=True))
        completed = False
        for shard, tallies in results.items():
            payload = json.dumps(
                [
                    [names[si], ti, t.rewards, t.failed_scores, t.tokens, t.env_failed]
                    for (si, ti), t in sorted(tallies.items())
                ]
            )
            keys = [self._results(version), self._round(version), self._lease(version, shard)]
            if self._submit(keys=keys, args=[shard, payload, self.owner, layout.shards]):
                completed = True
        self._drop(version, list(results))
        if not completed:
            return None
        raw = self.client.hgetall(self._results(version))
        self.client.expire(self._results(version), RESULTS_TTL_S)
        index = {name: si for si, name in names.items()}
        everything: dict[Task, TaskTally] = {}
        for shard_result in raw.values():
            for name, ti, rewards, failed_scores, tokens, env_failed in json.loads(shard_result):
                everything[(index[name], ti)] = TaskTally(rewards, failed_scores, tokens, env_failed)
        return layout, everything

    def _drop(self, version: int, shards: Sequence[int]) -> None:
        held = self.held.get(version, set())
        held.difference_update(shards)
        if not held:
            self.held.pop(version, None)
            if self.joined is None or self.joined.version != version:
                self.layouts.pop(version, None)
