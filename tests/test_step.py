"""The step's gradient: VCPO by the norm pass equals autograd of the VCPO loss; micro-batching changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.grad_norms import per_trajectory_sq_grad_norms
from services.learner.logprobs import token_logprobs
from services.learner.step import StepInputs, TrajectoryTensors, policy_gradient_backward, vcpo_backward
from services.learner.vcpo import ObjectiveConfig, PolicyBatch, policy_loss
from tests.test_grad_norms import make_batch

SPEC = TinyModelSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=96,
    vocab_size=300,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("step") / "model", SPEC)


def load(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).train()


def trajectories(model: nn.Module, seed: int = 0) -> TrajectoryTensors:
    ids, attn, resp = make_batch(model.config.vocab_size, "left", rows=8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        behaviour = token_logprobs(model, ids, attn) + 0.3 * torch.randn(
            ids.shape, generator=g, dtype=torch.float64
        )
    rewards = torch.tensor(
        [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64
    )  # group 1: equal rewards
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    return TrajectoryTensors(ids, attn, resp, behaviour, rewards, groups)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        err = float((a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-30))
        assert err <= tol, (name, err)


@pytest.mark.parametrize("weighting", ["paper", "exact", "released"])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_vcpo_backward_equals_autograd_of_the_vcpo_loss(
    model_dir: Path, weighting: str, aggregation: str
) -> None:
    model = load(model_dir)
    batch = trajectories(model)
    config = ObjectiveConfig(baseline_weighting=weighting, loss_aggregation=aggregation)  # type: ignore[arg-type]

    model.zero_grad(set_to_none=True)
    metrics = vcpo_backward(StepInputs(model, batch, config))
    fused = grads(model)

    model.zero_grad(set_to_none=True)
    norms = per_trajectory_sq_grad_norms(model, batch.input_ids, batch.attention_mask, batch.response_mask)
    logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask)
    policy = PolicyBatch(
        logprobs, batch.behaviour_logprobs, batch.response_mask.bool(), batch.rewards, batch.group_ids, norms
    )
    loss, expected_metrics = policy_loss(policy, config)
    loss.backward()
    close(fused, grads(model), 1e-5)  # float32 RMSNorm internals bound the agreement (see test_grad_norms)
    for key in ("ess_ratio", "lr_scale", "baseline_shift_mean_abs"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-9)
    assert 0 < metrics["ess_ratio"] < 1 and metrics["baseline_shift_mean_abs"] > 0


def test_micro_batch_size_changes_nothing(model_dir: Path) -> None:
    model = load(model_dir)
    batch = trajectories(model, seed=1)
    results = []
    for mb in (None, 3, 1):
        model.zero_grad(set_to_none=True)
        metrics = vcpo_backward(StepInputs(model, batch, ObjectiveConfig(), micro_batch_size=mb))
        results.append((grads(model), metrics))
    for g, m in results[1:]:
        close(g, results[0][0], 1e-10)
        assert m["ess_ratio"] == pytest.approx(results[0][1]["ess_ratio"], rel=1e-12)


@pytest.mark.parametrize("objective", ["grpo", "rloo", "reinforce"])
def test_policy_gradient_backward_micro_batched_equals_one_batch(model_dir: Path, objective: str) -> None:
    model = load(model_dir)
    batch = trajectories(model, seed=2)
    config = ObjectiveConfig(objective=objective, importance_weighting="truncated")  # type: ignore[arg-type]
    model.zero_grad(set_to_none=True)
    policy_gradient_backward(StepInputs(model, batch, config))
    whole = grads(model)
    model.zero_grad(set_to_none=True)
    policy_gradient_backward(StepInputs(model, batch, config, micro_batch_size=3))
    close(grads(model), whole, 1e-10)


@pytest.mark.parametrize("objective", ["grpo", "vcpo"])
def test_ppo_clipping_runs_through_the_ordinary_path(model_dir: Path, objective: str) -> None:
    from services.learner.step import backward

    model = load(model_dir)
    batch = trajectories(model, seed=3)
    config = ObjectiveConfig(objective=objective, ppo_clip=0.2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use policy_gradient_backward"):
        vcpo_backward(StepInputs(model, batch, config))
    model.zero_grad(set_to_none=True)
    metrics = backward(StepInputs(model, batch, config, micro_batch_size=4))
    micro = grads(model)
    assert all(torch.isfinite(g).all() for g in micro.values())
    assert 0 <= metrics["ppo_clip_fraction"] <= 1
    model.zero_grad(set_to_none=True)
    backward(StepInputs(model, batch, config))
    close(micro, grads(model), 1e-10)


def test_every_learner_config_maps_to_an_objective() -> None:
    import itertools

    from services.learner.config import LearnerConfig
    from services.learner.vcpo import objective_config

    for objective, weighting, aggregation in itertools.product(
        ["vcpo", "grpo", "rloo", "reinforce"],
        ["paper", "exact", "released"],
        ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"],
    ):
        learner = LearnerConfig(
            objective=objective, baseline_weighting=weighting, loss_aggregation=aggregation
        )
        config = objective_config(learner)
        assert (config.objective, config.baseline_weighting, config.loss_aggregation) == (
            objective,
            weighting,
            aggregation,
        )


class _Agree:
    """Single-process collectives of a rank whose peers need ``count`` micro-batches."""

    def __init__(self, count: int, chunks: int = 0) -> None:
        self.count = count
        self.chunks = chunks  # the head slices a peer needs per micro-batch

    def num_micro_batches(self, local: int) -> int:
        return max(local, self.count)

    def max_ints(self, values: list[int]) -> list[int]:
        return [max(v, self.chunks) for v in values]

    def ess_ratio(self, log_weights: torch.Tensor) -> float:
        from services.learner.ess import effective_sample_size

        return effective_sample_size(log_weights)[1]

    def loss_scale(self, metrics: dict[str, float], aggregation: str) -> float:
        return 1.0


def test_step_spans_give_every_rank_the_same_micro_batch_count() -> None:
    from services.learner.step import step_spans

    assert step_spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert step_spans(5, 2, _Agree(1)) == [(0, 2), (2, 4), (4, 5)]
    assert step_spans(4, 2, _Agree(4)) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert step_spans(2, 2, _Agree(3)) == [(0, 0), (0, 1), (1, 2)]  # a padding micro-batch; each row once


@pytest.mark.parametrize("objective", ["vcpo", "grpo"])
def test_padding_micro_batches_change_nothing(model_dir: Path, objective: str) -> None:
    from services.learner.step import backward, step_spans

    config = ObjectiveConfig(objective=objective)
    grads, losses = [], []
    for count in (1, 11):  # 8 rows: 2 micro-batches of 4, or 11 spans of which 3 are padding
        model = load(model_dir)
        batch = trajectories(model)
        assert sum(b == a for a, b in step_spans(len(batch), 4, _Agree(count))) == (3 if count == 11 else 0)
        losses.append(backward(StepInputs(model, batch, config, 4, collectives=_Agree(count)))["loss"])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)


RMSNORM_TOL = 1e-6  # float32 round-off inside a float64 model's RMSNorm (see test_grad_norms)


@pytest.mark.parametrize("chunk_tokens", [0, 4], ids=["whole-head", "head-in-slices"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_recompute_gives_the_saved_step_at_every_micro_batch_size(
    model_dir: Path, chunk_tokens: int, checkpointing: bool
) -> None:
    from services.learner.step import MemoryOptions, backward

    model = load(model_dir)
    batch = trajectories(model, seed=4)
    config = ObjectiveConfig()
    model.zero_grad(set_to_none=True)
    saved_metrics = vcpo_backward(StepInputs(model, batch, config))
    saved = grads(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    memory = MemoryOptions("recompute", chunk_tokens)
    for mb in (None, 3, 1):
        model.zero_grad(set_to_none=True)
        metrics = backward(StepInputs(model, batch, config, micro_batch_size=mb, memory=memory))
        # the saved path scales the backward signal after Qwen2's float32 RMSNorm, recompute before it
        close(grads(model), saved, RMSNORM_TOL)
        for key in ("loss", "ess_ratio", "baseline_shift_mean_abs"):
            assert metrics[key] == pytest.approx(saved_metrics[key], rel=1e-9), key
    # a rank among peers with more micro-batches and longer rows: padding micro-batches, and the head in as
    # many slices as the peers' (every slice is a ZeRO-3 gather), change nothing
    model.zero_grad(set_to_none=True)
    backward(
        StepInputs(model, batch, config, micro_batch_size=4, collectives=_Agree(5, chunks=9), memory=memory)
    )
    close(grads(model), saved, RMSNORM_TOL)


@pytest.mark.parametrize("objective", ["grpo", "vcpo"])
def test_head_in_slices_changes_no_ordinary_step(model_dir: Path, objective: str) -> None:
    """GRPO's ordinary path, and VCPO with PPO clipping (streaming norms, then the per-token loss)."""
    from services.learner.step import MemoryOptions, backward

    model = load(model_dir)
    batch = trajectories(model, seed=5)
    config = ObjectiveConfig(objective=objective, ppo_clip=0.2 if objective == "vcpo" else 0.0)  # type: ignore[arg-type]
    results = []
    for memory in (MemoryOptions(), MemoryOptions("recompute", 3)):
        for mb in (None, 3):
            model.zero_grad(set_to_none=True)
            results.append(
                (backward(StepInputs(model, batch, config, mb, memory=memory))["loss"], grads(model))
            )
    for loss, g in results[1:]:
        close(g, results[0][1], 1e-9)
        assert loss == pytest.approx(results[0][0], rel=1e-9)


