"""Which versions each validation set is evaluated at, decided once per set and bucket across the run."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import redis


class EvalSchedule:
    """Which versions each set is evaluated at: version 0 (``at_start``), then the first version an evaluator
    meets in every bucket ``[b * every, (b + 1) * every)``, b >= 1, of that set's ``every``. One claim per set
    and bucket across the run (Redis ``SET NX``, kept across restarts), so a bucket is evaluated at one
    version only: by the claimer alone (:meth:`claim`: the dedicated evaluator) or by every replica serving
    that version (:meth:`due`: shared rounds, split into shards). A round abandoned or cut short is not
    retried in its bucket (a budget too small for the sets would otherwise delay every version)."""

    def __init__(
        self,
        every: Mapping[str, int],
        at_start: bool,
        client: redis.Redis | None = None,
        run_id: str = "",
        owner: str = "",
    ) -> None:
        bad = {name: e for name, e in every.items() if e < 1}
        if not every or bad:
            raise ValueError(f"every set needs an interval >= 1 (versions), got {dict(every)}")
        self.every, self.at_start = dict(every), at_start
        self.client, self.run_id, self.owner = client, run_id, owner
        self._decided: set[tuple[str, int]] = set()  # (set, bucket) claimed or seen claimed by this process

    def _open(self, version: int) -> Iterator[tuple[str, int, str]]:
        """(set, bucket, claim key) of the sets whose bucket at ``version`` this process has not decided."""
        for name, every in self.every.items():
            bucket = version // every
            if (name, bucket) not in self._decided and (bucket >= 1 or (version == 0 and self.at_start)):
                yield name, bucket, f"vcpo:{self.run_id}:eval:claim:{name}:{bucket}"

    def claim(self, version: int) -> list[str]:
        """The sets to evaluate at ``version`` here (now claimed for it), in the order they were given."""
        due = []
        for name, bucket, key in list(self._open(version)):
            self._decided.add((name, bucket))
            if self.client is None or self.client.set(key, f"{self.owner}@{version}", nx=True):
                due.append(name)
        return due

    def due(self, version: int) -> list[str]:
        """The sets due at ``version`` (in the order they were given): those this process claims for it now and
        those another replica claimed for this very version. Every replica serving a version a set was
        claimed at takes part in that set's round (shards.py): the claim decides the version, not who
        evaluates."""
        due = []
        for name, bucket, key in list(self._open(version)):
            self._decided.add((name, bucket))
            if self.client is None or self.client.set(key, f"{self.owner}@{version}", nx=True):
                due.append(name)
                continue
            held = self.client.get(key)
            if isinstance(held, bytes) and held.decode().rsplit("@", 1)[-1] == str(version):
                due.append(name)
        return due

    def wants(self, version: int) -> bool:
        """Whether ``version`` may still be due for some set (claims nothing): the dedicated evaluator fetches
        only such versions. Once False for a version it stays False (buckets are only ever claimed)."""
        for name, bucket, key in list(self._open(version)):
            if self.client is None or not self.client.exists(key):
                return True
            self._decided.add((name, bucket))  # claimed before (e.g. by this evaluator before a restart)
        return False
