"""VCPO's per-trajectory gradient norms over LoRA adapters (peft) against one backward per trajectory.

With LoRA, θ being trained is the adapters' A and B matrices: the norms and the weighted gradient are taken
over them alone. A projection's A and B are linear maps with their own inputs and output gradients, so the
linear rule covers them; a LoRA embedding's B is a linear map of s·Aᵀ[ids] and its Aᵀ an embedding
(norm_rules.LoraEmbedding); a LoRA output head's share comes from the sliced head pass (norm_rules.head_pass).
Every memory mode (saved; streaming plain, checkpointed, with the head in slices) and several micro-batch
sizes, in float32 (1e-4) and float64 (1e-8).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from services.learner.config import PROJECTIONS
from services.learner.grad_norms import norm_pass, per_trajectory_sq_grad_norms, streaming_norm_pass
from services.learner.logprobs import token_logprobs
from tests.test_grad_norms import STREAMING, brute_force, make_batch, perturb, rel_err, tiny_model_dirs

TARGETS = {
    "projections": list(PROJECTIONS),
    "with-embedding-and-head": [*PROJECTIONS, "embed_tokens", "lm_head"],
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("lora-models"))


def lora_model(
    model_dirs: dict[bool, Path], tied: bool, dtype: torch.dtype, targets: str, dropout: float = 0.0
) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[tied], dtype=dtype)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS[targets])
    model = get_peft_model(model, config)
    perturb(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), trainable  # only the adapters train
    return model.train()


# a tied base matters where the adapters sit on the tied matrix's two uses (embedding and head)
CASES = [("projections", False), ("with-embedding-and-head", False), ("with-embedding-and-head", True)]


@pytest.mark.parametrize(
    ("targets", "tied"), CASES, ids=["projections", "embedding-head", "embedding-head-tied"]
)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float64, 1e-8)], ids=["f32", "f64"])
def test_adapter_norms_match_brute_force_in_every_memory_mode(
    model_dirs, targets: str, tied: bool, dtype: torch.dtype, tol: float
) -> None:
    model = lora_model(model_dirs, tied, dtype, targets)
    ids, attn, resp = make_batch(300, "left" if tied else "right")
    expected = brute_force(model, ids, attn, resp)  # over the parameters that train: the adapters
    logp = token_logprobs(model, ids, attn).detach()
    for micro_batch in (1, 8):  # saved
        got = per_trajectory_sq_grad_norms(model, ids, attn, resp, micro_batch_size=micro_batch)
        assert rel_err(got, expected) <= tol, ("saved", micro_batch, got, expected)
    for checkpointing, chunks in STREAMING:  # streaming (memory_mode recompute)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for micro_batch in (3, 8):
            parts = [
                streaming_norm_pass(
                    model,
                    ids[a : a + micro_batch],
                    attn[a : a + micro_batch],
                    resp[a : a + micro_batch],
                    chunks,
                )
                for a in range(0, 8, micro_batch)
            ]
            norms = torch.cat([n for n, _ in parts])
            assert rel_err(norms, expected) <= tol, (checkpointing, chunks, micro_batch, norms, expected)
            assert torch.allclose(
                torch.cat([p for _, p in parts]), logp, atol=1e-5 if dtype == torch.float32 else 1e-12
            )
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient was formed


@pytest.mark.parametrize("form", ["ghost", "per-row"])
def test_a_lora_head_s_norm_in_both_forms_when_sliced(
    model_dirs, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """The head's B is a linear map onto the vocabulary: its norm in the Gram form (summed over vocabulary
    slices) and per row; A's from e = Σ_v δ[v] B_v, which also carries the adapter's part of ∂f/∂hidden."""
    import services.learner.norm_rules as rules

    model = lora_model(model_dirs, False, torch.float64, "with-embedding-and-head")
    ghost = rules._ghost
    monkeypatch.setattr(rules, "_ghost", lambda t, i, o: form == "ghost" if o == 300 else ghost(t, i, o))
    ids, attn, resp = make_batch(300, "left", rows=4)
    expected = brute_force(model, ids, attn, resp)
    got, logp = streaming_norm_pass(model, ids, attn, resp, chunks=3)
    assert rel_err(got, expected) <= 1e-8, (got, expected)
    assert torch.allclose(logp, token_logprobs(model, ids, attn).detach(), atol=1e-12)


@pytest.mark.parametrize("targets", list(TARGETS))
def test_the_weighted_adapter_gradient_equals_one_backward_per_row(model_dirs, targets: str) -> None:
    """The saved pass's Σ_i c_i ∇f_i over the adapters (what the optimizer steps on), LoRA embedding included."""
    model = lora_model(model_dirs, False, torch.float64, targets)
    ids, attn, resp = make_batch(300, "left", seed=3)
    coef = torch.linspace(-1.5, 2.0, 8, dtype=torch.float64)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_row = {n: torch.zeros_like(p) for n, p in trainable.items()}
    for r in range(8):
        model.zero_grad(set_to_none=True)
        logp_r = token_logprobs(model, ids[r : r + 1], attn[r : r + 1])
        torch.where(resp[r : r + 1].bool(), logp_r, 0.0).sum().backward()
        for n, p in trainable.items():
            per_row[n] += coef[r] * p.grad
    model.zero_grad(set_to_none=True)
    result = norm_pass(model, ids, attn, resp)
    result.accumulate_weighted_gradients(coef)
    for name, p in model.named_parameters():
        if name not in trainable:
            assert p.grad is None, name  # the frozen base gets no gradient
            continue
        assert p.grad is not None, name
        err = float((p.grad - per_row[name]).norm() / per_row[name].norm().clamp_min(1e-30))
        assert err <= 1e-10, (name, err)


