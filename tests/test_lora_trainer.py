"""The learner with LoRA adapters on DeepSpeed ZeRO-3 (two gloo ranks, CPU): the recompute step is the saved
step; only the adapters train; a version is the adapters alone in peft's saved names (``publish = "adapter"``,
the base never gathered) or the merged model in the base's names (``"merged"``); a checkpoint holds the
adapters alone, resumes bit-exact and exports merged into the base. (Adapter dropout's replay:
tests/test_step.py; the norms against brute force: tests/test_lora_norms.py.)"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.config import PROJECTIONS, LearnerConfig
from services.learner.local_ranks import run_ranks, scored_groups

pytestmark = pytest.mark.slow

SIZES = [[6, 2], [2, 3, 3]]  # as tests/test_trainer.py: uneven ranks, padding micro-batches
# the head and the embedding too: versions can only be the merged model then
EVERYWHERE = {
    "rank": 4,
    "alpha": 8,
    "target_modules": [*PROJECTIONS, "embed_tokens", "lm_head"],
    "publish": "merged",
}
PROJECTIONS_ONLY = {"rank": 4, "alpha": 8}  # the default targets and publish: adapter versions
BASE = {"micro_batch_size": 2, "lr": 1e-2, "weight_decay": 0.01, "grad_clip": 1e6}
# the head in slices of 16 positions (rows are 20-40 tokens long)
RECOMPUTE = {"memory_mode": "recompute", "logit_chunk_tokens": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora_trainer") / "model", TinyModelSpec())


def _weights(trainer: Any, stats: Any = None) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the published version's tensors, every adapter matrix, the parameters the publish gathered, by name),
    gathered from ZeRO-3, as numpy arrays (a tensor's storage would not outlive its rank's process)."""
    from services.learner import publish
    from services.learner.norm_rules import gathered

    names = {id(p): n for n, p in trainer.module.named_parameters()}
    with mock.patch.object(publish, "gathered", wraps=publish.gathered) as gathers:
        published = {
            n: t.detach().numpy().copy() for n, t in publish.gathered_tensors(trainer.module, stats=stats)
        }
    fetched = [names[id(p)] for call in gathers.call_args_list for p in call.args[0]]
    adapters = {n: p for n, p in trainer.module.named_parameters() if "lora_" in n}
    with gathered(list(adapters.values())):
        return published, {n: p.detach().numpy().copy() for n, p in adapters.items()}, fetched


def _tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


def _train(
    rank: int,
    model_dir: str,
    steps: list[Any],
    configs: list[dict[str, Any]],
    checkpoints: list[str | None],
) -> list[dict[str, Any]]:
    """Each config's trainer through ``steps``, then its version (and a checkpoint where one is named)."""
    from services.learner.batching import place_groups, to_tensors
    from services.learner.publish import GatherStats, tensor_specs
    from services.learner.trainer import Trainer
    from services.weight_transport import dtype_name

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for cfg, checkpoint in zip(configs, checkpoints, strict=True):
        torch.manual_seed(1)
        trainer = Trainer(LearnerConfig(**cfg), model_dir, seed=0)
        optimized = {id(p) for g in trainer.engine.optimizer.optimizer.param_groups for p in g["params"]}
        metrics = []
        for groups in steps:
            mine = [groups[i] for i in place_groups(groups, world)[rank]]
            metrics.append(trainer.train_step(to_tensors(mine)).metrics)
        stats = GatherStats()
        published, adapters, fetched = _weights(trainer, stats)
        specs = tensor_specs(trainer.module)
        if checkpoint is not None:
            trainer.save_checkpoint(Path(checkpoint), {}, keep=1)
        out.append(
            {
                "metrics": metrics,
                "specs": [(s.name, s.shape, s.dtype) for s in specs],
                "version_bytes": sum(s.nbytes for s in specs),
                "dtype": dtype_name(torch.bfloat16 if trainer.precision == "bf16" else torch.float32),
                "gathers": (stats.buckets, stats.max_bucket_bytes),
                "fetched": fetched,
                "published": published if rank == 0 else None,
                "adapters": adapters if rank == 0 else None,
                "optimized": sorted(
                    n for n, p in trainer.module.named_parameters() if id(p) in optimized or p.requires_grad
                ),
                "trainable": sorted(n for n, p in trainer.module.named_parameters() if p.requires_grad),
            }
        )
    return out


def _close(a: dict[str, float], b: dict[str, float], keys: tuple[str, ...], rel: float = 1e-4) -> None:
    for key in keys:
        assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-7), (key, a[key], b[key])


