"""Score a model on the run's validation sets: a saved checkpoint, the base model, or any hub id or directory.

    python -m deploy.eval --config deploy/presets/local.toml                    # the model the run starts from
    python -m deploy.eval --config deploy/presets/local.toml --checkpoint latest   # its newest checkpoint
    python -m deploy.eval --config run.toml --model Qwen/Qwen2.5-1.5B-Instruct [--sets gsm8k] [--out r.json]

The same code as evaluation during training (services/evaluator/, entry point ``offline.evaluate_model``): the
``[[evaluation.sets]]`` of the run file, the sampler's engine settings and chat template, the reward service's scorers. What it scores:

- ``--checkpoint PATH``: a learner checkpoint (a run directory: its newest; a checkpoint directory; one
  ``step<N>`` tag; or ``latest``: the newest of the run file's run directory), consolidated from its ZeRO-3
  shards into ``<run_dir>/exports/<tag>/`` once (services/learner/export.py), labelled with its version;
- ``--model M``: a hub id or a model directory;
- neither: the model the run starts from (``<run_dir>/config.resolved.json``'s model, e.g. the warm-started
  one; without it, ``run.model`` or the tiny model).

Prints one line per set and writes the results as JSON (``--out``, default ``<run_dir>/eval/<label>.json``).
Exit codes: 0 done, 2 bad configuration or arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from deploy.config import SystemConfig, section
from services.common.config import ConfigError, add_config_arguments, config_from_args
from services.sampler.config import SamplerServiceConfig

log = logging.getLogger("vcpo.eval")


def start_model(cfg: SystemConfig) -> str:
    """The model the run starts from: the resolved config's (the launcher's choice, warm start included)."""
    resolved = cfg.run.run_dir / "config.resolved.json"
    if resolved.is_file():
        model = json.loads(resolved.read_text()).get("run", {}).get("model", "")
        if model:
            return str(model)
    from services.common.tiny_model import run_model

    return run_model(cfg.run)


def resolve_target(
    cfg: SystemConfig, model: str, checkpoint: str
) -> tuple[str, str, int | None, dict[str, Any]]:
    """``(model path or id, label, policy version or None, description)`` of what is to be scored."""
    if model and checkpoint:
        raise ValueError("give --model or --checkpoint, not both")
    if checkpoint:
        from services.learner.export import export_checkpoint, find_checkpoint

        tag = find_checkpoint(cfg.run.run_dir if checkpoint == "latest" else checkpoint)
        # config, tokenizer and tensor shapes (unchanged by training), and a LoRA checkpoint's base weights
        base = start_model(cfg)
        exported = export_checkpoint(tag, base, cfg.run.run_dir / "exports" / tag.name)
        about = {"checkpoint": str(exported.checkpoint), "step": exported.step, "model": str(exported.path)}
        return str(exported.path), tag.name, exported.version, about
    if model:
        return model, Path(model).name or model, None, {"model": model}
    path = start_model(cfg)
    return path, "base", None, {"model": path, "base": True}


def evaluate(cfg: SystemConfig, model: str, version: int | None, sets: list[str]) -> list[dict[str, Any]]:
    """One round of every selected set on ``model``; the records (``kind: eval``, ``where: command``)."""
    from services.evaluator.offline import evaluate_model

    scfg = section(cfg, SamplerServiceConfig)
    if sets:
        chosen = [s for s in scfg.evaluation.sets if s.name in sets]
        unknown = sorted(set(sets) - {s.name for s in chosen})
        if unknown:
            known = ", ".join(s.name for s in scfg.evaluation.sets) or "none"
            raise ValueError(f"unknown evaluation set(s) {', '.join(unknown)}; the run file has: {known}")
        scfg = scfg.model_copy(update={"evaluation": scfg.evaluation.model_copy(update={"sets": chosen})})
    if not scfg.evaluation.sets:
        raise ValueError("the run file has no [[evaluation.sets]] to score")

    def progress(done: int, total: int, seconds: float) -> None:
        print(
            f"  {done}/{total} responses generated ({seconds:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    return evaluate_model(scfg, model, version, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="a hub id or model directory to score")
    parser.add_argument(
        "--checkpoint", default="", help="a run directory, checkpoint directory or step<N> tag"
    )
    parser.add_argument("--sets", default="", help="comma-separated set names (default: all of them)")
    parser.add_argument("--out", default="", help="where to write the JSON results")
    add_config_arguments(parser, SystemConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(SystemConfig, args)
        model, label, version, about = resolve_target(cfg, args.model, args.checkpoint)
        sets = [name.strip() for name in args.sets.split(",") if name.strip()]
        t0 = time.monotonic()
        records = evaluate(cfg, model, version, sets)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else cfg.run.run_dir / "eval" / f"{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {**about, "label": label, "version": version, "seconds": time.monotonic() - t0, "sets": records}
    out.write_text(json.dumps(result, indent=2) + "\n")
    what = f"{label} (version {version})" if version is not None else label
    for r in records:
        print(
            f"{what}: {r['set']} mean@{r['n']} {r['mean_at_n']:.4f} pass@{r['n']} {r['pass_at_n']:.4f} "
            f"reward {r['reward_mean']:.4f} ({r['tasks']} tasks, {r['failed_scores']} failed scores"
            + (f", {r['failed_episodes']} failed episodes)" if r["failed_episodes"] else ")")
        )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
