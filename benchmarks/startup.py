"""Start-up: the learner, the reward app and the samplers side by side (the default) against one after the other.

The local preset is launched in turns with ``launcher.sequential_start`` false and true (``python -m
deploy.launch``, each run with its own local Ray, Redis and run directory, every port a free one), each run to
``--steps`` learner steps. The launcher prints when each service is up, on its own clock; from its lines:

    services_s    from "[ok] weight_broker" to "[ok] samplers" (every replica generating): the stretch the
                  setting changes (the learner's ranks and DeepSpeed, the reward app, vLLM's engines)
    ready_s       from the launcher's start to "[ok] samplers"
    side_by_side_over_sequential   median services_s side by side / median services_s sequential

The runs alternate (sequential, side by side, sequential, ...), so a machine that slows down part-way weighs
on both alike. On the 2-core development box the services' start-ups compete for the cores, so they overlap
less than on a cluster, where each has its own GPUs and CPUs and waits mostly on loading weights.

    python benchmarks/startup.py [--quick] [--repeats 3] [--steps 3] [--out DIR] [--SECTION.KEY VALUE ...]

Any other ``--section.key value`` pair is a launcher override given to every run alike. Prints each run's
start-up lines, then a table, then as its last line one JSON object with the figures. Exits non-zero if a run
fails or its ledger does not balance.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.async_speedup import (
    _rounded,
    launch,
    launch_arguments,
    parse_with_overrides,
    run_overrides,
)

_UP = re.compile(r"^  \[ok\] (\S+)\s.*\((\d+(?:\.\d+)?)s\)$")


def up_times(log: Path) -> dict[str, float]:
    """When each service was first said to be up, in seconds on the launcher's clock."""
    times: dict[str, float] = {}
    for line in log.read_text().splitlines():
        m = _UP.match(line)
        if m and m.group(1) not in times:
            times[m.group(1)] = float(m.group(2))
    missing = [name for name in ("weight_broker", "learner", "reward", "samplers") if name not in times]
    if missing:
        raise RuntimeError(f"{log}: no start-up line for {', '.join(missing)}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch_arguments(parser, "learner steps per run (default 3)")
    parser.add_argument("--repeats", type=int, default=0, help="runs of each mode (default 3; quick: 1)")
    args, overrides = parse_with_overrides(parser)
    steps = args.steps or 3
    repeats = args.repeats or (1 if args.quick else 3)
    if steps < 1 or repeats < 1:
        parser.error("need --steps >= 1 and --repeats >= 1")
    extra = run_overrides(args, overrides)

    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for n in range(repeats):
            for sequential in (True, False):
                name = "sequential" if sequential else "side-by-side"
                run_dir = out / f"{name}-{n}"
                print(f"{name} run {n + 1} of {repeats}: {steps} steps, run directory {run_dir}", flush=True)
                setting = ["--launcher.sequential_start", str(sequential).lower()]
                launch(args.preset.resolve(), run_dir, 4, steps, setting + extra, args.timeout)
                times = up_times(run_dir / "launch.log")
                runs[sequential].append(
                    {
                        "services_s": times["samplers"] - times["weight_broker"],
                        "ready_s": times["samplers"],
                        "learner_s": times["learner"] - times["weight_broker"],
                    }
                )

    def median(sequential: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[sequential])

    print(f"\npreset {args.preset}, {repeats} run(s) of each mode, {steps} steps each; seconds (medians)")
    print(f"{'mode':<14}{'services_s':>12}{'ready_s':>10}{'learner_s':>11}")
    for sequential in (True, False):
        name = "sequential" if sequential else "side-by-side"
        print(
            f"{name:<14}{median(sequential, 'services_s'):>12.1f}{median(sequential, 'ready_s'):>10.1f}"
            f"{median(sequential, 'learner_s'):>11.1f}"
        )
    ratio = median(False, "services_s") / median(True, "services_s")
    print(f"side by side over sequential (broker up -> samplers generating): {ratio:.2f}")
    figures = {
        "side_by_side_over_sequential": ratio,
        "services_s": {"sequential": median(True, "services_s"), "side_by_side": median(False, "services_s")},
        "ready_s": {"sequential": median(True, "ready_s"), "side_by_side": median(False, "ready_s")},
        "repeats": repeats,
        "steps": steps,
        "overrides": " ".join(overrides),
    }
    print(json.dumps(_rounded(figures)))


if __name__ == "__main__":
    main()