def test_memory_options_are_checked() -> None:
    from services.learner.step import MemoryOptions

    with pytest.raises(ValueError, match="memory mode must be 'saved' or 'recompute'"):
        MemoryOptions("auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logit_chunk_tokens must be >= 0"):
        MemoryOptions("saved", -1)


MIXED = [9, 31, 6, 12, 7, 30, 8, 10]  # row lengths: one long row in each group, the rest short
MIXED_GROUPS = [7, 3, 7, 3, 7, 3, 7, 3]  # the groups interleave with the lengths: sorting splits them


def mixed(
    vocab: int, padding: str = "right", seed: int = 0, model: nn.Module | None = None
) -> TrajectoryTensors:
    """Rows of the lengths MIXED (3 prompt tokens, then the response), padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    width = max(MIXED)
    ids = torch.zeros(len(MIXED), width, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, n in enumerate(MIXED):
        sl = slice(width - n, width) if padding == "left" else slice(0, n)
        ids[r, sl], attn[r, sl] = torch.randint(3, vocab, (n,), generator=g), 1
        resp[r, sl] = (torch.arange(n) >= 3).long()
    behaviour = torch.zeros(ids.shape, dtype=torch.float64)
    if model is not None:
        with torch.no_grad():
            behaviour = token_logprobs(model, ids, attn) + 0.3 * torch.randn(
                ids.shape, generator=g, dtype=torch.float64
            )
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 1.0, 0.0], dtype=torch.float64)
    return TrajectoryTensors(ids, attn, resp, behaviour, rewards, torch.tensor(MIXED_GROUPS))


def _memory(mode: str, chunk_tokens: int = 0):  # type: ignore[no-untyped-def]
    from services.learner.step import MemoryOptions

    return MemoryOptions(mode, chunk_tokens)  # type: ignore[arg-type]


# every path of the step: (objective config, memory options)
PATHS = {
    "vcpo-saved": (ObjectiveConfig(), ("saved", 0)),
    "vcpo-recompute-head-in-slices": (ObjectiveConfig(), ("recompute", 4)),
    "vcpo-ppo-clip": (ObjectiveConfig(ppo_clip=0.2), ("saved", 0)),
    "grpo": (ObjectiveConfig(objective="grpo"), ("saved", 0)),
    "rloo-head-in-slices": (ObjectiveConfig(objective="rloo"), ("recompute", 5)),
}
# MIXED sorted longest first, 3 rows per micro-batch: (31, 30, 12), (10, 9, 8), (7, 6)
TRIMMED = [(3, 31), (3, 10), (2, 7)]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_forward_runs_its_micro_batch_at_its_own_longest_row(
    model_dir: Path, path: str, padding: str
) -> None:
    """One long trajectory must not set the width of every micro-batch: the rows are sorted by length and each
    forward (counted by a hook on the decoder, which every path calls) runs [rows, its own longest row]."""
    from services.learner.step import backward

    model = load(model_dir)
    batch = mixed(model.config.vocab_size, padding, model=model)
    config, memory = PATHS[path]
    seen: list[tuple[int, int]] = []  # (rows, positions) of every forward
    longest: list[int] = []  # its longest row's tokens

    def count(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, torch.Tensor]) -> None:
        seen.append(tuple(kwargs["input_ids"].shape))  # type: ignore[arg-type]
        longest.append(int(kwargs["attention_mask"].sum(1).max()))

    handle = model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        backward(StepInputs(model, batch, config, micro_batch_size=3, memory=_memory(*memory)))
        passes = len(seen) // len(TRIMMED)
        assert passes >= 1 and seen == TRIMMED * passes
        assert [w for _, w in seen] == longest  # no column is padding in every row of its micro-batch
        positions = sum(r * w for r, w in seen)
        assert positions == passes * 137 < passes * len(MIXED) * max(MIXED)  # 137 against 248 per pass
        seen.clear()  # the full-width switch (benchmarks' baseline): the rows in order, every one 31 wide
        backward(StepInputs(model, batch, config, 3, memory=_memory(*memory), full_width=True))
        assert seen == [(3, 31), (3, 31), (2, 31)] * passes
    finally:
        handle.remove()


class _Recording(_Agree):
    """A single rank's collectives that keep the valid log weights the step hands over for the global ρ."""

    def __init__(self) -> None:
        super().__init__(1)
        self.log_weights: list[torch.Tensor] = []

    def ess_ratio(self, log_weights: torch.Tensor) -> float:
        self.log_weights.append(log_weights.detach().clone())
        return super().ess_ratio(log_weights)


