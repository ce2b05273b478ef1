"""The learner's DeepSpeed ZeRO-3 step: 2 ranks give the 1-rank result; metrics agree across ranks."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.config import LearnerConfig
from tests.learner_ranks import run_ranks, scored_groups

pytestmark = pytest.mark.slow

# group sizes 6 and 2 put 6 rows on one rank and 2 on the other: with micro-batches of 2 the small rank runs
# padding micro-batches so both ranks make the same number of ZeRO-3 forwards
SIZES = [[6, 2], [2, 3, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("trainer") / "model", TinyModelSpec())


def _train(
    rank: int, model_dir: str, steps: list[Any], configs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    from services.learner.batching import place_groups, to_tensors
    from services.learner.publish import gathered_tensors
    from services.learner.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for cfg in configs:
        trainer = Trainer(LearnerConfig(**cfg), model_dir, seed=0)
        assert trainer.world_size == world
        results = []
        for groups in steps:
            mine = [groups[i] for i in place_groups(groups, world)[rank]]
            results.append(trainer.train_step(to_tensors(mine)))
        weights = {n: t.numpy().copy() for n, t in gathered_tensors(trainer.module)}
        out.append({"metrics": [r.metrics for r in results], "versions": [r.version for r in results],
                    "weights": weights if rank == 0 else None})  # fmt: skip
    return out


def test_two_zero3_ranks_give_the_one_rank_step(model_dir: Path) -> None:
    steps = [scored_groups(model_dir, sizes, seed=s) for s, sizes in enumerate(SIZES)]
    base = {"micro_batch_size": 2, "lr": 1e-3, "weight_decay": 0.01, "grad_clip": 1e6}
    configs = [dict(base, objective="vcpo"), dict(base, objective="grpo", importance_weighting="masked")]
    one = run_ranks(_train, 1, str(model_dir), steps, configs)[0]
    two = run_ranks(_train, 2, str(model_dir), steps, configs)
    for c, cfg in enumerate(configs):
        assert one[c]["versions"] == two[0][c]["versions"] == [1, 2]
        for m1, m2a, m2b in zip(one[c]["metrics"], two[0][c]["metrics"], two[1][c]["metrics"], strict=True):
            assert m2a == m2b  # every rank reports the same merged metrics
            assert m1["step_skipped"] == 0 and 0 < m1["ess_ratio"] <= 1
            for key in (
                "loss",
                "ess",
                "ess_ratio",
                "lr_scale",
                "grad_norm",
                "log_weight_max",
                "advantage_abs_mean",
            ):
                assert math.isclose(m1[key], m2a[key], rel_tol=1e-4, abs_tol=1e-7), (
                    cfg,
                    key,
                    m1[key],
                    m2a[key],
                )
            for key in ("num_trajectories", "num_valid", "num_tokens"):
                assert m1[key] == m2a[key], key
        w1, w2 = one[c]["weights"], two[0][c]["weights"]
        assert w1.keys() == w2.keys()
        from transformers import AutoModelForCausalLM

        start = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
        moved, total, count = 0.0, 0.0, 0
        for name in w1:
            a, b = torch.from_numpy(w1[name]), torch.from_numpy(w2[name])
            # Adam divides by √v, so an element whose gradient is pure round-off (k_proj.bias: softmax ignores
            # a constant shift of the keys, its true gradient is 0) moves by noise: bound each element by 1% of
            # lr, and the mean difference over all weights by 1e-5 of lr
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            total += float((a - b).abs().sum())
            count += a.numel()
            moved = max(moved, float((a - start[name].detach()).abs().max()))
        assert total / count < 1e-8
        assert moved > 1e-4  # the steps really changed the weights


def _gpu_step(rank: int, model_dir: str, groups: list[Any]) -> dict[str, float]:
    from services.learner.batching import to_tensors
    from services.learner.trainer import Trainer

    trainer = Trainer(LearnerConfig(gpus_per_rank=1, micro_batch_size=2), model_dir)
    assert (trainer.backend, trainer.precision) == ("nccl", "bf16")
    return trainer.train_step(to_tensors(groups)).metrics


@pytest.mark.gpu
def test_one_rank_trains_in_bf16_over_nccl_on_a_gpu(model_dir: Path) -> None:
    metrics = run_ranks(_gpu_step, 1, str(model_dir), scored_groups(model_dir, [3, 2]))[0]
    assert metrics["step_skipped"] == 0 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
