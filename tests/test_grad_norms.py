"""The norm pass against brute force: one backward per trajectory on the tiny Qwen2 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.grad_norms import norm_pass, per_trajectory_sq_grad_norms, streaming_norm_pass
from services.learner.logprobs import token_logprobs


def tiny_model_dirs(root: Path) -> dict[bool, Path]:
    """The tiny Qwen2 model of these tests, with its output head untied and tied to the embedding."""
    spec = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 96,
        "vocab_size": 300,
    }
    return {
        tied: build_tiny_model(root / f"tied-{tied}", TinyModelSpec(tie_word_embeddings=tied, **spec))
        for tied in (False, True)
    }


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("models"))


def perturb(model: nn.Module) -> None:
    """Add small noise to every weight: fresh RMSNorm weights are all 1 and one matrix of each LoRA adapter
    starts at 0, which would leave terms of the norms untested."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def load(model_dirs: dict[bool, Path], tied: bool, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs[tied], dtype=dtype)  # sdpa, the default
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    perturb(model)
    return model.train()


def make_batch(vocab: int, padding: str, rows: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Ragged prompt+response rows, padded to one length; responses with a masked-out "tool output" span."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(6, 30, (rows,), generator=g)]
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    resp = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        row = torch.randint(3, vocab, (n,), generator=g)
        row[1:n:5] = row[0]  # repeated token ids: the embedding rule's id grouping matters
        prompt = int(torch.randint(1, n - 2, (1,), generator=g))
        m = torch.zeros(n, dtype=torch.long)
        m[prompt:] = 1
        if n - prompt > 6:
            m[prompt + 2 : prompt + 4] = 0  # tool output inside the response
        sl = slice(width - n, width) if padding == "left" else slice(0, n)
        ids[r, sl], attn[r, sl], resp[r, sl] = row, 1, m
    return ids, attn, resp


def brute_force(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
    out = []
    for r in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model, ids[r : r + 1], attn[r : r + 1])
        torch.where(resp[r : r + 1].bool(), logp, 0.0).sum().backward()
        out.append(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    model.zero_grad(set_to_none=True)
    return torch.stack(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float64, 1e-8)], ids=["f32", "f64"])
def test_norms_match_brute_force(
    model_dirs, tied: bool, padding: str, dtype: torch.dtype, tol: float
) -> None:
    model = load(model_dirs, tied, dtype)
    ids, attn, resp = make_batch(model.config.vocab_size, padding)
    expected = brute_force(model, ids, attn, resp)
    for micro_batch in (1, 8):
        got = per_trajectory_sq_grad_norms(model, ids, attn, resp, micro_batch_size=micro_batch)
        assert got.shape == (8,) and got.dtype == torch.float64
        assert rel_err(got, expected) <= tol, (micro_batch, got, expected)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient was formed


# the streaming pass (memory_mode recompute): norms formed inside the backward, optionally with the layers
# checkpointed and the output head in slices of the positions (its norm by slices of the vocabulary)
STREAMING = [(False, 0), (True, 0), (False, 4), (True, 3)]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.float64, 1e-8)], ids=["f32", "f64"])
@pytest.mark.parametrize(
    ("checkpointing", "chunks"), STREAMING, ids=["plain", "ckpt", "chunked", "ckpt-chunked"]
)
def test_streaming_norms_match_brute_force(
    model_dirs, tied: bool, padding: str, dtype: torch.dtype, tol: float, checkpointing: bool, chunks: int
) -> None:
    model = load(model_dirs, tied, dtype)
    ids, attn, resp = make_batch(model.config.vocab_size, padding)
    expected = brute_force(model, ids, attn, resp)
    logp = token_logprobs(model, ids, attn).detach()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for micro_batch in (1, 3, 8):
        got, lp = [], []
        for a in range(0, 8, micro_batch):
            n, p = streaming_norm_pass(
                model, ids[a : a + micro_batch], attn[a : a + micro_batch], resp[a : a + micro_batch], chunks
            )
            got.append(n)
            lp.append(p)
        norms = torch.cat(got)
        assert norms.dtype == torch.float64 and norms.shape == (8,)
        assert rel_err(norms, expected) <= tol, (micro_batch, norms, expected)
        assert torch.allclose(torch.cat(lp), logp, atol=1e-5 if dtype == torch.float32 else 1e-12)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient was formed


