"""Stability under policy lag, with and without VCPO, in miniature (docs/research/vcpo.md §7).

The paper reports that VCPO trains stably up to a lag of k = 128 versions while unstabilised asynchronous
runs collapse, with collapse announced by falling ESS and gradient-norm spikes. This experiment asks the
same question of our learner on a task the tiny built-in model learns on CPU: ``builtin:digit_add`` after
the local preset's supervised warm start.

What runs (every cell of the grid, for every seed):

    seed ─► TinyModelSpec(seed) ─► warm start (launcher.warm_start_* of the preset) ─► experiments.replay:
            `steps` learner steps of the local preset (4 prompts x 8 responses, lr 3e-4, clip 1.0, AdamW)
            on rollouts sampled by the policy k versions old, with its true behaviour log-probs
            └─ every `eval_every` steps: the learner's current policy sampled on the 80 train prompts

It is an **in-process replay, not the full system**: the sampler, reward service, learner step and version
bookkeeping are the real code, but Redis, gRPC, Ray, vLLM and DeepSpeed are left out, because the full
system runs ~2.5 steps/s on two cores with its lag set by throughput, so a few hundred steps at k = 128 for
5 methods and several seeds would take many hours; here the lag is exact and the default grid (5 methods x
5 k x 3 seeds x 400 steps, 2 workers of 1 thread) took 31.5 minutes on 2 cores.

Lag: every step of a cell with bound k learns from rollouts exactly k versions old (``min(t, k)`` before
step k, when only version 0 exists, as at the real system's start). That is the worst staleness the bound
allows, and what a saturated asynchronous run shows (the local run's progress line reads "lag 4.0 (max 4)":
the samplers run ahead until the bound stops them); the paper's runs have lag *up to* k, so this is the
harder setting. k = 0 is synchronous (on-policy: every ℓ_i = 0 to round-off).

Methods, as ``[learner]`` fields (on top of the preset's table; the rest at their defaults:
loss_aggregation seq-mean-token-mean, std_normalize true, ppo_clip 0):

    no-correction  objective grpo, importance_weighting none,      ess_rule off   (stale treated as on-policy)
    tis            objective grpo, importance_weighting truncated, ess_rule off, truncation 8
    mis            objective grpo, importance_weighting masked,    ess_rule off, truncation 8
    vcpo-paper     objective vcpo, importance_weighting truncated, ess_rule sqrt, rho_base 1, truncation 8,
                   baseline_weighting paper
    vcpo-exact     as vcpo-paper with baseline_weighting exact

Ablations, not in the default grid (``--methods``): ``vcpo-paper-no-ess`` (vcpo-paper with ess_rule off: the
OPOB baseline alone) and ``tis-with-ess`` (tis with ess_rule sqrt, rho_base 1: the ESS step size alone).

Any other objective runs without an edit here: ``--objectives NAME,...`` adds a method per registered
objective (named after it: the preset's ``[learner]`` table with ``objective = NAME``), and ``--method
NAME=TABLE`` one whose ``[learner]`` fields are a TOML inline table (e.g. its ``objective_settings``); both
are added to ``--methods``, validated as the learner validates them before anything runs (``--dry-run`` stops
there and prints them). Every method runs with ``num_ranks = 1``: the replay is one learner process.

Recorded per step (``runs.jsonl``): training reward (of the behaviour policy), ESS ratio ρ, LR scale,
pre-clip gradient norm, loss, log-weight max/min/median, fraction truncated, OPOB shift, |Â| mean,
zero-signal groups, mean response length, skipped steps, seconds, the objective's own metrics; and the
evaluation reward at eval steps.
The table, collapse rule and plots: ``experiments/stability_report.py``.

    python experiments/stability.py [--quick] [--out DIR] [--seeds 0,1,2] [--ks 0,4,16,64,128]
                                    [--methods ...] [--objectives ...] [--method NAME=TABLE] [--dry-run]
                                    [--steps N] [--workers 2] [--resume] [--report-only]

Results go to runs/stability unless ``--out`` says otherwise; the committed ones (docs/results/stability)
are rewritten only by naming them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import tomllib
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments import stability_report

PRESET = "deploy/presets/local.toml"
DATASET = "builtin:digit_add"  # what the results in docs/results/stability were measured on (the local preset
# trained on it then; it now trains on builtin:tail_add, whose held-out split improves with RL)
METHODS: dict[str, dict[str, Any]] = {
    "no-correction": {"objective": "grpo", "importance_weighting": "none", "ess_rule": "off"},
    "tis": {"objective": "grpo", "importance_weighting": "truncated", "truncation": 8.0, "ess_rule": "off"},
    "mis": {"objective": "grpo", "importance_weighting": "masked", "truncation": 8.0, "ess_rule": "off"},
    "vcpo-paper": {
        "objective": "vcpo",
        "importance_weighting": "truncated",
        "truncation": 8.0,
        "ess_rule": "sqrt",
        "rho_base": 1.0,
        "baseline_weighting": "paper",
    },
    "vcpo-exact": {
        "objective": "vcpo",
        "importance_weighting": "truncated",
        "truncation": 8.0,
        "ess_rule": "sqrt",
        "rho_base": 1.0,
        "baseline_weighting": "exact",
    },
}
# Not in the default grid: ablations that split VCPO into its two halves (ESS step size, OPOB baseline)
ABLATIONS: dict[str, dict[str, Any]] = {
    "vcpo-paper-no-ess": {**METHODS["vcpo-paper"], "ess_rule": "off"},  # OPOB + TIS, undamped step
    "tis-with-ess": {**METHODS["tis"], "ess_rule": "sqrt", "rho_base": 1.0},  # group mean + TIS, damped step
}
KNOWN = {**METHODS, **ABLATIONS}
KS = (0, 4, 16, 64, 128)
FULL: dict[str, Any] = {"seeds": (0, 1, 2), "steps": 400, "eval_every": 10, "window": 50, "eval_samples": 2}
QUICK: dict[str, Any] = {
    "seeds": (0,),
    "steps": 8,
    "eval_every": 4,
    "window": 4,
    "eval_samples": 1,
    "ws_steps": 30,
    "methods": ("no-correction", "vcpo-paper"),
    "ks": (0, 16),
    "eval_prompts": 16,
}
RUNS_FILE = "runs.jsonl"


@dataclass(frozen=True)
class Plan:
    """Everything that determines one run's numbers (with its method, k and seed)."""

    preset: str
    dataset: str
    steps: int
    eval_every: int
    eval_samples: int
    eval_prompts: int  # 0: every train prompt
    ws_steps: int
    ws_lr: float
    ws_batch: int
    threads: int
    work_dir: str