def _assert_same_step(one: dict[str, Any], two: dict[str, Any]) -> None:
    """The same steps, summed in another order: Adam's g/√v turns an element whose gradient is round-off into
    a move of up to lr, so each adapter element is bound by 10% of lr and the mean difference by 1e-5 of lr
    (as tests/test_trainer.py bounds the full weights)."""
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m1["step_skipped"] == m2["step_skipped"] == 0
        _close(m1, m2, ("loss", "ess", "ess_ratio", "lr_scale", "grad_norm"))
    lr = BASE["lr"]
    total, count = 0.0, 0
    for name, a in _tensors(one["adapters"]).items():
        b = torch.from_numpy(two["adapters"][name])
        torch.testing.assert_close(b, a, rtol=0, atol=0.1 * lr, msg=lambda m, n=name: f"{n}: {m}")
        total += float((a - b).abs().sum())
        count += a.numel()
    assert total / count < 1e-5 * lr


def _resume(rank: int, model_dir: str, steps: list[Any], checkpoints: str) -> dict[str, Any]:
    """A step, a checkpoint, a second step; a trainer with other fresh adapters resumes and redoes it."""
    from services.learner.batching import place_groups, to_tensors
    from services.learner.trainer import Trainer

    cfg = LearnerConfig(**dict(BASE, lora=EVERYWHERE))
    groups = steps[0]
    batch = to_tensors([groups[i] for i in place_groups(groups, int(os.environ["WORLD_SIZE"]))[rank]])
    trainer = Trainer(cfg, model_dir)
    trainer.train_step(batch)
    trainer.save_checkpoint(Path(checkpoints), {}, keep=2)
    published, _, _ = _weights(trainer)  # the version of the checkpoint's step
    second = trainer.train_step(batch).metrics
    _, continued, _ = _weights(trainer)
    resumed = Trainer(cfg, model_dir, seed=7)  # the checkpoint must replace its adapters
    resumed.load_checkpoint(Path(checkpoints))
    again = resumed.train_step(batch).metrics
    _, redone, _ = _weights(resumed)
    return {
        "second": second,
        "again": again,
        "continued": continued,
        "redone": redone,
        "published": published,
    }


def _train_and_resume(
    rank: int,
    model_dir: str,
    steps: list[Any],
    configs: list[dict[str, Any]],
    checkpoints: list[str | None],
    resumed: str,
) -> Any:
    return _train(rank, model_dir, steps, configs, checkpoints), _resume(rank, model_dir, steps, resumed)


