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
from services.learner.local_ranks import run_ranks, scored_groups

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
    import deepspeed.comm

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
        out.append(
            {
                "metrics": [r.metrics for r in results],
                "versions": [r.version for r in results],
                "weights": weights if rank == 0 else None,
                "shm_op_built": deepspeed.comm.comm.cdb.shm_comm_op is not None,
            }
        )
    return out


def test_two_zero3_ranks_give_the_one_rank_step(model_dir: Path) -> None:
    steps = [scored_groups(model_dir, sizes, seed=s) for s, sizes in enumerate(SIZES)]
    base = {"micro_batch_size": 2, "lr": 1e-3, "weight_decay": 0.01, "grad_clip": 1e6}
    # the third: VCPO with memory of one micro-batch (streaming norms, the head in chunks of 5 positions, the
    # layers checkpointed, the head's weight gathered from ZeRO-3 for its norms): the first one's step
    recompute = dict(
        base,
        objective="vcpo",
        memory_mode="recompute",
        activation_checkpointing=True,
        logit_chunk_tokens=5,
        max_sequence_tokens=64,
    )
    configs = [
        dict(base, objective="vcpo"),
        dict(base, objective="grpo", importance_weighting="masked"),
        recompute,
    ]
    one = run_ranks(_train, 1, str(model_dir), steps, configs)[0]
    two = run_ranks(_train, 2, str(model_dir), steps, configs)
    # no rank built DeepSpeed's shared-memory all-reduce op (training never uses it; its JIT build takes minutes)
    assert [r["shm_op_built"] for rank in [one, *two] for r in rank] == [False] * 9
    for m_saved, m_recompute in zip(one[0]["metrics"], two[0][2]["metrics"], strict=True):
        assert m_saved["recompute"] == 0 and m_recompute["recompute"] == 1
        for key in ("loss", "ess_ratio", "grad_norm", "advantage_abs_mean"):
            assert math.isclose(m_saved[key], m_recompute[key], rel_tol=1e-4, abs_tol=1e-7), key
    # the same gradient summed in another order: Adam's g/√v turns an element whose gradient is round-off into
    # a move of up to lr, so bound each element by 10% of lr and the mean difference by 1e-5 of lr
    diff = [torch.from_numpy(two[0][2]["weights"][n] - w).abs() for n, w in one[0]["weights"].items()]
    assert max(float(d.max()) for d in diff) <= 1e-4
    assert sum(float(d.sum()) for d in diff) / sum(d.numel() for d in diff) < 1e-8
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
        moved, total, count, loose = 0.0, 0.0, 0, []
        for name in w1:
            a, b = torch.from_numpy(w1[name]), torch.from_numpy(w2[name])
            diff = (a - b).abs()
            # Adam divides by √v, so an element whose gradient is pure round-off (k_proj.bias: softmax ignores
            # a constant shift of the keys, its true gradient is 0), or is within a few hundred ulps of its
            # summands (an output-head row of a token the batch never targets), moves by noise of up to lr:
            # bound each element by 10% of lr, all but 1 in 10^4 of them by 1% of lr (which elements those are
            # depends on the CPU's kernels: AVX2 and AVX-512 sum in other orders), and the mean difference
            # over all weights by 1e-5 of lr (recompute: its gradient is summed over per-micro-batch
            # backwards in another order, so every element by 10% of lr)
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
            if cfg.get("memory_mode") != "recompute":
                loose += [(name, float(d)) for d in diff[diff > 1e-5]]
            total += float(diff.sum())
            count += a.numel()
            moved = max(moved, float((a - start[name].detach()).abs().max()))
        assert len(loose) <= count // 10_000, loose
        assert total / count < 1e-8
        assert moved > 1e-4  # the steps really changed the weights