def load_preset(path: str) -> Any:
    """The preset as the launcher validates it (no environment layer: the numbers must not drift)."""
    from deploy.config import SystemConfig
    from services.common.config import load_config

    return load_config(SystemConfig, [path], env={})


def learner_config(preset: Any, method: str, fields: Mapping[str, Any] | None = None) -> Any:
    """The preset's ``[learner]`` table with ``method``'s fields (``fields``, else the named method's),
    validated as the learner validates it; one rank, as the replay is one learner process."""
    from services.learner.config import LearnerConfig

    fields = KNOWN[method] if fields is None else fields
    return LearnerConfig.model_validate({**preset.learner.model_dump(), "num_ranks": 1, **fields})


def method_fields(
    methods: list[str], objective_names: list[str], defined: list[str]
) -> dict[str, dict[str, Any]]:
    """Each method of the grid and its ``[learner]`` fields: the named ones (``--methods``), one per objective
    (``--objectives``, named after it), then the ones defined as ``NAME=TABLE`` (``--method``)."""
    from services.learner import objectives

    grid: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method not in KNOWN:
            raise SystemExit(f"unknown method {method!r}; known: {list(KNOWN)} (an objective: --objectives)")
        grid[method] = KNOWN[method]
    for name in objective_names:
        if name not in objectives.NAMES:
            raise SystemExit(
                f"--objectives: unknown objective {name!r}; registered: {list(objectives.NAMES)}"
            )
        if name in KNOWN:
            raise SystemExit(f"--objectives: {name!r} is also a method's name; define it with --method")
        grid[name] = {"objective": name}
    for definition in defined:
        name, sep, table = definition.partition("=")
        name = name.strip()
        try:
            fields = tomllib.loads(f"fields = {table}")["fields"] if sep and name else None
        except tomllib.TOMLDecodeError as e:
            raise SystemExit(
                f"--method {definition!r}: the fields are not a TOML inline table ({e})"
            ) from None
        if not isinstance(fields, dict):
            raise SystemExit(f"--method {definition!r}: write NAME={{field = value, ...}} ([learner] fields)")
        if name in KNOWN or name in grid:
            raise SystemExit(f"--method: {name!r} is already a method of the grid")
        grid[name] = fields
    return grid


