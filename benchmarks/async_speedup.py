"""What asynchrony buys: wall time of the same learner steps at k = 0 and k = 4, against the ideal overlap bound.

The whole system is launched twice on the same preset (``python -m deploy.launch``, one run after the other,
each with its own local Ray, Redis and run directory): once synchronous (``--k 0``: a sampler may only start
the groups of the version it holds, so sampling, scoring and training take turns) and once asynchronous
(``--k 4``: sampling runs up to four versions ahead while the learner trains). Both run the same number of
learner steps; every port is a free one, so a run never collides with another on the machine.

What is measured, from the files each run leaves (not from start-up, which is most of a short run):

    window       time of step N's line in learner/steps.jsonl − time of step 1's line: steps 2..N, so start-up,
                 the first rollouts and step 1's warm-up are left out; per-step wall = window / (N − 1)
    busy, per step, of each service (summary.json covers the whole run, so each is normalised per group):
      sampler    seconds in vLLM engine steps × groups_per_step / groups started (emitted + aborted; an aborted
                 group counts whole, so this leans low) / sampler replicas
      reward     seconds scoring and forwarding × groups_per_step / groups scored (one replica's figures)
      learner    mean of timings.step_s + timings.publish_s over steps 2..N

    ideal_speedup           = sync per-step wall / the busiest service's per-step busy in the sync run
                              (taking turns, a step costs about the sum of the busy times; with perfect
                              overlap it would cost the busiest one's)
    async_over_sync_speedup = sync per-step wall / async per-step wall
    fraction_of_ideal       = async_over_sync_speedup / ideal_speedup  (target >= 0.8)

On a machine with few cores (the 2-core development box) the services compete for the same cores: while the
learner's ranks train, a sampler generating the next groups slows them down and is slowed in turn, so part of
the overlap the busy times promise is not there to be had. The figure is what the system gets, not tuned.
The async run can also beat the bound: its sampler batches more groups per engine step than the sync one.

    python benchmarks/async_speedup.py [--quick] [--preset deploy/presets/local.toml] [--steps 30]
                                       [--k-async 4] [--out DIR] [--SECTION.KEY VALUE ...]

Any other ``--section.key value`` pair is a launcher override given to both runs alike. The busy-time bound
assumes every service has its own hardware, as on a cluster (a GPU per sampler and per learner rank); on the
2-core box ``--learner.num_ranks 1`` gives the sampler and the learner a core each, which measures the overlap
the system achieves rather than the cores' contention (the default preset's two learner ranks and the sampler
share two cores).

Prints each run's progress, then a table, then as its last line one JSON object with the headline figures.
Exits non-zero if a run fails, stops short of its steps or its ledger does not balance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PORTS = (
    "sampler.grpc_port",
    "sampler.metrics_port",
    "reward.grpc_port",
    "reward.metrics_port",
    "learner.grpc_port",
    "learner.metrics_port",
    "weight_broker.grpc_port",
    "weight_broker.data_port",
    "weight_broker.metrics_port",
)
SERVICES = ("sampler", "reward", "learner")
# lines of a failed run's launch.log put in its error (its run directory may be a temporary one)
LOG_TAIL = 60
SHOWN = ("  [ok]", "stopping", "report:")  # the launcher's lines worth showing (besides progress), not Ray's


@dataclass
class Run:
    k: int
    steps: int
    launch_s: float  # the launcher process, start-up and shutdown included
    window_s: float
    step_s: float
    busy: dict[str, float]  # service -> per-step busy seconds
    reward_mean: float
    lag_mean: float
    aborted: int


def launch(
    preset: Path,
    run_dir: Path,
    k: int,
    steps: int,
    extra: list[str],
    timeout_s: float,
    evaluation: bool = False,
) -> float:
    """One launcher run to ``steps`` learner steps; its output goes to ``<run_dir>/launch.log`` and its
    progress lines to the screen. Held-out evaluation is left out unless ``evaluation`` (it holds versions
    back: not what a step-time comparison of k is about). Returns the process's wall seconds."""
    run_dir.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "deploy.launch",
        "--config",
        str(preset),
        "--run.run_dir",
        str(run_dir),
        "--k",
        str(k),
        "--launcher.max_steps",
        str(steps),
        "--launcher.max_minutes",
        "0",
        *(arg for port in PORTS for arg in (f"--{port}", "0")),
        *([] if evaluation else ["--set", "evaluation.sets=[]"]),
        *extra,
    ]
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=LOG_TAIL)  # the log's last lines, kept as they pass
    with (run_dir / "launch.log").open("w") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        # past the deadline: Ctrl-C (the launcher stops every service and Ray), then SIGKILL if that hangs
        timers = [
            threading.Timer(timeout_s, _signal, (proc, signal.SIGINT)),
            threading.Timer(timeout_s + 300, _signal, (proc, signal.SIGKILL)),
        ]
        for timer in timers:
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail.append(line)
                if "s] step " in line or line.startswith(SHOWN):
                    print(f"  k={k} {line.rstrip()}", flush=True)
            code = proc.wait()
        except BaseException:
            _signal(proc, signal.SIGINT)
            proc.wait(300)
            raise
        finally:
            for timer in timers:
                timer.cancel()
    elapsed = time.monotonic() - t0
    if code != 0:
        why = "its ledger did not balance" if code == 3 else f"exit code {code}"
        raise RuntimeError(
            f"the k={k} run failed ({why}; {elapsed:.0f}s); the end of {run_dir / 'launch.log'}:\n"
            + "".join(tail)
        )
    return elapsed