@pytest.mark.parametrize("path", list(PATHS))
def test_sorted_and_trimmed_micro_batches_give_the_full_width_step_row_by_row(
    model_dir: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same gradient, loss, metrics and per-row log-probs, norms and log weights, in the batch's row order
    (against brute force for the norms and one whole-batch forward for the log-probs), with the rows sorted
    and each micro-batch trimmed as with every micro-batch at full width in the given order."""
    from services.learner import step as step_module
    from services.learner.step import backward
    from services.learner.vcpo import METRIC_KEYS

    model = load(model_dir)
    batch = mixed(model.config.vocab_size, seed=1, model=model)
    config, memory = PATHS[path]
    whole_step: list[
        tuple[torch.Tensor, torch.Tensor | None]
    ] = []  # what every whole-step statistic is formed from
    policy = step_module._policy

    def recording_policy(
        b: TrajectoryTensors, logprobs: torch.Tensor, norms: torch.Tensor | None
    ) -> PolicyBatch:
        whole_step.append((logprobs.detach().clone(), norms))
        return policy(b, logprobs, norms)

    monkeypatch.setattr(step_module, "_policy", recording_policy)
    runs = []
    for full_width in (True, False):
        whole_step.clear()
        collectives = _Recording()
        model.zero_grad(set_to_none=True)
        metrics = backward(
            StepInputs(
                model,
                batch,
                config,
                3,
                collectives=collectives,
                memory=_memory(*memory),
                full_width=full_width,
            )
        )
        runs.append((metrics, grads(model), whole_step[0], collectives.log_weights))
    (m_full, g_full, (lp_full, n_full), w_full), (m_trim, g_trim, (lp_trim, n_trim), w_trim) = runs
    close(g_trim, g_full, 1e-10)
    for key in METRIC_KEYS:
        assert m_trim[key] == pytest.approx(m_full[key], rel=1e-9, nan_ok=True), key
    assert m_trim["num_valid"] == len(MIXED) and m_trim["advantage_abs_mean"] > 0
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False  # nothing predicts a row's first token
    with torch.no_grad():
        expected = token_logprobs(model, batch.input_ids, batch.attention_mask)
    for lp in (lp_full, lp_trim):
        torch.testing.assert_close(lp[real], expected[real], rtol=0, atol=1e-10)
    short = torch.tensor(MIXED) <= 7  # the last micro-batch's rows, trimmed to 7 columns: zeros beyond them
    assert lp_trim[short, 7:].eq(0).all() and not lp_full[short, 7:].eq(0).all()
    assert len(w_full) == len(w_trim) >= 1
    torch.testing.assert_close(w_trim[0], w_full[0], rtol=1e-10, atol=1e-12)  # one per row, in row order
    if config.spec.needs_sq_grad_norms:
        assert n_full is not None and n_trim is not None
        brute = per_trajectory_sq_grad_norms(
            model, batch.input_ids, batch.attention_mask, batch.response_mask, 1
        )
        model.zero_grad(set_to_none=True)
        for norms in (n_full, n_trim):
            assert float(((norms - brute).abs() / brute).max()) <= 1e-8


def test_the_memory_mode_is_sized_by_the_micro_batches_the_step_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory_mode = "auto"`` weighs the saved path's memory at each micro-batch's own width, as the step
    runs it, not at the width of the rank's longest row."""
    from types import SimpleNamespace

    from services.learner.trainer import Trainer

    sized: list[list[tuple[int, int]]] = []

    class Plan:
        def mode_for(self, shapes: list[tuple[int, int]]) -> str:
            sized.append(shapes)
            return "saved"

    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t, op=None: None
    )  # one rank: nothing to agree
    for full_width, expected in ((False, TRIMMED), (True, [(3, 31), (3, 31), (2, 31)])):
        trainer = SimpleNamespace(
            config=SimpleNamespace(memory_mode="auto", micro_batch_size=3),
            memory_plan=Plan(),
            collectives=SimpleNamespace(device=torch.device("cpu")),
            full_width=full_width,
        )
        assert Trainer._memory_mode(trainer, mixed(SPEC.vocab_size)) == "saved"  # type: ignore[arg-type]
        assert sized.pop() == expected


