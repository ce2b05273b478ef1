"""Kill (or hang) the local system's processes at random while it trains, then judge the run by its ledger.

    python -m deploy.chaos --config deploy/presets/local.toml --run.run_dir runs/chaos \\
        --kills 50 --minutes 30 --kinds sampler,reward,learner,weight_broker,redis,learner_hang --max-steps 3000

    launcher   ``python -m deploy.launch`` with the rest of the arguments, in its own session; its output goes
               to <run_dir>/chaos/launcher.log (and here, with --verbose)
    kills      after the first learner step, then every --gap-s seconds (random within the range): a kind at
               random (each kind in turn, in a shuffled order, so every kind is hit alike), one process of
               that kind at random, SIGKILL by PID; ``learner_hang`` SIGSTOPs a learner rank instead (a rank
               that hangs, as one stuck in a driver call or swapped out does: alive, answering nothing; its
               peer's next collective times out after learner.collective_timeout_s, which chaos sets to 30 s
               unless given, and the launcher tears the group down, the stopped rank with it). A kill waits for the learner to have taken a step since
               the last one, so each kill meets a running system rather than one still recovering; none
               comes in the last 10% of the steps, so every kill's restart is seen before the run ends.
    processes  found among the launcher's descendants by the titles Ray gives its workers:
               sampler ray::SamplerActor, learner ray::LearnerRankActor (any rank), weight_broker
               ray::WeightBrokerActor, reward ray::ServeReplica:vcpo-reward, redis the redis-server
    the end    the launcher reaches --max-steps and exits by itself; the judge: its exit status (0), the last
               step (= --max-steps), the ledger (balanced: no group lost; no group trained twice; max lag ≤ k),
               a restart of its service counted for every kill; and the figures: restarts by service and the
               longest gap between two learner steps (the report's)

The verdict is printed and written to <run_dir>/chaos/result.json; the exit status is 0 only when every check
held. A ``learner_hang`` counts as a learner kill in the judge (the learner group must be restarted for it).
``launcher.max_restarts`` is set to the number of kills + 2 (each kind could be hit that often), and
``launcher.max_minutes`` to 0 unless given (the run is judged at its ``max_steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

KINDS: dict[str, tuple[str, ...]] = {  # kind -> process-title prefixes (Ray names its workers ray::<Actor>)
    "sampler": ("ray::SamplerActor",),
    "learner": ("ray::LearnerRankActor",),
    "weight_broker": ("ray::WeightBrokerActor",),
    "reward": ("ray::ServeReplica:vcpo-reward",),
    "redis": ("redis-server",),
}


FAULTS: dict[str, tuple[str, signal.Signals]] = {  # kind -> (the process kind it hits, the signal)
    **{kind: (kind, signal.SIGKILL) for kind in KINDS},
    "learner_hang": ("learner", signal.SIGSTOP),
}
HANG_TIMEOUT_S = 30  # learner.collective_timeout_s of a run with learner_hang, unless given


def classify(title: str) -> str | None:
    """The kind of a process from its command line (Ray's title for its workers), or None."""
    words = title.split()
    if not words:
        return None
    for kind, prefixes in KINDS.items():
        if any(title.startswith(p) or os.path.basename(words[0]) == p for p in prefixes):
            return kind
    return None


def processes(root: int) -> dict[str, list[int]]:
    """PIDs of each kind among ``root``'s descendants."""
    found: dict[str, list[int]] = {kind: [] for kind in KINDS}
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for p in children:
        try:  # a process may end between any two looks at it
            kind = classify(" ".join(p.cmdline()))
            running = p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if kind is not None and running:
            found[kind].append(p.pid)
    return found


def last_step(run_dir: Path) -> int:
    """The last learner step in the audit log (0 before the first)."""
    path = run_dir / "learner" / "steps.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def judge(
    code: int,
    max_steps: int,
    steps: int,
    ledger: dict[str, Any],
    restarts: dict[str, int],
    kills_by_kind: dict[str, int],
) -> dict[str, bool]:
    """The checks a chaos run must pass: the launcher's exit status and last step, the ledger (nothing lost,
    nothing trained twice, the lag bound), and a restart of its service counted for every kill (a
    ``learner_hang`` is one of the learner's)."""
    by_service: dict[str, int] = {}
    for kind, n in kills_by_kind.items():
        service = FAULTS[kind][0] if kind in FAULTS else kind
        by_service[service] = by_service.get(service, 0) + n
    kills_by_kind = by_service
    trained_twice = int(ledger.get("trained_in_audit_log", 0)) - int(ledger.get("distinct_trained", 0))
    unanswered = {
        k: n - int(restarts.get(k, 0)) for k, n in kills_by_kind.items() if int(restarts.get(k, 0)) < n
    }
    return {
        "launcher exited 0": code == 0,
        f"reached max_steps ({max_steps})": bool(max_steps) and steps == max_steps,
        "ledger balanced (no group lost)": bool(ledger.get("balanced")),
        "no group trained twice": bool(ledger) and trained_twice == 0,
        "max trained lag <= k": bool(ledger)
        and ledger.get("max_trained_lag", 1 << 30) <= ledger.get("k", -1),
        "a restart counted for every kill"
        + (f" (missing: {unanswered})" if unanswered else ""): not unanswered,
    }


