"""What a run is given before any of its services starts: the Ray it runs on, the broker's ports, the policy
model.

Decides: the logical CPUs a local Ray is sized to (a bundle per learner rank, one per sampler and reward
replica, one for the broker and Serve's controller, one for a dedicated evaluator); that the weight broker
gets free ports instead of 0 (the replicas and the learner take theirs themselves, when they bind them);
which model every service loads (``run.model``, or the tiny model built into the run directory, then an
optional supervised warm start, built once and reused by a resumed run); and the environment every Ray
worker starts with (the services' allocator settings, this checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import os

from deploy.config import SystemConfig
from services.common.memory import ALLOCATOR_ENV
from services.common.ports import free_port


def needed_cpus(cfg: SystemConfig) -> int:
    """Logical CPUs the run asks Ray for: a bundle per learner rank, one per sampler and reward replica, and
    one for the broker and Serve's controller, one for a dedicated evaluator."""
    ev = cfg.evaluation
    evaluator = 1 if ev.sets and ev.placement == "dedicated" else 0
    return cfg.learner.num_ranks + cfg.sampler.replicas + cfg.reward.max_replicas + 1 + evaluator


def with_ports_and_redis(cfg: SystemConfig, redis_url: str) -> SystemConfig:
    """Concrete ports instead of 0 for the weight broker, which everything reaches at its configured address
    (a restarted broker must come back on the same ports), and the Redis actually used.

    The learner's ports stay as configured, its rendezvous, status and metrics ports alike: 0 lets rank 0 bind
    a free one on its own node at the moment it serves, each time the group starts, and ``endpoints.json``
    says which (the launcher's scrape targets and the tests read it). A port picked here would sit unbound
    for the learner's whole start-up (ZeRO-3 initialisation, tens of seconds) while the samplers' engines and
    Ray's workers take free ports of their own, and one of them taking it fails the learner at its bind. The
    replicas take free ones themselves for the same reason."""
    wb = cfg.weight_broker
    return cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"redis_url": redis_url}),
            "weight_broker": wb.model_copy(
                update={p: getattr(wb, p) or free_port() for p in ("grpc_port", "data_port", "metrics_port")}
            ),
        }
    )


def prepare_model(cfg: SystemConfig) -> tuple[SystemConfig, str]:
    """The policy every service loads: ``run.model`` (hub id or path), or the tiny model built into the run
    directory; then, with ``launcher.warm_start_steps``, a supervised warm start on the sampler's dataset
    (built once; a resumed run reuses it). Returns the config pointing at it and a description.

    A hub id is downloaded here, once, and the services get its local snapshot directory instead of the id
    (``deploy/model_fetch.py`` says where the files go on a cluster of several nodes)."""
    from pathlib import Path

    from services.common.tiny_model import count_parameters, run_model

    base = run_model(cfg.run)
    what = base if cfg.run.model else f"{base} (tiny Qwen2, {count_parameters(base):,} parameters)"
    if cfg.run.model and not Path(base).is_dir():
        from deploy.model_fetch import fetch_policy

        base, what = fetch_policy(cfg, base)
    la = cfg.launcher
    if la.warm_start_steps:
        from services.learner.warm_start import warm_start

        s = cfg.sampler
        out = warm_start(
            base,
            cfg.run.run_dir / "model-warm",
            s.dataset,
            steps=la.warm_start_steps,
            lr=la.warm_start_lr,
            batch_size=la.warm_start_batch_size,
            seed=cfg.run.seed,
            system_prompt=s.system_prompt,
            max_model_len=s.max_model_len,
            prompt_field=s.prompt_field,
            answer_field=s.answer_field,
        )
        what += f", warm-started {la.warm_start_steps} steps on {s.dataset} -> {out}"
        base = str(out)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"model": base})}), what


def init_ray(cfg: SystemConfig) -> str:
    """Connect to ``launcher.ray_address``, or start a local Ray sized to the run; says which."""
    import ray

    env = {k: v for k, v in ALLOCATOR_ENV.items() if k not in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    address = cfg.launcher.ray_address
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        if nodes > 1 and not cfg.run.redis_url:
            raise ValueError(
                f"run.redis_url is empty, and the Ray cluster at {address} has {nodes} nodes: the redis-server "
                "the launcher starts listens on 127.0.0.1, which services on the other nodes cannot reach (nor "
                "the weight group's rendezvous, whose address follows the route to Redis); set run.redis_url "
                "to a Redis every node reaches"
            )
        return f"connected to {address} ({nodes} node{'s' if nodes != 1 else ''})"
    cpus = max(os.cpu_count() or 1, needed_cpus(cfg))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    return f"local Ray, {cpus} logical CPUs (the run needs {needed_cpus(cfg)})"