@pytest.mark.parametrize("form", ["ghost", "per-row"])
@pytest.mark.parametrize("variant", ["head-bias", "frozen-head", "head-only", "frozen-decoder-tied"])
def test_sliced_head_pass_matches_brute_force(
    model_dirs, monkeypatch: pytest.MonkeyPatch, form: str, variant: str
) -> None:
    """The output head's share without autograd (head_pass): its norm in both forms, with a bias, and
    ∂f/∂hidden into the decoder's backward whether the head trains or not."""
    import services.learner.norm_rules as gn

    model = load(model_dirs, variant == "frozen-decoder-tied", torch.float64)
    if variant == "head-bias":
        old = model.lm_head
        model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True, dtype=torch.float64)
        with torch.no_grad():
            model.lm_head.weight.copy_(old.weight)
            model.lm_head.bias.copy_(
                0.3 * torch.randn(old.out_features, generator=torch.Generator().manual_seed(2))
            )
    elif variant == "frozen-head":
        model.lm_head.requires_grad_(False)
    elif variant == "head-only":
        model.requires_grad_(False)
        model.lm_head.requires_grad_(True)
    else:  # tied: only the shared embedding / head matrix trains, both its uses
        model.requires_grad_(False)
        model.model.embed_tokens.weight.requires_grad_(True)
    ghost = gn._ghost
    monkeypatch.setattr(
        gn, "_ghost", lambda t, i, o: form == "ghost" if o == model.config.vocab_size else ghost(t, i, o)
    )
    ids, attn, resp = make_batch(model.config.vocab_size, "left", rows=4)
    expected = brute_force(model, ids, attn, resp)
    got, logp = streaming_norm_pass(model, ids, attn, resp, chunks=3)
    assert rel_err(got, expected) <= 1e-8, (got, expected)
    assert torch.allclose(logp, token_logprobs(model, ids, attn).detach(), atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_streaming_pass_refuses_what_the_saved_pass_refuses(model_dirs) -> None:
    model = load(model_dirs, False, torch.float32)
    ids, attn, resp = make_batch(model.config.vocab_size, "right")
    bad = resp.clone()
    bad[:, 0] = 1
    with pytest.raises(ValueError, match=r"response_mask\[:, 0\] must be 0"):
        streaming_norm_pass(model, ids, attn, bad)

    class Twice(nn.Module):  # a module used twice in one forward has no per-call norm rule
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
            x = torch.ones(*input_ids.shape, 4)
            return type("Out", (), {"logits": self.lin(self.lin(x))})()

    with pytest.raises(NotImplementedError, match="called twice"):
        streaming_norm_pass(Twice(), ids[:, :5], attn[:, :5], resp[:, :5].clamp(max=0))
    with pytest.raises(ValueError, match=r"learner\.logit_chunk_tokens = 0"):
        streaming_norm_pass(Twice(), ids[:, :5], attn[:, :5], resp[:, :5].clamp(max=0), chunks=2)


def test_padding_and_batch_neighbours_do_not_change_a_row(model_dirs) -> None:
    model = load(model_dirs, False, torch.float64)
    ids, attn, resp = make_batch(model.config.vocab_size, "right")
    alone = torch.cat(
        [
            per_trajectory_sq_grad_norms(model, ids[r : r + 1], attn[r : r + 1], resp[r : r + 1])
            for r in range(8)
        ]
    )
    together = per_trajectory_sq_grad_norms(model, ids, attn, resp)
    assert rel_err(together, alone) <= 1e-10
    # the same rows left-padded: positions follow the mask, so the values are the same
    lids, lattn, lresp = make_batch(model.config.vocab_size, "left")
    assert rel_err(per_trajectory_sq_grad_norms(model, lids, lattn, lresp), together) <= 1e-8


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weighted_gradient_equals_autograd_of_the_weighted_loss(model_dirs, tied: bool) -> None:
    model = load(model_dirs, tied, torch.float64)
    ids, attn, resp = make_batch(model.config.vocab_size, "left", seed=3)
    coef = torch.linspace(-1.5, 2.0, 8, dtype=torch.float64)
    coef[2] = 0.0

    # Σ_i c_i ∇f_i, one backward per row
    per_row = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(8):
        model.zero_grad(set_to_none=True)
        logp_r = token_logprobs(model, ids[r : r + 1], attn[r : r + 1])
        torch.where(resp[r : r + 1].bool(), logp_r, 0.0).sum().backward()
        for n, p in model.named_parameters():
            per_row[n] += coef[r] * p.grad
    # the ordinary backward of the weighted loss
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model, ids, attn)
    (torch.where(resp.bool(), logp, 0.0).sum(1) * coef).sum().backward()
    ordinary = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    result = norm_pass(model, ids, attn, resp)
    assert all(p.grad is None for p in model.parameters())
    result.accumulate_weighted_gradients(coef)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        exact = float((p.grad - per_row[name]).norm() / per_row[name].norm().clamp_min(1e-30))
        assert exact <= 1e-10, (name, exact)
        # Qwen2's RMSNorm computes in float32 even in a float64 model, so scaling the backward signal
        # before or after it differs at float32 round-off
        close = float((p.grad - ordinary[name]).norm() / ordinary[name].norm().clamp_min(1e-30))
        assert close <= 1e-5, (name, close)
    # the log-probs the pass returns are the forward's
    assert torch.allclose(result.token_logprobs, logp.detach(), atol=1e-12)
    with pytest.raises(RuntimeError, match="already used or released"):
        result.accumulate_weighted_gradients(coef)