def _signal(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)  # the launcher's own process group (start_new_session)


def read_steps(path: Path) -> dict[int, dict[str, Any]]:
    """The learner's audit log; a step redone after a restart appears again, and its last line wins."""
    steps: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        steps[int(record["step"])] = record
    return steps


def logged_steps(run_dir: Path, steps: int, what: str) -> dict[int, dict[str, Any]]:
    """The run's audit log, which must hold steps 1..``steps``; ``what`` names the run in the error."""
    log = read_steps(run_dir / "learner" / "steps.jsonl")
    if sorted(log)[:steps] != list(range(1, steps + 1)):
        raise RuntimeError(f"the {what} run logged steps {sorted(log)}, not 1..{steps}; see {run_dir}")
    return log


def launch_arguments(parser: argparse.ArgumentParser, steps_help: str) -> None:
    """The options every launcher benchmark takes (--quick, --preset, --steps, --out, --timeout)."""
    parser.add_argument(
        "--quick", action="store_true", help="a small run (a few minutes: start-up dominates)"
    )
    parser.add_argument("--preset", type=Path, default=ROOT / "deploy" / "presets" / "local.toml")
    parser.add_argument("--steps", type=int, default=0, help=steps_help)
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the run directories here (default: a temp dir)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds one run may take before it is stopped"
    )


