"""Scoring worker processes: every scorer call runs in a worker, under that scorer's time limit.

Why processes: a scorer is arbitrary Python (sympy inside math-verify, user plugins, the sandbox's parent
side); a call that hangs in C code cannot be interrupted from a thread. A worker that overruns its call's
deadline is killed and replaced, the call becomes a failure with reason ``timeout``, and the caller records
the configured fallback reward: a slow or broken scorer costs one response's reward, never a group.

    ScoringPool.score_many([(scorer, ScoreInput), ...])        (thread-safe; any number of callers)
        │ each job takes an idle worker from the queue
        ▼
    worker process: conn.recv() ─► get_scorer(name)(item) ─► conn.send(("ok", value, components))
        ▲                                                        │ or ("error", reason, message)
        └── conn.poll(deadline) ◄───────────────────────────────┘
            no answer in time ─► SIGKILL, start a replacement ─► Outcome(failed, "timeout")
            worker died (EOF)  ─► start a replacement         ─► Outcome(failed, "worker_died")

Workers start from a fork server that has the scorer modules imported already, so a replacement is ready
in tens of milliseconds. Plugin modules (config ``reward.plugins``) are imported in every worker and in the
parent (the parent checks scorer names before dispatching: an unknown name is a failure without a worker
call). Workers die with their parent: they exit on EOF of their pipe and ask the kernel for SIGKILL when
the process that started them dies.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from services.common.sandbox import SandboxLimits
from services.reward.scorers import ScoreInput, ScorerError, UnknownScorerError, get_scorer, load_plugins

if TYPE_CHECKING:
    from services.reward.config import RewardConfig

log = logging.getLogger(__name__)

FAILURE_REASONS = ("timeout", "worker_died", "unknown_scorer", "exception", "nonfinite_reward")
"""Failure reasons the pool itself produces (scorers add their own, e.g. ``bad_reference``)."""

_PRELOAD = ["services.reward.scorers", "services.reward.pool", "math_verify"]
_STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    """What one scoring call came to: the reward to record, or a failure with the fallback reward."""

    scorer: str
    value: float
    failed: bool = False
    reason: str = ""  # bounded label (metric label) when failed
    message: str = ""  # readable detail when failed
    components: dict[str, float] = field(default_factory=dict)
    latency_s: float = 0.0


def _item_args(item: ScoreInput) -> dict[str, Any]:
    # MappingProxyType does not pickle: send plain values
    args = {f.name: getattr(item, f.name) for f in fields(item)}
    args["metadata"] = dict(item.metadata)
    return args


def _parent_death_signal() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF still ends the worker
        pass


def _worker_main(conn: Connection, plugins: Sequence[str], limits: SandboxLimits) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    _parent_death_signal()
    try:
        from services.reward.scorers import code_tests

        load_plugins(plugins)
        code_tests.configure(limits)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        for name, args in chunk:  # one reply per job as soon as it is scored: the parent times each one
            try:
                conn.send(_score_one(name, args))
            except (EOFError, OSError):
                return


def _score_one(name: str, args: dict[str, Any]) -> tuple[Any, ...]:
    try:
        score = get_scorer(name)(ScoreInput(**args))
        value = float(score.value)
        if not math.isfinite(value):
            raise ScorerError("nonfinite_reward", f"scorer {name!r} returned {value}")
        return ("ok", value, {k: float(v) for k, v in score.components.items()})
    except ScorerError as exc:
        return ("error", exc.reason, str(exc))
    except Exception as exc:
        return ("error", "exception", f"{type(exc).__name__}: {exc}")


class _Worker:
    def __init__(self, ctx: Any, plugins: Sequence[str], limits: SandboxLimits) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, list(plugins), limits), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"a scoring worker did not start within {_STARTUP_TIMEOUT_S:.0f}s")
        try:
            hello = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(
                f"a scoring worker died while starting (exit code {self.process.exitcode})"
            ) from None
        if hello[0] != "ready":
            self.kill()
            raise RuntimeError(f"a scoring worker could not start: {hello[1]}")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ScoringPool:
    """``workers`` scoring processes; calls are spread over them, each under its scorer's time limit."""

    def __init__(
        self,
        workers: int,
        timeout_for: Callable[[str], float],
        fallback_reward: float = 0.0,
        plugins: Sequence[str] = (),
        sandbox: SandboxLimits | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        load_plugins(plugins)  # names are checked here before any dispatch; import errors surface now
        self.timeout_for, self.fallback_reward = timeout_for, fallback_reward
        self._plugins, self._limits = list(plugins), sandbox or SandboxLimits()
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(method)
        if method == "forkserver":
            self._ctx.set_forkserver_preload([*_PRELOAD, *self._plugins])
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        try:
            for _ in range(workers):
                self._add_worker()
        except BaseException:
            self.close()
            raise
        self.workers = workers
        self._fanout = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="score")
        self.replaced = 0  # workers killed on a timeout or found dead, and replaced

    @classmethod
    def from_config(cls, r: RewardConfig, workers: int | None = None) -> ScoringPool:
        """The pool ``[reward]`` describes (time limits, fallback reward, plugins, sandbox limits), with
        ``workers`` processes (default ``reward.workers``): the reward service's and the evaluator's."""
        sandbox = SandboxLimits(**r.sandbox.model_dump())
        return cls(workers or r.workers, r.timeout_for, r.fallback_reward, r.plugins, sandbox)

    def _add_worker(self) -> None:
        worker = _Worker(self._ctx, self._plugins, self._limits)
        with self._lock:
            self._all.add(worker)
        self._idle.put(worker)

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
            self.replaced += 1
        worker.kill()
        if not self._closed:
            self._add_worker()

    def score(self, scorer: str, item: ScoreInput) -> Outcome:
        """Score one response with ``scorer``; never raises for a scorer's failure (see :class:`Outcome`)."""
        return self._run_chunk([(scorer, item)])[0]

    def score_many(self, jobs: Sequence[tuple[str, ScoreInput]]) -> list[Outcome]:
        """Score several responses in parallel over the workers; outcomes in job order.

        Jobs are dealt round-robin into one chunk per worker; a chunk goes to its worker in one message and
        comes back one reply per job, so cheap scorers do not pay a round trip each.
        """
        chunks = min(self.workers, len(jobs))
        if chunks <= 1:
            return self._run_chunk(jobs)
        order = [list(range(c, len(jobs), chunks)) for c in range(chunks)]
        results = self._fanout.map(lambda idx: self._run_chunk([jobs[i] for i in idx]), order)
        outcomes: list[Outcome | None] = [None] * len(jobs)
        for idx, chunk_outcomes in zip(order, results, strict=True):
            for i, outcome in zip(idx, chunk_outcomes, strict=True):
                outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    def _run_chunk(self, jobs: Sequence[tuple[str, ScoreInput]]) -> list[Outcome]:
        """Score ``jobs`` on one worker, each under its scorer's limit (timed from the previous reply). A job
        that overruns or kills the worker fails alone; the jobs after it go to a fresh worker."""
        done: dict[int, Outcome] = {}
        runnable: list[tuple[int, str, ScoreInput]] = []
        for i, (name, item) in enumerate(jobs):
            try:
                get_scorer(name)
                runnable.append((i, name, item))
            except UnknownScorerError as exc:
                done[i] = self._failed(name, "unknown_scorer", str(exc), time.monotonic())
        if runnable:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            worker = self._idle.get()
            healthy = True
            try:
                worker.conn.send([(name, _item_args(item)) for _, name, item in runnable])
                for k, (i, name, _item) in enumerate(runnable):
                    since = time.monotonic()
                    timeout = self.timeout_for(name)
                    reply = self._reply(worker, name, timeout, since)
                    if isinstance(reply, Outcome):  # timed out or died: the rest go to a fresh worker
                        healthy = False
                        done[i] = reply
                        rest = runnable[k + 1 :]
                        self._retire(worker)
                        for (j, _, _), outcome in zip(
                            rest, self._run_chunk([(n, it) for _, n, it in rest]), strict=True
                        ):
                            done[j] = outcome
                        break
                    if reply[0] == "ok":
                        done[i] = Outcome(
                            name, reply[1], components=reply[2], latency_s=time.monotonic() - since
                        )
                    else:
                        done[i] = self._failed(name, reply[1], reply[2], since)
            finally:
                if healthy:
                    self._idle.put(worker)
        return [done[i] for i in range(len(jobs))]

    def _reply(self, worker: _Worker, scorer: str, timeout: float, since: float) -> tuple[Any, ...] | Outcome:
        """The worker's next reply, or the failure Outcome when it overruns ``timeout`` or dies."""
        try:
            if not worker.conn.poll(timeout):
                return self._failed(
                    scorer, "timeout", f"scorer {scorer!r} took longer than {timeout:g}s", since
                )
            reply: tuple[Any, ...] = worker.conn.recv()
            return reply
        except (EOFError, OSError):
            worker.process.join(timeout=5)  # reap it, so its exit code is known
            detail = f"the scoring worker died (exit code {worker.process.exitcode}) while running scorer {scorer!r}"
            return self._failed(scorer, "worker_died", detail, since)

    def _failed(self, scorer: str, reason: str, message: str, start: float) -> Outcome:
        return Outcome(
            scorer,
            self.fallback_reward,
            failed=True,
            reason=reason,
            message=message,
            latency_s=time.monotonic() - start,
        )

    def close(self) -> None:
        self._closed = True
        if hasattr(self, "_fanout"):
            self._fanout.shutdown(wait=True)
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