def _bf16_step(rank: int, model_dir: str, groups: list[Any]) -> dict[str, Any]:
    from services.learner.batching import to_tensors
    from services.learner.trainer import Trainer

    cfg = LearnerConfig(precision="bf16", micro_batch_size=2, objective="grpo", importance_weighting="masked")
    trainer = Trainer(cfg, model_dir)
    optimizer = trainer.engine.optimizer
    metrics = trainer.train_step(to_tensors(groups)).metrics  # 4 micro-batches: their gradients are summed
    return {
        "params": str(next(trainer.module.parameters()).dtype),
        "accumulation": str(optimizer.gradient_accumulation_dtype),
        "buffer": str(optimizer.grad_partitions_flat_buffer.dtype),
        "reduction": str(trainer.engine.communication_data_type),
        "grad_norm": metrics["grad_norm"],
    }


def test_bf16_weights_have_their_micro_batch_gradients_summed_and_reduced_in_float32(model_dir: Path) -> None:
    """Real DeepSpeed ZeRO-3 in bf16 (gloo, CPU): the learner's config makes it keep gradient partitions,
    their sums over micro-batches and their reduction across ranks in float32 (its default is the model's
    dtype: bf16, rounding every addition)."""
    out = run_ranks(_bf16_step, 1, str(model_dir), scored_groups(model_dir, [4, 4]))[0]
    assert out["params"] == "torch.bfloat16"
    assert out["accumulation"] == out["buffer"] == out["reduction"] == "torch.float32"
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0


def _step_publish_resume(
    rank: int, model_dir: str, groups: list[Any], broker: tuple[str, str], checkpoints: str, gpus: int
) -> dict[str, Any]:
    """One rank (on a GPU over NCCL in bf16 with ``gpus = 1``, else gloo and fp32 on CPU): a step, a publish
    of version 1 to a broker process (its outcome broadcast over the backend), a checkpoint, a second step;
    then a new trainer resumes from the checkpoint and takes the second step again."""
    from services.learner.batching import to_tensors
    from services.learner.publish import gathered_tensors, publish_version
    from services.learner.trainer import Trainer
    from services.weight_transport.transport import WeightTransport

    def weights(t: Trainer) -> dict[str, torch.Tensor]:
        return {n: w.detach().float().cpu().clone() for n, w in gathered_tensors(t.module)}

    cfg = LearnerConfig(gpus_per_rank=gpus, micro_batch_size=2)
    trainer = Trainer(cfg, model_dir)
    batch = to_tensors(groups)
    first = trainer.train_step(batch)
    transport = WeightTransport(*broker)
    published = publish_version(trainer.module, transport, trainer.version, rank)
    fetched: dict[str, torch.Tensor] = {}
    transport.fetch(lambda name, t: fetched.__setitem__(name, t.float().clone()), 1)
    v1 = weights(trainer)
    trainer.save_checkpoint(Path(checkpoints), {"note": "resume"}, keep=2)
    second = trainer.train_step(batch)
    v2 = weights(trainer)
    resumed = Trainer(cfg, model_dir)
    state = resumed.load_checkpoint(Path(checkpoints))
    restored = weights(resumed)
    again = resumed.train_step(batch)
    v2_again = weights(resumed)
    return {
        "backend": trainer.backend,
        "precision": trainer.precision,
        "device": str(next(trainer.module.parameters()).device),
        "first": first.metrics,
        "second": second.metrics,
        "again": again.metrics,
        "published": None if published is None else published.policy_version,
        "fetched_equal": fetched.keys() == v1.keys() and all(torch.equal(fetched[n], v1[n]) for n in v1),
        "restored_equal": all(torch.equal(restored[n], v1[n]) for n in v1),
        "state": {k: state[k] for k in ("version", "step", "note")} if state else None,
        "moved": max(float((v2[n] - v1[n]).abs().max()) for n in v1),
        "resumed_diff": max(float((v2_again[n] - v2[n]).abs().max()) for n in v1),
        "versions": [first.version, second.version, again.version],
    }


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [(0, ("gloo", "fp32", "cpu")), pytest.param(1, ("nccl", "bf16", "cuda:0"), marks=pytest.mark.gpu)],
    ids=["cpu-gloo-fp32", "gpu-nccl-bf16"],
)
def test_one_rank_steps_publishes_checkpoints_and_resumes(
    model_dir: Path, tmp_path: Path, gpus: int, expected: tuple[str, str, str]
) -> None:
    from benchmarks.weight_sync import start_broker

    broker, address, data_address = start_broker(tmp_path / "broker")
    try:
        out = run_ranks(
            _step_publish_resume,
            1,
            str(model_dir),
            scored_groups(model_dir, [3, 2]),
            (address, data_address),
            str(tmp_path / "checkpoints"),
            gpus,
        )[0]
    finally:
        broker.stop()
    assert (out["backend"], out["precision"], out["device"]) == expected
    for m in (out["first"], out["second"], out["again"]):
        assert m["step_skipped"] == 0 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert out["published"] == 1 and out["fetched_equal"]  # the broker holds exactly the learner's weights
    assert out["state"] == {"version": 1, "step": 1, "note": "resume"} and out["restored_equal"]
    assert out["versions"] == [1, 2, 2] and out["moved"] > 0
    # the resumed trainer's step is the uninterrupted one: bit-exact on CPU; GPU kernels (atomics in the
    # embedding's index_add) may differ in the last bits
    assert math.isclose(out["again"]["loss"], out["second"]["loss"], rel_tol=1e-3, abs_tol=1e-6)
    assert out["resumed_diff"] <= (0.0 if gpus == 0 else 1e-2 * out["moved"])