@dataclass
class Chaos:
    run_dir: Path
    kinds: list[str]
    kills: int
    minutes: float
    gap_s: tuple[float, float]
    seed: int
    max_steps: int = 0
    verbose: bool = False
    done: list[dict[str, Any]] = field(default_factory=list)

    def run(self, launcher_args: list[str]) -> dict[str, Any]:
        out = self.run_dir / "chaos"
        out.mkdir(parents=True, exist_ok=True)
        log = (out / "launcher.log").open("w")
        cmd = [sys.executable, "-m", "deploy.launch", "--run.run_dir", str(self.run_dir), *launcher_args]
        print(f"chaos: {' '.join(cmd)}", flush=True)
        launcher = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        lines: list[str] = []
        reader = threading.Thread(target=self._copy, args=(launcher, log, lines), daemon=True)
        reader.start()
        t0 = time.monotonic()
        try:
            self._inject(launcher, t0)
            code = launcher.wait()
        except BaseException:
            os.killpg(launcher.pid, signal.SIGINT)  # the launcher stops the run cleanly
            launcher.wait(600)
            raise
        finally:
            reader.join(10)
            log.close()
        return self._verdict(code, time.monotonic() - t0, lines)

    def _copy(self, proc: subprocess.Popen[str], log: Any, lines: list[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            lines.append(line.rstrip("\n"))
            if self.verbose or "[!!]" in line or "[ok] ledger" in line or line.startswith("stopping"):
                print(f"  | {line.rstrip()}", flush=True)

    def _inject(self, launcher: subprocess.Popen[str], t0: float) -> None:
        rng = random.Random(self.seed)
        order: list[str] = []
        while launcher.poll() is None and last_step(self.run_dir) < 1:
            time.sleep(1)
        deadline = t0 + self.minutes * 60 if self.minutes else None
        since_step = last_step(self.run_dir)
        while launcher.poll() is None and len(self.done) < self.kills:
            if deadline is not None and time.monotonic() > deadline:
                break
            if self.max_steps and last_step(self.run_dir) >= 0.9 * self.max_steps:
                print(
                    "chaos: the run is in its last 10% of steps: no more kills (each one's restart is "
                    "to be seen before the end)",
                    flush=True,
                )
                break
            wait = rng.uniform(*self.gap_s)
            end = time.monotonic() + wait
            while launcher.poll() is None and (
                time.monotonic() < end or last_step(self.run_dir) <= since_step
            ):
                time.sleep(0.5)  # the gap, and a learner step since the last kill
            if launcher.poll() is not None:
                break
            if not order:
                order = rng.sample(self.kinds, len(self.kinds))
            kind = order.pop()
            target, sig = FAULTS[kind]
            pids = processes(launcher.pid)[target]
            if not pids:
                print(f"chaos: no {kind} process to kill now; skipped", flush=True)
                continue
            pid = rng.choice(pids)
            step = last_step(self.run_dir)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            since_step = step
            self.done.append(
                {"kind": kind, "pid": pid, "at_s": round(time.monotonic() - t0, 1), "step": step}
            )
            print(
                f"chaos: kill {len(self.done)}/{self.kills}: {sig.name} {kind} pid {pid} at step {step} "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )

    def _verdict(self, code: int, wall_s: float, lines: list[str]) -> dict[str, Any]:
        def read(name: str) -> dict[str, Any]:
            try:
                return dict(json.loads((self.run_dir / name).read_text()))
            except (OSError, ValueError):
                return {}

        ledger, summary = read("ledger.json"), read("summary.json")
        report = read("report/report.json")
        config = read("config.resolved.json")
        max_steps = int(config.get("launcher", {}).get("max_steps", 0))
        steps = last_step(self.run_dir)
        by_kind: dict[str, int] = {}
        for kill in self.done:
            by_kind[kill["kind"]] = by_kind.get(kill["kind"], 0) + 1
        trained_twice = int(ledger.get("trained_in_audit_log", 0)) - int(ledger.get("distinct_trained", 0))
        checks = judge(code, max_steps, steps, ledger, summary.get("restarts", {}), by_kind)
        result = {
            "kills": len(self.done),
            "kills_by_kind": by_kind,
            "restarts": summary.get("restarts", {}),
            "learner_restarts": summary.get("learner_restarts", []),
            "longest_step_gap_s": (report.get("faults") or {}).get("longest_step_gap_s"),
            "groups_trained_twice": trained_twice,
            "ledger_problems": ledger.get("problems", ["no ledger"]),
            "last_step": steps,
            "exit_code": code,
            "wall_s": round(wall_s, 1),
            "checks": checks,
            "passed": all(checks.values()),
            "kill_log": self.done,
        }
        (self.run_dir / "chaos" / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"chaos: {len(self.done)} kills ({', '.join(f'{k} {n}' for k, n in sorted(by_kind.items()))}) in "
            f"{wall_s / 60:.1f} min; restarts {result['restarts']}; longest gap between learner steps "
            f"{_seconds(result['longest_step_gap_s'])}",
            flush=True,
        )
        for name, ok in checks.items():
            print(f"  [{'ok' if ok else 'FAIL'}] {name}", flush=True)
        if not result["passed"]:
            print("\n".join(lines[-40:]), flush=True)
        return result


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "n/a"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other argument goes to python -m deploy.launch (--config and its overrides).",
    )
    parser.add_argument(
        "--run.run_dir", dest="run_dir", required=True, help="the run directory (a fresh one)"
    )
    parser.add_argument("--kills", type=int, default=5, help="processes to kill (default 5)")
    parser.add_argument("--minutes", type=float, default=0, help="stop killing after this long (0: no limit)")
    parser.add_argument("--kinds", default=",".join(FAULTS), help=f"kinds to kill, of {', '.join(FAULTS)}")
    parser.add_argument("--gap-s", default="15,40", help="seconds between kills: MIN,MAX (default 15,40)")
    parser.add_argument("--max-steps", type=int, required=True, help="launcher.max_steps of the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print every line of the launcher's output")
    args, rest = parser.parse_known_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown or 'none given'}; choose from {', '.join(FAULTS)}")
    try:
        low, high = (float(x) for x in args.gap_s.split(","))
    except ValueError:
        parser.error(f"--gap-s must be MIN,MAX in seconds, got {args.gap_s!r}")
    if not 0 <= low <= high:
        parser.error(f"--gap-s: need 0 <= MIN <= MAX, got {args.gap_s!r}")
    run_dir = Path(args.run_dir)
    if (run_dir / "learner" / "steps.jsonl").exists():
        parser.error(f"{run_dir} holds a run already: chaos judges a fresh run; give a new --run.run_dir")
    launcher_args = [
        "--launcher.max_minutes",
        "0",
        *rest,
        "--launcher.max_steps",
        str(args.max_steps),
        "--launcher.max_restarts",
        str(max(args.kills, 1) + 2),
    ]
    if "learner_hang" in kinds and not any("collective_timeout_s" in a for a in rest):
        launcher_args = ["--learner.collective_timeout_s", str(HANG_TIMEOUT_S), *launcher_args]
    chaos = Chaos(
        run_dir, kinds, args.kills, args.minutes, (low, high), args.seed, args.max_steps, args.verbose
    )
    result = chaos.run(launcher_args)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