def test_lora_on_zero3_trains_the_adapters_publishes_adapter_and_merged_versions_and_resumes_bit_exact(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two ranks (gloo): the saved and the recompute step (merged versions), adapter versions and their
    checkpoint's export; a checkpoint and a resume."""
    import numpy as np
    from safetensors.torch import load_file

    from services.common.lora import adapter_shapes, adapter_tensor_name
    from services.learner.export import (
        MODEL_STATES,
        _client_state,
        base_tensors,
        export_checkpoint,
        find_checkpoint,
    )

    steps = [scored_groups(model_dir, sizes, seed=s) for s, sizes in enumerate(SIZES)]
    saved = dict(BASE, lora=EVERYWHERE)
    adapter_run, merged_run = tmp_path / "adapter-run", tmp_path / "merged-run"
    ranks = run_ranks(
        _train_and_resume,
        2,
        str(model_dir),
        steps,
        [saved, dict(saved, **RECOMPUTE), dict(BASE, lora=PROJECTIONS_ONLY)],
        [None, None, str(adapter_run)],
        str(merged_run),
    )
    (two, resume), (other, _) = ranks
    assert [r["metrics"] for r in other] == [r["metrics"] for r in two]  # every rank, the same metrics
    one = two[0]

    # the optimizer holds the adapters, and they are all that trains
    names = one["trainable"]
    assert names == one["optimized"] and all(".lora_" in n for n in names)
    assert {n.split(".lora_")[0].rpartition(".")[2] for n in names} == set(EVERYWHERE["target_modules"])
    assert len(names) == 2 * (7 * 4 + 2)  # A and B of 7 projections in each of 4 layers, embedding, head
    # publish = "merged": a version is the merged model, the base's tensors by name and shape, which vLLM loads
    # as it loads the base
    base = load_file(str(model_dir / "model.safetensors"))
    assert {n: shape for n, shape, _ in one["specs"]} == {
        n: shape for n, (shape, _) in base_tensors(model_dir).items()
    }
    # W + (alpha / rank)·B A, from the trained adapters; untargeted weights exactly the base's
    p, a = _tensors(one["published"]), _tensors(one["adapters"])
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj", "lm_head"):
        delta = a[f"{name}.lora_B.default.weight"] @ a[f"{name}.lora_A.default.weight"]
        torch.testing.assert_close(p[f"{name}.weight"], base[f"{name}.weight"] + 2.0 * delta)
    emb = "model.embed_tokens"
    delta = (a[f"{emb}.lora_embedding_B.default"] @ a[f"{emb}.lora_embedding_A.default"]).T
    torch.testing.assert_close(p[f"{emb}.weight"], base[f"{emb}.weight"] + 2.0 * delta)
    assert float(delta.abs().max()) > 1e-3  # the adapters moved
    for name in (
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.2.self_attn.q_proj.bias",
    ):
        assert torch.equal(p[name], base[name]), name

    # recompute (streaming norms over the adapters, the head's in slices): the saved step
    _assert_same_step(two[0], two[1])
    assert [m["recompute"] for r in two for m in r["metrics"]] == [0, 0, 1, 1, 0, 0]

    # publish = "adapter" (the default): a version is the adapters alone, exactly the tensors the samplers
    # check each version against (services/common/lora.py), in the order they derive them, in the training dtype
    adapted = two[2]
    shapes = adapter_shapes(model_dir, LearnerConfig(**dict(BASE, lora=PROJECTIONS_ONLY)).lora)
    assert len(shapes) == 2 * 7 * 4  # A and B of 7 projections in each of 4 layers
    assert [(n, shape) for n, shape, _ in adapted["specs"]] == list(shapes.items())
    assert {dtype for _, _, dtype in adapted["specs"]} == {adapted["dtype"]} == {"float32"}
    # their values: the trained adapters, bit for bit, under peft's saved names
    p, a = adapted["published"], adapted["adapters"]
    assert list(p) == list(shapes) and len(a) == len(p)
    for name, w in a.items():
        assert np.array_equal(p[adapter_tensor_name(name)], w), name
    assert all(float(np.abs(w).max()) > 1e-3 for n, w in a.items() if ".lora_B." in n)  # B moved off 0
    # the publish gathered the adapters and nothing else: one bucket of their bytes, no base weight
    assert sorted(adapted["fetched"]) == sorted(a)
    assert adapted["gathers"] == (1, adapted["version_bytes"])
    assert adapted["version_bytes"] == sum(w.nbytes for w in a.values())

    # resumed from its checkpoint, the learner redoes the step bit for bit
    assert resume["again"]["loss"] == resume["second"]["loss"]
    for name, w in _tensors(resume["continued"]).items():
        assert torch.equal(torch.from_numpy(resume["redone"][name]), w), name
    # the frozen base is the model the run starts from, not saved again with every checkpoint
    written = sum(f.stat().st_size for f in merged_run.rglob("*") if f.is_file())
    size = (model_dir / "model.safetensors").stat().st_size
    assert written < size / 4, (written, size)

    # the export of the checkpoint is the merged model the learner published at that step
    exported = export_checkpoint(merged_run, model_dir, tmp_path / "merged")
    assert (exported.step, exported.version) == (1, 1)
    tensors = load_file(str(exported.path / "model.safetensors"))
    published = _tensors(resume["published"])
    assert tensors.keys() == published.keys() == base.keys()
    for name, w in published.items():
        torch.testing.assert_close(tensors[name], w, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(tensors["lm_head.weight"], base["lm_head.weight"])
    # a checkpoint written before [learner.lora].publish existed (its versions were merged, its head adapted)
    # exports as it did
    tag = find_checkpoint(merged_run)
    states = next(tag / n for n in MODEL_STATES if (tag / n).is_file())
    state = torch.load(states, map_location="cpu", weights_only=False)
    del state["lora"]["publish"]
    torch.save(state, states)
    older = export_checkpoint(merged_run, model_dir, tmp_path / "older")
    assert load_file(str(older.path / "model.safetensors")).keys() == tensors.keys()
    for name, w in load_file(str(older.path / "model.safetensors")).items():
        assert torch.equal(w, tensors[name]), name
    # adapters are deltas on the weights they were trained on: merged into another model of the same shapes
    # (the model before a warm start, say) they would make a wrong model without a word
    other = build_tiny_model(tmp_path / "other-base", TinyModelSpec(seed=1))
    with pytest.raises(ValueError, match=r"adapters were trained on .*export it with"):
        export_checkpoint(merged_run, other, tmp_path / "wrong")

    # a checkpoint of adapter versions records its publish and still exports merged into the base:
    # W + (alpha / rank)·B A on the projections, every other tensor the base's
    _, _, lora = _client_state(find_checkpoint(adapter_run))
    assert lora is not None and lora["publish"] == "adapter"
    exported = export_checkpoint(adapter_run, model_dir, tmp_path / "adapter-merged")
    assert (exported.step, exported.version) == (2, 2)
    tensors = load_file(str(exported.path / "model.safetensors"))
    assert tensors.keys() == base.keys()
    a = _tensors(adapted["adapters"])
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        delta = a[f"{name}.lora_B.default.weight"] @ a[f"{name}.lora_A.default.weight"]
        torch.testing.assert_close(tensors[f"{name}.weight"], base[f"{name}.weight"] + 2.0 * delta)
        assert float(delta.abs().max()) > 1e-3, name
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(tensors[name], base[name]), name