def _skip_in_the_middle(
    rank: int, model_dir: str, steps: list[Any], bad: list[Any], gpus: int
) -> dict[str, Any]:
    """Trainer A takes a step, a skipped one (every behaviour log-prob NaN: nothing valid, ρ not finite), and
    another step; trainer B takes the two steps alone. The optimizer state around the skipped step, byte for
    byte, and the end weights of both."""
    from services.learner.batching import place_groups, to_tensors
    from services.learner.publish import gathered_tensors
    from services.learner.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])

    def mine(groups: list[Any]) -> Any:
        return to_tensors([groups[i] for i in place_groups(groups, world)[rank]])

    def optimizer_state(t: Trainer) -> list[tuple[str, bytes]]:
        # ZeRO-3 steps its AdamW on one fp32 partition (sub-group) at a time; the state is keyed by those
        zero = t.engine.optimizer
        out = []
        for g, flat in enumerate(zero.fp32_partitioned_groups_flat):
            out.append((f"{g}.param", flat.detach().cpu().numpy().tobytes()))
            for key, value in sorted(zero.optimizer.state.get(flat, {}).items()):
                raw = (
                    value.detach().cpu().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()
                )
                out.append((f"{g}.{key}", raw))
        return out

    def weights(t: Trainer) -> dict[str, torch.Tensor]:
        return {n: w.detach().float().cpu().clone() for n, w in gathered_tensors(t.module)}

    cfg = LearnerConfig(gpus_per_rank=gpus, micro_batch_size=2, lr=1e-3, weight_decay=0.01, grad_clip=1e6)
    a = Trainer(cfg, model_dir, seed=0)
    first = a.train_step(mine(steps[0]))
    before = optimizer_state(a)
    skipped = a.train_step(mine(bad))
    after = optimizer_state(a)
    last = a.train_step(mine(steps[1]))
    end_a = weights(a)
    b = Trainer(cfg, model_dir, seed=0)
    b.train_step(mine(steps[0]))
    b.train_step(mine(steps[1]))
    end_b = weights(b)
    return {
        "skipped": skipped.metrics,
        "first": first.metrics,
        "last": last.metrics,
        "versions": [first.version, skipped.version, last.version],
        "entries": len(before),
        "state_unchanged": before == after,
        "has_moments": any(k.endswith("exp_avg_sq") for k, _ in before),
        "skipped_steps": a.engine.skipped_steps,
        "end_diff": max(float((end_a[n] - end_b[n]).abs().max()) for n in end_b),
    }