def test_bad_inputs_are_named(model_dirs) -> None:
    model = load(model_dirs, False, torch.float32)
    ids, attn, resp = make_batch(model.config.vocab_size, "right")
    bad = resp.clone()
    bad[:, 0] = 1
    with pytest.raises(ValueError, match=r"response_mask\[:, 0\] must be 0"):
        per_trajectory_sq_grad_norms(model, ids, attn, bad)
    bad = resp.clone()
    row = int((attn == 0).any(1).nonzero()[0])
    bad[row, -1] = 1
    with pytest.raises(ValueError, match=rf"marks padding .* in rows \[{row}\]"):
        per_trajectory_sq_grad_norms(model, ids, attn, bad)
    with pytest.raises(ValueError, match="response_mask shape"):
        per_trajectory_sq_grad_norms(model, ids, attn, resp[:, 1:])
    result = norm_pass(model, ids, attn, resp)
    with pytest.raises(ValueError, match=r"coefficients must have shape \(8,\)"):
        result.accumulate_weighted_gradients(torch.ones(3))
    with pytest.raises(ValueError, match="coefficients must be finite"):
        result.accumulate_weighted_gradients(torch.full((8,), float("nan")))


def test_empty_response_rows_have_zero_norm(model_dirs) -> None:
    model = load(model_dirs, False, torch.float64)
    ids, attn, resp = make_batch(model.config.vocab_size, "right")
    resp[3] = 0
    got = per_trajectory_sq_grad_norms(model, ids, attn, resp)
    assert got[3] == 0 and (got[torch.arange(8) != 3] > 0).all()


def test_frozen_parameters_are_left_out_and_unknown_modules_refused(model_dirs) -> None:
    model = load(model_dirs, False, torch.float64)
    ids, attn, resp = make_batch(model.config.vocab_size, "right", rows=3)
    model.model.embed_tokens.weight.requires_grad_(False)
    for layer in model.model.layers[:1]:
        layer.requires_grad_(False)
    assert (
        rel_err(per_trajectory_sq_grad_norms(model, ids, attn, resp), brute_force(model, ids, attn, resp))
        <= 1e-8
    )

    class WithLayerNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)

    with pytest.raises(NotImplementedError, match=r"'norm' \(LayerNorm\) owns trainable parameters"):
        norm_pass(WithLayerNorm(), ids, attn, resp)


def _as_float64(result: Any) -> tuple[list[Any], dict[int, Any]]:
    """A norm pass's captures with the very same activations and backward signals in float64."""
    from dataclasses import replace

    # token ids stay ids, and RMSNorm inputs stay bf16: x̂ is recomputed from them as the model rounds it
    caps = {
        id(c): replace(c, x=c.x if c.kind != "linear" else c.x.double(), delta=c.delta.double())
        for c in result.captures
    }
    uses = {k: (p, [(caps[id(c)], role) for c, role in us]) for k, (p, us) in result.params.items()}
    return list(caps.values()), uses