def parse_with_overrides(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The parsed options and the rest, which must be ``--section.key value`` launcher overrides."""
    args, overrides = parser.parse_known_args()
    bad = [arg for arg in overrides[::2] if not (arg.startswith("--") and "." in arg)]
    if bad or len(overrides) % 2:
        parser.error(
            f"unrecognised arguments {overrides}: launcher overrides come as --section.key value pairs"
        )
    return args, overrides


QUICK_OVERRIDES = ["--launcher.warm_start_steps", "0"]  # --quick: no supervised warm start


def run_overrides(args: argparse.Namespace, overrides: list[str], quick: Sequence[str] = ()) -> list[str]:
    """The launcher overrides every run of a benchmark is given: under --quick, no warm start and ``quick``
    (the benchmark's own), then the user's ``overrides``, which come last and so win."""
    return [*QUICK_OVERRIDES, *quick, *overrides] if args.quick else list(overrides)


def measure(run_dir: Path, k: int, steps: int, launch_s: float) -> Run:
    log = logged_steps(run_dir, steps, f"k={k}")
    window = [log[s] for s in range(2, steps + 1)]
    window_s = log[steps]["time"] - log[1]["time"]
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = json.loads((run_dir / "config.resolved.json").read_text())
    gps = cfg["run"]["groups_per_step"]
    samplers, reward = summary.get("samplers"), summary.get("reward")
    if not samplers or not reward:
        raise RuntimeError(f"the k={k} run's summary.json has no sampler or reward figures: {list(summary)}")
    aborted = sum(sum(s["groups_aborted"].values()) for s in samplers)
    started = sum(s["groups_emitted"] for s in samplers) + aborted
    busy = {
        "sampler": sum(s["busy_seconds"] for s in samplers) * gps / started / len(samplers),
        "reward": reward["busy_seconds"] * gps / reward["groups_scored"],
        "learner": statistics.fmean(r["timings"]["step_s"] + r["timings"]["publish_s"] for r in window),
    }
    return Run(
        k=k,
        steps=steps,
        launch_s=launch_s,
        window_s=window_s,
        step_s=window_s / (steps - 1),
        busy=busy,
        reward_mean=statistics.fmean(float(r["reward_mean"]) for r in window),
        lag_mean=statistics.fmean(float(lag) for r in window for lag in r["lags"]),
        aborted=aborted,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch_arguments(parser, "learner steps per run (default 30; quick: 8)")
    parser.add_argument("--k-async", type=int, default=4, help="k of the asynchronous run")
    args, overrides = parse_with_overrides(parser)
    steps = args.steps or (8 if args.quick else 30)
    if steps < 3:
        parser.error(f"--steps {steps}: need at least 3 (the window is steps 2..N)")
    if args.k_async < 1:
        parser.error(f"--k-async {args.k_async}: the asynchronous run needs k >= 1")
    extra = run_overrides(args, overrides)

    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for k in (0, args.k_async):  # one after the other: two runs at once would share the cores
            run_dir = out / f"k{k}"
            print(f"k={k}: {steps} steps on {args.preset}, run directory {run_dir}", flush=True)
            launch_s = launch(args.preset.resolve(), run_dir, k, steps, extra, args.timeout)
            runs.append(measure(run_dir, k, steps, launch_s))

    sync, fast = runs
    busiest = max(SERVICES, key=lambda s: sync.busy[s])
    ideal = sync.step_s / sync.busy[busiest]
    speedup = sync.step_s / fast.step_s
    fraction = speedup / ideal
    shown = f" with {' '.join(overrides)}" if overrides else ""
    print(
        f"\npreset {args.preset}{shown}, {steps} learner steps per run; window = step 1's line to step {steps}'s "
        f"(steps 2..{steps}: start-up and step 1 left out); seconds per step unless marked"
    )
    print(
        f"{'run':<6}{'k':>3}{'launch_s':>10}{'window_s':>10}{'step_s':>8}{'sampler':>9}{'reward':>8}"
        f"{'learner':>9}{'busy_sum':>10}{'aborted':>9}{'reward':>8}{'lag':>6}"
    )
    for name, r in (("sync", sync), ("async", fast)):
        print(
            f"{name:<6}{r.k:>3}{r.launch_s:>10.1f}{r.window_s:>10.2f}{r.step_s:>8.3f}{r.busy['sampler']:>9.3f}"
            f"{r.busy['reward']:>8.3f}{r.busy['learner']:>9.3f}{sum(r.busy.values()):>10.3f}{r.aborted:>9}"
            f"{r.reward_mean:>8.3f}{r.lag_mean:>6.2f}"
        )
    print(
        "busy: sampler = engine-step s x groups_per_step / groups started (aborted counted whole) / replicas;"
        " reward = scoring s x groups_per_step / groups scored; learner = step_s + publish_s"
    )
    print(
        f"ideal speedup: sync step {sync.step_s:.3f}s / busiest sync service ({busiest}) "
        f"{sync.busy[busiest]:.3f}s = {ideal:.2f}"
    )
    print(f"async (k={args.k_async}) over sync speedup: {speedup:.2f}")
    print(f"fraction of ideal: {fraction:.2f} (target >= 0.8)")
    figures = {
        "async_over_sync_speedup": speedup,
        "ideal_speedup": ideal,
        "fraction_of_ideal": fraction,
        "sync_step_s": sync.step_s,
        "async_step_s": fast.step_s,
        "steps": steps,
        "k_async": args.k_async,
        "busiest_sync_service": busiest,
        "overrides": " ".join(overrides),
        "sync_busy_s": sync.busy,
        "async_busy_s": fast.busy,
        "reward_mean": {"sync": sync.reward_mean, "async": fast.reward_mean},
    }
    print(json.dumps(_rounded(figures)))


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) and math.isfinite(value) else value


if __name__ == "__main__":
    main()