@pytest.mark.parametrize(
    ("world", "gpus"),
    [(2, 0), pytest.param(1, 1, marks=pytest.mark.gpu)],
    ids=["cpu-2-ranks", "gpu-nccl-bf16"],
)
def test_a_skipped_step_leaves_the_optimizer_state_byte_identical(
    model_dir: Path, world: int, gpus: int
) -> None:
    """A step skipped for a ρ that is not finite (here: no valid trajectory) calls no optimizer step: AdamW's
    step count, moments and fp32 weights are byte-identical before and after it, and the steps around it end
    exactly where the same two steps end without it (nothing of the skipped step was left to add to the next)."""
    if gpus and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    steps = [scored_groups(model_dir, sizes, seed=s) for s, sizes in enumerate(SIZES)]
    bad = scored_groups(model_dir, [4, 4], seed=7)
    for g in bad:
        for t in g.trajectories:
            t.behaviour_logprobs[:] = [math.nan] * len(t.behaviour_logprobs)
    outs = run_ranks(_skip_in_the_middle, world, str(model_dir), steps, bad, gpus)
    for out in outs:
        s = out["skipped"]
        assert s["step_skipped"] == 1 and s["num_valid"] == 0 and s["lr_scale"] == 0 and s["grad_norm"] == 0
        assert not math.isfinite(s["ess_ratio"])
        assert out["first"]["step_skipped"] == 0 and out["last"]["step_skipped"] == 0
        assert out["versions"] == [1, 2, 3]  # a skipped step still makes a version (the same weights)
        assert out["entries"] > 0 and out["has_moments"] and out["state_unchanged"]
        assert out["skipped_steps"] == 1
        # CPU: bit for bit; a GPU's kernels may sum in another order from one launch to the next
        assert out["end_diff"] <= (1e-6 if gpus else 0.0), out["end_diff"]


def _scheduled(rank: int, model_dir: str, steps: list[Any], checkpoints: str, gpus: int) -> dict[str, Any]:
    """Trainer A decays its rate linearly over 2 steps to a quarter and takes 3 steps, checkpointing after the
    first; trainer R resumes from that checkpoint and takes the second step again; trainer B has a constant
    rate that the test sets by hand before each step to what A's schedule gives it."""
    from services.learner.batching import to_tensors
    from services.learner.lr_schedule import lr_factor
    from services.learner.publish import gathered_tensors
    from services.learner.trainer import Trainer

    def weights(t: Trainer) -> dict[str, torch.Tensor]:
        return {n: w.detach().float().cpu().clone() for n, w in gathered_tensors(t.module)}

    common = {
        "gpus_per_rank": gpus,
        "micro_batch_size": 2,
        "lr": 1e-3,
        "weight_decay": 0.01,
        "grad_clip": 1e6,
    }
    decay = {"lr_decay": "linear", "lr_decay_steps": 2, "lr_min_ratio": 0.25}
    batches = [to_tensors(groups) for groups in steps]
    a = Trainer(LearnerConfig(**common, **decay), model_dir, seed=0)
    a_metrics = [a.train_step(batches[0]).metrics]
    a.save_checkpoint(Path(checkpoints), {}, keep=1)
    a_metrics += [a.train_step(batches[1]).metrics]
    a_v2 = weights(a)
    a_metrics += [a.train_step(batches[2]).metrics]
    r = Trainer(LearnerConfig(**common, **decay), model_dir, seed=0)
    r.load_checkpoint(Path(checkpoints))
    r_metrics = r.train_step(batches[1]).metrics
    b = Trainer(LearnerConfig(**common), model_dir, seed=0)
    for t, batch in enumerate(batches):
        b.config = b.config.model_copy(update={"lr": 1e-3 * lr_factor(t, "linear", 2, 0.25)})
        b.train_step(batch)
    a_end, b_end = weights(a), weights(b)
    return {
        "a": a_metrics,
        "resumed": r_metrics,
        "resumed_diff": max(float((weights(r)[n] - a_v2[n]).abs().max()) for n in a_v2),
        "scheduled_over_by_hand": max(float((a_end[n] - b_end[n]).abs().max()) for n in a_end),
        "moved": max(float((a_end[n] - a_v2[n]).abs().max()) for n in a_end),
    }


