"""The lag bound at admission: one atomic check-and-increment shared by every sampler replica.

docs/design/architecture.md: a sampler whose loaded weights are version ``v`` may start a new group only while the
run's count of started groups is below ``(v + k + 1) * groups_per_step``. The learner needs
``groups_per_step`` groups per step: the ``c``-th group started (counting from 0) is admitted only if
``c < (v + k + 1) * groups_per_step``, so when groups are consumed in the order they started it feeds a step
``t = c // groups_per_step <= v + k`` and its lag ``t - v`` is at most ``k``. With ``k = 0`` a sampler holding
version ``v`` can start only the groups of step ``v``: synchronous on-policy training. (A group that finishes
far out of order can still arrive too old; the learner drops it, counts it and releases its slot.)

The check and the increment are one Lua script, so any number of replicas sharing one Redis never admit
past the bound. A group that was admitted but will never reach the learner (aborted by the sampler, or
dropped by the learner as too old) is given back with :meth:`AdmissionCounter.release`, so the learner is
not left waiting for groups that no sampler may start.

A sampler that dies (kill -9, a lost node) cannot give its in-flight groups back itself. So every admission
names its *holder* (the sampler replica) and the count of slots each holder has in flight is kept beside the
counter, changed by the same scripts: ``try_admit`` adds to it, ``release`` and ``settle`` (the group was
written to ``rollouts``: its slot stays used, the holder no longer owes it) take from it. A restarted
replica, or a launcher starting a run, calls :meth:`AdmissionCounter.reclaim` to give back every slot a dead
holder still held. A sampler settles only *after* its group is on the stream, so a crash between the two
gives a slot back twice, never loses one: at worst one group more than the bound is admitted, which the
learner drops by lag (the hard check), whereas a lost slot could stall a ``k = 0`` run for good.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

# KEYS[1] counter, KEYS[2] holders hash; ARGV: version, k, groups_per_step, n, holder ('' = none).
# Returns {admitted (0/1), started, bound}.
_ADMIT_LUA = """
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local bound = (tonumber(ARGV[1]) + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local n = tonumber(ARGV[4])
if started + n <= bound then
  started = redis.call('INCRBY', KEYS[1], n)
  if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[5], n) end
  return {1, started, bound}
end
return {0, started, bound}
"""

# KEYS[1] counter, KEYS[2] holders hash; ARGV: n, holder ('' = none), give_back (1: the slots return to the
# counter; 0: settle, the holder's groups were written and keep their slots). Neither count goes below zero.
# Returns the counter after the call.
_RELEASE_LUA = """
local n = tonumber(ARGV[1])
if ARGV[2] ~= '' then
  local held = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
  local take = math.min(n, held)
  if held - take > 0 then redis.call('HSET', KEYS[2], ARGV[2], held - take)
  else redis.call('HDEL', KEYS[2], ARGV[2]) end
end
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[3] == '0' then return started end
return redis.call('DECRBY', KEYS[1], math.min(n, started))
"""

# KEYS[1] counter, KEYS[2] holders hash; ARGV: holders to reclaim (none = all). Gives back every slot they
# hold; returns {slots given back, counter after}.
_RECLAIM_LUA = """
local holders = ARGV
if #holders == 0 then holders = redis.call('HKEYS', KEYS[2]) end
local total = 0
for _, h in ipairs(holders) do
  total = total + tonumber(redis.call('HGET', KEYS[2], h) or '0')
  redis.call('HDEL', KEYS[2], h)
end
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local after = redis.call('DECRBY', KEYS[1], math.min(total, started))
return {total, after}
"""


@dataclass(frozen=True)
class Admission:
    """The answer to one admission request."""

    admitted: bool
    started: int  # groups started in the run, after this request
    bound: int  # (v + k + 1) * groups_per_step for the requester's version

    @property
    def reason(self) -> str:
        if self.admitted:
            return "admitted"
        return (
            f"lag bound reached: {self.started} groups started, at most {self.bound} allowed at this version; "
            "waiting for newer weights"
        )


class AdmissionCounter:
    """The run's count of started groups, checked against the lag bound on every increment."""

    def __init__(self, client: redis.Redis, run_id: str, k: int, groups_per_step: int) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.client, self.k, self.groups_per_step = client, k, groups_per_step
        self.key = f"vcpo:{run_id}:admission:started"
        self.holders_key = f"vcpo:{run_id}:admission:holders"
        self._admit = client.register_script(_ADMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._reclaim = client.register_script(_RECLAIM_LUA)

    def bound(self, policy_version: int) -> int:
        return (policy_version + self.k + 1) * self.groups_per_step

    def try_admit(self, policy_version: int, n: int = 1, holder: str = "") -> Admission:
        """Start ``n`` groups with weights ``policy_version`` if the bound allows all of them (else none);
        a ``holder`` owes the slots until it settles or releases them."""
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ok, started, bound = self._admit(
            keys=[self.key, self.holders_key], args=[policy_version, self.k, self.groups_per_step, n, holder]
        )
        return Admission(bool(ok), int(started), int(bound))

    def release(self, n: int = 1, holder: str = "") -> int:
        """Give back ``n`` admitted groups that will never be trained on; returns the new count."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return int(self._release(keys=[self.key, self.holders_key], args=[n, holder, 1]))

    def settle(self, holder: str, n: int = 1) -> None:
        """``holder``'s ``n`` groups were written: they keep their slots and the holder no longer owes them."""
        self._release(keys=[self.key, self.holders_key], args=[n, holder, 0])

    def held(self) -> dict[str, int]:
        """Slots each holder has in flight (admitted, neither written nor given back)."""
        raw: dict[bytes, bytes] = self.client.hgetall(self.holders_key)  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items()}

    def reclaim(self, *holders: str) -> int:
        """Give back every slot still held by ``holders`` (none named: by every holder), which must be dead:
        a restarted replica reclaims its own, a launcher starting a run all of them. Returns how many."""
        total, _ = self._reclaim(keys=[self.key, self.holders_key], args=list(holders))
        return int(total)

    def started(self) -> int:
        return int(self.client.get(self.key) or 0)