def warm_started(plan: Plan, seed: int) -> Path:
    """The warm-started model of ``seed`` (built once per work dir; warm_start is idempotent)."""
    from services.common.tiny_model import TinyModelSpec, build_tiny_model
    from services.learner.warm_start import warm_start

    work = Path(plan.work_dir)
    base = build_tiny_model(work / f"base{seed}", TinyModelSpec(seed=seed))
    return warm_start(
        base,
        work / f"ws{seed}-{plan.ws_steps}",
        plan.dataset,
        steps=plan.ws_steps,
        lr=plan.ws_lr,
        batch_size=plan.ws_batch,
        seed=seed,
        threads=plan.threads,
    )


def run_one(plan: Plan, method: str, fields: dict[str, Any], k: int, seed: int) -> dict[str, Any]:
    """One (method, k, seed) run of ``method``'s ``[learner]`` fields: per-step records and the evaluation
    rewards (in a worker process)."""
    import torch
    from transformers.utils import logging as hf_logging

    from experiments.replay import Replay, ReplaySettings
    from services.common.datasets import load_dataset
    from services.learner.vcpo import objective_config

    torch.set_num_threads(plan.threads)
    hf_logging.disable_progress_bar()
    started = time.monotonic()
    preset = load_preset(plan.preset)
    # the preset's lr_decay is left out (a constant rate) so that only the lag differs between cells
    settings = ReplaySettings.from_preset(preset)
    config = objective_config(learner_config(preset, method, fields))
    replay = Replay(warm_started(plan, seed), plan.dataset, config, seed=seed, lag=k, settings=settings)
    tasks = load_dataset(plan.dataset, split="train", seed=seed)[: plan.eval_prompts or None]

    def evaluate(step: int) -> float:  # the same prompts and random stream for every cell at a step
        return replay.evaluate(tasks, n_samples=plan.eval_samples, seed=seed * 1_000_003 + step)

    evals = [(0, evaluate(0))]
    records: list[dict[str, float]] = []
    for t in range(1, plan.steps + 1):
        records.append(replay.step())
        if t % plan.eval_every == 0 or t == plan.steps:
            evals.append((t, evaluate(t)))
    # 4 significant digits keep runs.jsonl small enough to live beside the report
    series = {key: [float(f"{r[key]:.4g}") for r in records] for key in records[0] if key != "step"}
    return {
        "method": method,
        "k": k,
        "seed": seed,
        "fields": fields,
        "steps": series,
        "evals": evals,
        "seconds": time.monotonic() - started,
    }