@pytest.mark.parametrize("gpus", [0, pytest.param(1, marks=pytest.mark.gpu)], ids=["cpu-gloo", "gpu-nccl"])
def test_the_learning_rate_follows_its_decay_and_a_resumed_learner_continues_it(
    model_dir: Path, tmp_path: Path, gpus: int
) -> None:
    """learner.lr_decay on real DeepSpeed ZeRO-3: each step's rate is η₀ · decay(step) · s(ρ), AdamW applies
    that rate (the weights equal those of a constant rate set by hand to the same values), and a learner
    resumed from a checkpoint goes on from the checkpoint's step, not from η₀."""
    if gpus and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    steps = [scored_groups(model_dir, [3, 2], seed=s) for s in range(3)]
    out = run_ranks(_scheduled, 1, str(model_dir), steps, str(tmp_path / "checkpoints"), gpus)[0]
    factors = [1.0, 0.625, 0.25]  # linear over 2 steps to a floor of 0.25, then held
    for m, f in zip(out["a"], factors, strict=True):
        assert m["step_skipped"] == 0 and 0 < m["lr_scale"] <= 1
        assert m["lr"] == pytest.approx(1e-3 * f * m["lr_scale"], rel=1e-12), (m["lr"], f)
    resumed = out["resumed"]
    assert resumed["lr"] == pytest.approx(1e-3 * 0.625 * resumed["lr_scale"], rel=1e-12)
    assert out["moved"] > 0  # the last step (at the floor) still trains
    # CPU: bit for bit; a GPU's kernels may sum in another order from one launch to the next
    tolerance = 1e-2 * out["moved"] if gpus else 0.0
    assert out["scheduled_over_by_hand"] <= tolerance, out
    assert out["resumed_diff"] <= tolerance, out


def _first_step_by_rule(rank: int, model_dir: str, groups: list[Any], gpus: int) -> dict[str, Any]:
    """For each ESS rule, a fresh trainer's first step on the same batch: its metrics, where AdamW's fp32
    partitions (the weights the optimizer steps) were before and after it, and its moments after it."""
    from services.learner.batching import to_tensors
    from services.learner.trainer import Trainer

    out: dict[str, Any] = {}
    for rule in ("off", "sqrt", "linear"):
        cfg = LearnerConfig(
            gpus_per_rank=gpus, micro_batch_size=2, lr=1e-2, weight_decay=0.0, grad_clip=1e6, ess_rule=rule
        )
        trainer = Trainer(cfg, model_dir, seed=0)
        zero = trainer.engine.optimizer

        def partitions(zero: Any = zero) -> torch.Tensor:
            return torch.cat([f.detach().double().cpu() for f in zero.fp32_partitioned_groups_flat])

        before = partitions()
        metrics = trainer.train_step(to_tensors(groups)).metrics
        moments = [
            zero.optimizer.state[flat][key].detach().double().cpu().numpy()
            for flat in zero.fp32_partitioned_groups_flat
            for key in ("exp_avg", "exp_avg_sq")
        ]
        out[rule] = {
            "metrics": metrics,
            "before": before.numpy(),
            "delta": (partitions() - before).numpy(),
            "moments": moments,
        }
    return out