# bf16 activations are what they are; what the pass adds on top must be float32 round-off, not bf16's
# (2^-8 ≈ 4e-3 per addition): stated tolerances, relative to a float64 reduction of the same activations
BF16_NORM_TOL = 1e-4
BF16_GRAD_ULPS = 1  # the weighted gradient, formed over all micro-batches, is rounded to bf16 once


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_norms_are_reduced_in_float32(model_dirs, tied: bool, device: str) -> None:
    from services.learner.grad_norms import _sq_norms

    model = load(model_dirs, tied, torch.bfloat16).to(device)
    ids, attn, resp = (t.to(device) for t in make_batch(model.config.vocab_size, "right", rows=8, seed=5))
    result = norm_pass(model, ids, attn, resp)
    reference = _sq_norms(*_as_float64(result), ids)
    assert result.sq_grad_norms.dtype == torch.float64
    assert rel_err(result.sq_grad_norms, reference) <= BF16_NORM_TOL
    # and the whole bf16 pass stays near the float64 model's exact norms (bf16 forward noise only)
    import copy

    exact = brute_force(copy.deepcopy(model).double(), ids, attn, resp)  # the same (bf16-valued) weights
    assert rel_err(result.sq_grad_norms, exact) <= 0.05


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(("checkpointing", "chunks"), [(False, 0), (True, 3)], ids=["plain", "ckpt-chunked"])
def test_bf16_streaming_norms_stay_near_the_exact_ones(
    model_dirs, tied: bool, device: str, checkpointing: bool, chunks: int
) -> None:
    """The streaming pass on a bf16 model: bf16 forward noise only, like the saved pass (0.05 of the float64
    model's exact norms); within 5e-3 of the saved pass (measured: up to 6e-4; the sliced head's δ is float32)."""
    import copy

    model = load(model_dirs, tied, torch.bfloat16).to(device)
    ids, attn, resp = (t.to(device) for t in make_batch(model.config.vocab_size, "right", rows=8, seed=5))
    exact = brute_force(copy.deepcopy(model).double(), ids, attn, resp)
    saved = norm_pass(model, ids, attn, resp).sq_grad_norms
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, _ = streaming_norm_pass(model, ids, attn, resp, chunks)
    assert got.dtype == torch.float64
    assert rel_err(got, exact) <= 0.05
    assert rel_err(got, saved) <= 5e-3


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weighted_gradient_is_summed_over_micro_batches_in_float32(model_dirs, device: str) -> None:
    """Within float32 summation's error bound of the float64 sum of the same products, then one rounding to
    bf16; summing the micro-batches' bf16 gradients (autograd's way) breaks the same bound."""
    from dataclasses import replace

    from services.learner.grad_norms import _weighted_grad_fn, accumulate_weighted_gradients

    model = load(model_dirs, False, torch.bfloat16).to(device)
    ids, attn, resp = (t.to(device) for t in make_batch(model.config.vocab_size, "right", rows=32, seed=6))
    coef = torch.linspace(-1.0, 1.5, 32, dtype=torch.float64, device=device)
    passes = [norm_pass(model, ids[a : a + 1], attn[a : a + 1], resp[a : a + 1]) for a in range(32)]
    coefs = [coef[a : a + 1] for a in range(32)]
    converted = [_as_float64(p) for p in passes]
    # |products|: the same formula on |δ|, |x| (|x̂| for RMSNorm, whose scale is positive) and |c|
    absolute = [
        (
            caps,
            {
                k: (
                    p,
                    [
                        (replace(c, x=c.x if c.kind == "embedding" else c.x.abs(), delta=c.delta.abs()), r)
                        for c, r in us
                    ],
                )
                for k, (p, us) in uses.items()
            },
        )
        for caps, uses in converted
    ]

    def formed(key: int, source: list[Any], cs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        uses = [(use, c) for (_, us), c in zip(source, cs, strict=True) for use in us[key][1]]
        shadow = torch.nn.Parameter(torch.zeros(passes[0].params[key][0].shape, dtype=dtype, device=device))
        return _weighted_grad_fn(shadow, uses)()

    # float32 sums of n products err by at most n·2^-24 of the products' absolute sum (Higham's γ_n): many of
    # the result's own ulps where the products nearly cancel. A bf16 sum errs by ~2^-9 of it per addition.
    n = ids.numel()  # products per element: every token of every micro-batch
    bounds, references = {}, {}
    for key in passes[0].params:
        references[key] = formed(key, converted, coefs, torch.float64)
        magnitude = formed(key, absolute, [c.abs() for c in coefs], torch.float64)
        ulp = torch.ldexp(torch.ones_like(magnitude), torch.frexp(references[key].abs()).exponent - 8)
        bounds[key] = BF16_GRAD_ULPS * ulp + (n + 3) * 2.0**-24 * magnitude  # +3: the split's dropped parts
    accumulate_weighted_gradients(passes, coefs)
    bf16_sums_break_it = False
    for key, (param, _) in passes[0].params.items():
        assert param.grad is not None and param.grad.dtype == torch.bfloat16
        excess = (param.grad.double() - references[key]).abs() / bounds[key]
        assert float(excess.max()) <= 1, (param.shape, float(excess.max()))
        # the same gradient from the micro-batches' bf16 gradients summed in bf16, as autograd's .grad would
        summed = torch.zeros_like(param.grad)
        for a in range(32):
            summed += formed(key, [(None, passes[a].params)], [coefs[a]], torch.bfloat16)
        bf16_sums_break_it |= bool(((summed.double() - references[key]).abs() > bounds[key]).any())
    assert bf16_sums_break_it
