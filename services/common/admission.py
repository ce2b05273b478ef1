"""The lag bound at admission: one atomic check-and-increment shared by every sampler replica.

ARCHITECTURE.md: a sampler whose loaded weights are version ``v`` may start a new group only while the
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
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

# KEYS[1] counter; ARGV: version, k, groups_per_step, n. Returns {admitted (0/1), started, bound}.
_ADMIT_LUA = """
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local bound = (tonumber(ARGV[1]) + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local n = tonumber(ARGV[4])
if started + n <= bound then
  started = redis.call('INCRBY', KEYS[1], n)
  return {1, started, bound}
end
return {0, started, bound}
"""

# KEYS[1] counter; ARGV[1] n. Never goes below zero; returns the new count.
_RELEASE_LUA = """
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = math.min(tonumber(ARGV[1]), started)
return redis.call('DECRBY', KEYS[1], n)
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
        self._admit = client.register_script(_ADMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    def bound(self, policy_version: int) -> int:
        return (policy_version + self.k + 1) * self.groups_per_step

    def try_admit(self, policy_version: int, n: int = 1) -> Admission:
        """Start ``n`` groups with weights ``policy_version`` if the bound allows all of them (else none)."""
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ok, started, bound = self._admit(
            keys=[self.key], args=[policy_version, self.k, self.groups_per_step, n]
        )
        return Admission(bool(ok), int(started), int(bound))

    def release(self, n: int = 1) -> int:
        """Give back ``n`` admitted groups that will never be trained on; returns the new count."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return int(self._release(keys=[self.key], args=[n]))

    def started(self) -> int:
        return int(self.client.get(self.key) or 0)