@pytest.mark.parametrize(
    "gpus", [0, pytest.param(1, marks=pytest.mark.gpu)], ids=["cpu-gloo", "gpu-nccl-bf16"]
)
def test_adamw_steps_by_the_ess_scaled_rate(model_dir: Path, gpus: int) -> None:
    """VCPO's step size where it lands: the same batch (ρ < 1) and the same first AdamW step (weight decay 0)
    under ``ess_rule`` off, sqrt and linear. Adam's first update is lr·m̂/(√v̂+ε), the same direction for
    every rule, so each fp32 weight moves by s(ρ) times what it moves without damping (to the float32
    round-off of the weight), and the moments, which see the unscaled gradient, are the same for every rule.
    s(ρ) is computed here from ρ by the specification, not by the learner's function."""
    if gpus and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    groups = scored_groups(model_dir, [4, 4], seed=3, noise=0.4)
    out = run_ranks(_first_step_by_rule, 1, str(model_dir), groups, gpus)[0]
    rho = out["off"]["metrics"]["ess_ratio"]
    assert 0 < rho < 0.9, rho  # far enough from 1 that an undamped step cannot pass for a damped one
    rules = {"off": lambda r: 1.0, "sqrt": math.sqrt, "linear": lambda r: r}  # s(ρ), ρ_base = 1
    base = torch.from_numpy(out["off"]["delta"])
    weights = torch.from_numpy(out["off"]["before"])
    moved = base.abs() > 0.5e-2  # elements whose first Adam step is about ±lr (a gradient well above ε)
    assert int(moved.sum()) > 0.5 * base.numel(), int(moved.sum())
    # CPU: each delta is a difference of two float32 weights, off by at most an ulp of the weight on either
    # side. GPU (bf16 forwards): kernels may sum in another order from one launch to the next, so ρ and the
    # gradient differ in their last bits between the runs
    ulp = 2.0**-23 * (weights.abs() + 2e-2)
    for rule, scale in rules.items():
        m = out[rule]["metrics"]
        assert m["step_skipped"] == 0 and (gpus or m["ess_ratio"] == rho), m
        s = scale(m["ess_ratio"])
        assert m["lr_scale"] == pytest.approx(s, rel=1e-12) and m["lr"] == pytest.approx(1e-2 * s, rel=1e-12)
        delta = torch.from_numpy(out[rule]["delta"])
        error = (delta - s * base).abs()
        if gpus:
            assert bool((error[moved] <= 1e-2 * base[moved].abs()).all()), (rule, s, float(error.max()))
        else:
            assert bool((error <= 2 * ulp).all()), (rule, s, float(error.max()))
        ratio = float(delta[moved].sum() / base[moved].sum())
        assert ratio == pytest.approx(s, rel=1e-2 if gpus else 1e-4), (rule, ratio, s)
        for a, b in zip(out[rule]["moments"], out["off"]["moments"], strict=True):
            a_, b_ = torch.from_numpy(a), torch.from_numpy(b)
            assert torch.equal(a_, b_) if not gpus else torch.allclose(a_, b_, rtol=1e-2, atol=1e-12)


def _checkpoint_rank(rank: int, port: int, directory: str, out: Any) -> None:  # a process
    import torch.distributed as dist

    from services.learner.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Rank:  # what load_checkpoint reads of a trainer, before it reaches DeepSpeed's engine
        world_size, device = 2, torch.device("cpu")

    me = Rank()
    me.rank = rank  # type: ignore[attr-defined]
    try:
        out.put((rank, Trainer.load_checkpoint(me, Path(directory) / str(rank))))  # type: ignore[arg-type]
    except RuntimeError as exc:
        out.put((rank, str(exc)))
    dist.destroy_process_group()


def test_learner_ranks_that_see_different_checkpoints_all_refuse_to_resume(tmp_path: Path) -> None:
    """A rank that does not see the checkpoint the others see (a node without the shared volume) would start
    afresh while they resumed, their collectives mismatched: every rank raises, naming the setting."""
    import multiprocessing as mp

    from services.common.ports import free_port

    (tmp_path / "0").mkdir()
    (tmp_path / "1").mkdir()
    (tmp_path / "0" / "latest").write_text("step000000004")  # rank 0 sees one, rank 1 does not
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_checkpoint_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    said = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert "learner rank 0 sees a checkpoint in" in said[0]
    assert "learner rank 1 does not see a checkpoint in" in said[1]
    assert all("learner.checkpoint_dir must be one directory every rank shares" in s for s in said.values())