def test_what_the_rules_cannot_reproduce_is_refused_by_name(model_dirs) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ids, attn, resp = make_batch(300, "right", rows=2)
    # dropout on the head: the sliced pass forms the head's logits without it
    model = lora_model(model_dirs, False, torch.float32, "with-embedding-and-head", dropout=0.1)
    with pytest.raises(NotImplementedError, match=r"output head: adapter 'default' has dropout 0\.1"):
        streaming_norm_pass(model, ids, attn, resp, chunks=2)
    streaming_norm_pass(model.eval(), ids, attn, resp, chunks=2)  # no dropout in eval mode
    # DoRA on the embedding: no rule
    base = AutoModelForCausalLM.from_pretrained(model_dirs[False], dtype=torch.float32)
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["embed_tokens"], use_dora=True))
    with pytest.raises(NotImplementedError, match="embed_tokens: only plain LoRA on an unscaled embedding"):
        norm_pass(dora, ids, attn, resp)


def test_the_learner_refuses_targets_it_cannot_adapt_or_publish_naming_them(model_dirs) -> None:
    """``[learner.lora]`` at start-up (services/learner/lora.py): a name that matches no module, a name that
    matches only modules LoRA cannot adapt, the head or embedding of a tied model (a merged version would
    put one adapter into both uses of the tied matrix), and the head or embedding of any model when versions are
    the adapters alone (vLLM serves no adapter on them)."""
    from transformers import AutoModelForCausalLM

    from services.learner.config import LoraConfig
    from services.learner.lora import apply_lora

    def adapt(tied: bool, targets: list[str], publish: str = "adapter") -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(model_dirs[tied], dtype=torch.float32)
        return apply_lora(model, LoraConfig(rank=4, target_modules=targets, publish=publish))

    with pytest.raises(ValueError, match=r"'qproj' names no module of Qwen2ForCausalLM .*q_proj"):
        adapt(False, ["q_proj", "qproj"])
    with pytest.raises(ValueError, match=r"'mlp' names modules LoRA cannot adapt \(Qwen2MLP\)"):
        adapt(False, ["mlp"])
    for name in ("lm_head", "embed_tokens", "model.embed_tokens"):
        with pytest.raises(ValueError, match="tied"):
            adapt(True, ["q_proj", name], publish="merged")
        for tied in (False, True):  # an adapter version could not carry it, tied or not
            with pytest.raises(ValueError, match=rf"\['{name}'\] adapt the output head or input embedding"):
                adapt(tied, ["q_proj", name])
    model = adapt(False, ["q_proj", "lm_head"], publish="merged")  # untied and merged: both fine
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == model.config.num_hidden_layers + 1
