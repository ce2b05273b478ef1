"""The main job: bring a run up from one config file (``make run``).

Today this starts what exists of the system and says plainly what does not yet:

    config (TOML + env + flags) ──► resolved config in <run_dir>/config.resolved.json
    Redis (run.redis_url, or a local redis-server on a free port, append-only file in <run_dir>/redis)
      └─► the run's streams and consumer groups: tasks, rollouts, scored (queues), weights (log)
    policy model (run.model, or the tiny Qwen2 model built into <run_dir>/model)
    services: weight broker, learner, sampler, reward, and the Ray launcher that places them
      └─► each is started once its implementation exists; until then it is listed as missing

    python -m deploy.launch --config deploy/presets/local.toml [--run.k 8 ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time

from deploy.config import SystemConfig
from services.common.config import ConfigError, add_config_arguments, config_from_args, write_resolved
from services.common.redis_server import LocalRedis
from services.common.streams import StreamConsumer, connect, stream_specs

log = logging.getLogger("vcpo.launch")

# component -> (module that runs it, the issue that builds it)
SERVICES = {
    "weight_broker": ("services.weight_broker.main", 4),
    "learner": ("services.learner.main", 5),
    "sampler": ("services.sampler.main", 6),
    "reward": ("services.reward.main", 7),
    "ray launcher": ("deploy.ray_launcher", 8),
}


def _step(name: str, detail: str, t0: float) -> None:
    print(f"  [ok]      {name:<14} {detail}  ({time.monotonic() - t0:.1f}s)", flush=True)


def prepare_model(cfg: SystemConfig) -> str:
    """Describe the policy: run.model as given, or the tiny model built (once) into the run directory."""
    if cfg.run.model:
        return cfg.run.model
    from services.common.tiny_model import TinyModelSpec, build_tiny_model, count_parameters

    path = build_tiny_model(cfg.run.run_dir / "model", TinyModelSpec(seed=cfg.run.seed))
    return f"{path} (tiny Qwen2, {count_parameters(path):,} parameters)"


def launch(cfg: SystemConfig) -> int:
    run_dir = cfg.run.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"run {cfg.run.run_id!r}: k={cfg.run.k}, groups_per_step={cfg.run.groups_per_step}, run_dir={run_dir}"
    )
    t0 = time.monotonic()
    _step("config", str(write_resolved(cfg, run_dir)), t0)

    local: LocalRedis | None = None
    if cfg.run.redis_url:
        client, where = connect(cfg.run.redis_url), cfg.run.redis_url
    else:
        local = LocalRedis(data_dir=run_dir / "redis", persistent=True)
        client, where = connect(local.url), f"{local.url} (local redis-server, pid {local.process.pid})"
    try:
        _step("redis", where, t0)
        specs = stream_specs(cfg.run, cfg.streams)
        for spec in specs.values():
            if spec.mode == "queue":
                StreamConsumer(client, spec, "launcher")  # creates the stream and its consumer group
        _step("streams", ", ".join(f"{s.key} ({s.mode}, cap {s.maxlen})" for s in specs.values()), t0)

        model = prepare_model(cfg)
        _step("model", model, t0)

        missing = []
        for name, (module, issue) in SERVICES.items():
            if importlib.util.find_spec(module) is None:
                missing.append(name)
                print(f"  [missing] {name:<14} not built yet (issue {issue}: {module})")
        if missing:
            print(
                f"\n{len(missing)} of {len(SERVICES)} components are not built yet, so there is nothing to "
                "train. Up and checked: the resolved config, Redis with the run's streams and consumer "
                "groups, and the policy model."
            )
            return 0
        raise NotImplementedError("every service exists: the Ray launcher (issue 8) starts them")
    finally:
        client.close()
        if local is not None:
            local.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_arguments(parser, SystemConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(SystemConfig, args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