def _csv(text: str | None, kind: type, default: tuple[Any, ...]) -> list[Any]:
    return [kind(part) for part in text.split(",")] if text else list(default)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 methods x k in {0, 16} x 1 seed x 8 steps")
    parser.add_argument(
        "--out",
        default="runs/stability",
        help="where the results are written (runs/stability; the committed ones: --out docs/results/stability)",
    )
    parser.add_argument("--preset", default=PRESET, help="the run file whose hyperparameters are replayed")
    parser.add_argument("--methods", help=f"comma-separated, of {list(KNOWN)} (default {list(METHODS)})")
    parser.add_argument(
        "--objectives",
        help="comma-separated registered objectives, each added as a method named after it (the preset's "
        "[learner] table with that objective)",
    )
    parser.add_argument(
        "--method",
        action="append",
        default=[],
        metavar="NAME=TABLE",
        help="add a method whose [learner] fields are a TOML inline table, e.g. "
        "'mine={objective = \"mine\", objective_settings = {temperature = 2.0}}' (repeatable)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and print every method's fields and the grid; run nothing",
    )
    parser.add_argument("--ks", help=f"lag bounds (default {','.join(map(str, KS))})")
    parser.add_argument("--seeds", help="run seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, help=f"learner steps per run (default {FULL['steps']})")
    parser.add_argument("--eval-every", type=int, help=f"steps between evaluations ({FULL['eval_every']})")
    parser.add_argument("--eval-samples", type=int, help="samples per train prompt in an evaluation (2)")
    parser.add_argument(
        "--window", type=int, help=f"final reward: evaluations in the last W steps ({FULL['window']})"
    )
    parser.add_argument("--ws-steps", type=int, help="warm-start steps (default: the preset's)")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--work-dir", default="/tmp/vcpo-stability", help="models and warm starts (reused)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in OUT/runs.jsonl")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from runs.jsonl")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "experiments/stability.py", *(sys.argv[1:] if argv is None else argv)])
    mode = {**FULL, **(QUICK if args.quick else {})}
    preset = load_preset(args.preset)
    grid = method_fields(
        _csv(args.methods, str, mode.get("methods", tuple(METHODS))),
        _csv(args.objectives, str, ()),
        args.method,
    )
    methods = list(grid)
    for method, fields in grid.items():  # a bad field or setting fails here, not in a worker hours later
        try:
            learner_config(preset, method, fields)
        except ValueError as e:
            raise SystemExit(f"method {method!r} ({fields}): {e}") from None
    ks, seeds = _csv(args.ks, int, mode.get("ks", KS)), _csv(args.seeds, int, mode["seeds"])
    plan = Plan(
        preset=args.preset,
        dataset=DATASET,
        steps=args.steps or mode["steps"],
        eval_every=args.eval_every or mode["eval_every"],
        eval_samples=args.eval_samples or mode["eval_samples"],
        eval_prompts=mode.get("eval_prompts", 0),
        ws_steps=args.ws_steps or mode.get("ws_steps") or preset.launcher.warm_start_steps,
        ws_lr=preset.launcher.warm_start_lr,
        ws_batch=preset.launcher.warm_start_batch_size,
        threads=args.threads,
        work_dir=args.work_dir,
    )
    window = args.window or mode["window"]
    if args.dry_run:
        print(json.dumps({"methods": grid, "ks": ks, "seeds": seeds, "out": args.out, "plan": asdict(plan)}))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / RUNS_FILE
    header = {
        "plan": asdict(plan),
        "methods": methods,
        "ks": ks,
        "seeds": seeds,
        "window": window,
        "command": command,
    }
    if not args.report_only:
        run_grid(plan, grid, ks, seeds, runs_path, header, workers=args.workers, resume=args.resume)
    figures = stability_report.write_report(
        out, runs_path, window=window, grid=(methods, ks, seeds), command=command
    )
    print(json.dumps(figures))


def run_grid(
    plan: Plan,
    methods: dict[str, dict[str, Any]],
    ks: list[int],
    seeds: list[int],
    runs_path: Path,
    header: dict[str, Any],
    *,
    workers: int,
    resume: bool,
) -> None:
    """Run every (method, k, seed) not already in ``runs_path`` (with ``resume``), appending each as it ends;
    ``methods``: each method's ``[learner]`` fields.

    Seed-major order, so a run stopped early has whole grids for its first seeds."""
    done: set[tuple[str, int, int]] = set()
    if resume and runs_path.exists():
        before = stability_report.read_header(runs_path)
        if before["plan"] != header["plan"]:
            raise SystemExit(f"--resume: {runs_path} was made with a different plan: {before['plan']}")
        kept = stability_report.read_runs(runs_path)
        for run in kept:  # a method defined on the command line may mean other fields than last time
            if run["method"] in methods and run["fields"] != methods[run["method"]]:
                raise SystemExit(
                    f"--resume: {runs_path} holds method {run['method']!r} with the fields {run['fields']}, "
                    f"not {methods[run['method']]}; name the new one differently"
                )
        done = {(run["method"], run["k"], run["seed"]) for run in kept}
    else:
        runs_path.write_text(json.dumps({"header": header}) + "\n")
    todo = [(m, k, s) for s in seeds for k in ks for m in methods if (m, k, s) not in done]
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("spawn")) as pool:
        for warm in as_completed([pool.submit(warm_started, plan, seed) for seed in seeds]):
            warm.result()  # one warm start per seed, in parallel, before any run needs it
        futures = [pool.submit(run_one, plan, m, methods[m], k, s) for m, k, s in todo]
        for i, future in enumerate(as_completed(futures), 1):
            run = future.result()
            run["command"] = header["command"]
            with runs_path.open("a") as fh:
                fh.write(json.dumps(run) + "\n")
            final = run["evals"][-1][1]
            print(
                f"[{time.monotonic() - started:7.0f}s] {i}/{len(todo)} {run['method']:<13} k={run['k']:<3} "
                f"seed {run['seed']}: eval reward {run['evals'][0][1]:.3f} -> {final:.3f}, "
                f"{run['seconds']:.0f}s",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    main()