def _adapted_with_dropout(model_dir: Path) -> nn.Module:
    from services.learner.config import LoraConfig
    from services.learner.lora import apply_lora

    model = apply_lora(load(model_dir), LoraConfig(rank=4, dropout=0.5))
    for name, p in model.named_parameters():  # peft starts B at 0: give the adapters something to carry
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float64
    return model


def test_every_pass_over_a_micro_batch_draws_the_dropout_masks_of_its_first(model_dir: Path) -> None:
    """LoRA with adapter dropout: the recompute path's norm pass and gradient pass of a micro-batch drop the
    same activations, so its step is the saved path's, whose single pass draws each micro-batch's masks once
    (without the replay the norms would be of one mask and the gradient of another)."""
    from services.learner.step import MemoryOptions, backward

    model = _adapted_with_dropout(model_dir)
    batch = trajectories(model, seed=5)

    def step(seed: int, memory: MemoryOptions) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        metrics = backward(StepInputs(model, batch, ObjectiveConfig(), micro_batch_size=3, memory=memory))
        return grads(model), metrics

    saved, saved_metrics = step(0, MemoryOptions())
    assert all(("lora_A" in n or "lora_B" in n) for n in saved)  # the base is frozen
    recompute, metrics = step(0, MemoryOptions("recompute", 4))
    close(recompute, saved, RMSNORM_TOL)
    for key in ("loss", "ess_ratio"):
        assert metrics[key] == pytest.approx(saved_metrics[key], rel=1e-9), key
    other, _ = step(1, MemoryOptions())  # other masks, another gradient: the dropout is really on
    assert max(float((other[n] - saved[n]).norm() / saved[n].norm()) for n in saved) > 0.01


def test_the_live_pass_of_a_micro_batch_drops_what_its_detached_pass_dropped(model_dir: Path) -> None:
    """The ordinary path (grpo) over several micro-batches: whole-step statistics from a detached pass, then a
    live pass per micro-batch; with dropout both draw the same masks, so the gradient is that of one pass."""
    from services.learner.step import plan_step

    model = _adapted_with_dropout(model_dir)
    batch = trajectories(model, seed=6)
    config = ObjectiveConfig(objective="grpo")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    policy_gradient_backward(StepInputs(model, batch, config, micro_batch_size=3))
    stepped = grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the reference: each micro-batch's forward once, with its graph
    plan = plan_step(batch, 3)
    logprobs = plan.gather([token_logprobs(model, r.input_ids, r.attention_mask) for r in plan.rows()])
    policy = PolicyBatch(
        logprobs, batch.behaviour_logprobs, batch.response_mask.bool(), batch.rewards, batch.group_ids
    )
    policy_loss(policy, config)[0].backward()
    close(stepped, grads(model), 1e-10)
