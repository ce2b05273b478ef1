"""Learner ranks on one machine, for benchmarks and tests: run a function on N spawned ranks of one gloo process
group (DeepSpeed ZeRO-3 needs one), and make scored groups the tiny model can train on.

``run_ranks`` is a harness that collects each rank's result, unlike the learner's own supervisor, which runs
the service's ranks until they stop.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.common.ports import free_port
from services.common.synthetic import make_group
from services.learner.supervisor import set_rank_env
from vcpo.v1 import rollout_pb2


def scored_groups(
    model_dir: Path,
    sizes: list[int],
    response_lens: tuple[int, int] = (6, 14),
    prompt_len: int = 5,
    version: int = 0,
    seed: int = 0,
    noise: float = 0.2,
) -> list[rollout_pb2.TrajectoryGroup]:
    """Groups of the given sizes with ragged responses, behaviour log-probs near the model's own and rewards
    that differ inside each group."""
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i, n in enumerate(sizes):
        g = make_group(
            i,
            n=n,
            response_len=response_lens[1],
            prompt_len=prompt_len,
            policy_version=version,
            scored=True,
            seed=seed * 1000,
            vocab=vocab,
        )
        for j, t in enumerate(g.trajectories):
            keep = rng.randint(*response_lens)
            del t.response_tokens[keep:], t.behaviour_logprobs[keep:], t.loss_mask[keep:]
            t.loss_mask[:] = [not 2 <= k < 4 for k in range(keep)]  # a masked tool-output span
            t.policy_version_start = t.policy_version_end = version
            del t.version_segments[1:]
            t.reward.value = float(rng.random() < 0.5) if j > 1 else float(j)  # never all equal
            ids = torch.tensor([list(g.prompt_tokens) + list(t.response_tokens)])
            with torch.no_grad():
                lp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(g.prompt_tokens) :]
            t.behaviour_logprobs[:] = (lp + noise * torch.randn(keep, generator=gen)).tolist()
        groups.append(g)
    return groups


def _entry(
    target: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    set_rank_env(rank, world, port)
    try:
        out.put((rank, "ok", target(rank, *args)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(target: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240) -> list[Any]:
    """``target(rank, *args)`` on ``world`` spawned ranks of one gloo process group; their results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted((out.get(timeout=timeout_s) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r[2] for r in results if r[1] != "ok"]
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [r[2] for r in results]
