"""Per-trajectory squared score-gradient norms in one forward and one backward (VCPO.md §5).

OPOB needs ``‖∇θ log π(τ_i)‖²`` for every trajectory. Autograd only ever gives the gradient of a sum, and
under ZeRO-3 every backward reduce-scatters, so per-trajectory gradients never exist anywhere. Instead:

    forward, with hooks saving each parametrised module's input x and output y
      └─ f = Σ_i Σ_t m_it · log π(token_it | prefix)        (rows never interact in a causal LM)
    torch.autograd.grad(f, [y of every module])             backward to layer OUTPUTS only: δ = ∂f/∂y;
                                                            no parameter gradient is formed or accumulated
    per module and trajectory i, from x_i and δ_i alone:
      Linear W:      ‖δ_iᵀ x_i‖² = Σ_{t,s} (δ_t·δ_s)(x_t·x_s)   "ghost" Gram form, or δ_iᵀx_i materialised
                                                              when T·(d_in + d_out) > d_in·d_out
      Linear bias:   ‖Σ_t δ_t‖²
      Embedding E:   Σ_{t,s: id_t = id_s} δ_t·δ_s
      RMSNorm w:     ‖Σ_t δ_t ⊙ x̂_t‖²          (x̂: the normalised input, recomputed from x)
      tied E/lm_head: ‖G_emb‖² + ‖G_head‖² + 2⟨G_emb, G_head⟩, the cross term
                      Σ_{t,s} δhead_{s, id_t} (δemb_t · h_s) without forming either matrix
    ‖∇θ log π(τ_i)‖² = the sum over parameters.

Padding contributes nothing: padded positions get δ = 0 (masked out of f, and masked keys receive no
attention). Any micro-batch size gives the same values.

The step's loss gradient is Σ_i c_i ∇f_i for per-trajectory coefficients c_i known only after the norms
(ESS and OPOB need them). Its backward signals are the norm pass's δ scaled by c_i row by row, so
:meth:`NormPassResult.accumulate_weighted_gradients` forms Σ_i c_i δ_iᵀ x_i from what the pass saved and
hands each parameter its gradient through a one-node autograd function: an ordinary backward, so gradient
hooks (ZeRO-3's partition-and-reduce) run as usual, with no second forward or full backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


@dataclass
class _Capture:
    """What one module saw in the forward: its input, its output, and (after backward) the output's grad."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "rmsnorm"
    x: Tensor | None = None  # input activations (token ids for an embedding)
    y: Tensor | None = None  # output, kept until the backward
    delta: Tensor | None = None  # ∂f/∂y


@dataclass
class NormPassResult:
    """Norms and log-probs of one micro-batch, plus what is needed to form its weighted gradient later."""

    sq_grad_norms: Tensor  # [B] float64
    token_logprobs: Tensor  # [B, T] log π(input_ids[:, t] | input_ids[:, <t]); column 0 is 0 (no prediction)
    captures: list[_Capture] = field(repr=False)
    params: dict[int, tuple[nn.Parameter, list[tuple[_Capture, str]]]] = field(repr=False)

    def accumulate_weighted_gradients(
        self, coefficients: Tensor, backward: Callable[[Tensor], None] | None = None
    ) -> None:
        """Add Σ_i c_i ∇θ f_i to every trainable parameter's ``.grad`` (through autograd hooks), then free.

        ``coefficients`` has one entry per row of this micro-batch; see :func:`accumulate_weighted_gradients`.
        """
        accumulate_weighted_gradients([self], [coefficients], backward)
        self.release()

    def release(self) -> None:
        """Drop the saved activations (when the weighted gradient will come from an ordinary backward)."""
        self.captures = []
        self.params = {}


def accumulate_weighted_gradients(
    passes: Sequence[NormPassResult],
    coefficients: Sequence[Tensor],
    backward: Callable[[Tensor], None] | None = None,
) -> None:
    """Add ``Σ_passes Σ_i c_i ∇θ f_i`` to every trainable parameter's ``.grad`` in one backward.

    One autograd node per parameter hands it the whole step's gradient, formed from the passes' saved
    activations when autograd reaches it (one parameter's gradient in memory at a time). ``backward`` runs the
    backward of the injecting scalar: ``Tensor.backward`` by default, a DeepSpeed engine's ``backward`` under
    ZeRO-3, where AccumulateGrad and ZeRO-3's partition-and-reduce hooks then run as in any backward, once
    per parameter, and no parameter is gathered (a weight gradient needs only activations). The passes stay
    usable until :meth:`NormPassResult.release`.
    """
    if not passes:
        raise ValueError("no norm passes to form a gradient from")
    if len(passes) != len(coefficients):
        raise ValueError(f"{len(passes)} norm passes but {len(coefficients)} coefficient tensors")
    for p, c in zip(passes, coefficients, strict=True):
        if not p.captures:
            raise RuntimeError("a norm pass's saved activations were already used or released")
        b = p.sq_grad_norms.shape[0]
        if c.shape != (b,):
            raise ValueError(f"coefficients must have shape ({b},), got {tuple(c.shape)}")
        if not torch.isfinite(c).all():
            raise ValueError("coefficients must be finite")
    params = [param for param, _ in passes[0].params.values()]
    with _full_shaped(params):
        dummies = []
        for key, (param, _) in passes[0].params.items():
            uses = [(use, c) for p, c in zip(passes, coefficients, strict=True) for use in p.params[key][1]]
            dummies.append(_GradInjection.apply(param, _weighted_grad_fn(param, uses)))
        (backward or Tensor.backward)(torch.stack(dummies).sum())


@contextmanager
def _full_shaped(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Give ZeRO-3-partitioned parameters their full shape, without memory, while a gradient is handed over.

    Autograd checks a gradient against the shape its parameter had when the graph was built, and
    AccumulateGrad lays ``.grad`` out like the parameter. A partitioned parameter's ``.data`` is an empty
    placeholder (its shard lives in ``ds_tensor``), so for the injection its ``.data`` is a zero-stride view
    of one element expanded to ``ds_shape``; ZeRO-3's hooks then reduce-scatter the full gradient as usual.
    The placeholders are put back afterwards. Nothing reads the values of the expanded view.
    """
    swapped: list[tuple[nn.Parameter, Tensor]] = []
    try:
        for p in params:
            shape = full_shape(p)
            if tuple(p.shape) != shape:
                swapped.append((p, p.data))
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(shape)
        yield
    finally:
        for p, placeholder in swapped:
            p.data = placeholder


class _GradInjection(torch.autograd.Function):
    """A zero whose backward hands ``param`` a precomputed gradient, so AccumulateGrad and hooks fire."""

    @staticmethod
    def forward(ctx: Any, param: Tensor, make_grad: Callable[[], Tensor]) -> Tensor:
        ctx.make_grad = make_grad
        return param.new_zeros(())

    @staticmethod
    def backward(ctx: Any, out_grad: Tensor) -> tuple[Tensor, None]:
        return ctx.make_grad() * out_grad, None


def _acc(t: Tensor) -> Tensor:
    """``t`` in an accumulation dtype: float32 for bf16/fp16 activations (their sums of products would round
    at every addition), float32 and float64 as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _rms_normalised(module: nn.Module, x: Tensor) -> Tensor:
    """x̂ exactly as Qwen2/Llama RMSNorm computes it (float32 statistics, cast back)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return h.to(x.dtype)


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The parameter's real shape, also when ZeRO-3 has partitioned it away (``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _weighted_grad_fn(
    param: nn.Parameter, uses: list[tuple[tuple[_Capture, str], Tensor]]
) -> Callable[[], Tensor]:
    def make() -> Tensor:
        # formed and summed over micro-batches in float32 at least (bf16 models: one rounding, at the end)
        grad = torch.zeros(full_shape(param), dtype=_acc(param.data).dtype, device=param.device)
        for (cap, role), coefficients in uses:
            assert cap.x is not None and cap.delta is not None
            d = _acc(cap.delta) * coefficients.to(grad.dtype)[:, None, None]
            if cap.kind == "linear" and role == "weight":
                grad += d.reshape(-1, d.shape[-1]).T @ _acc(cap.x).reshape(-1, cap.x.shape[-1])
            elif cap.kind == "linear" and role == "bias":
                grad += d.sum((0, 1))
            elif cap.kind == "embedding":
                grad.index_add_(0, cap.x.reshape(-1), d.reshape(-1, d.shape[-1]))
            elif cap.kind == "rmsnorm":
                grad += (d * _acc(_rms_normalised(cap.module, cap.x))).sum((0, 1))
        return grad.to(param.dtype)

    return make


def _trainable_uses(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]:
    """Every trainable parameter and the (module, kind, role) uses of it; unsupported owners are errors."""
    uses: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    for name, module in model.named_modules():
        own = [(pn, p) for pn, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if isinstance(module, nn.Linear):
            kind = "linear"
        elif isinstance(module, nn.Embedding):
            kind = "embedding"
            if module.max_norm is not None or module.scale_grad_by_freq:
                raise NotImplementedError(
                    f"{name}: embeddings with max_norm/scale_grad_by_freq are not supported"
                )
        elif _is_rmsnorm(module):
            kind = "rmsnorm"
        else:
            raise NotImplementedError(
                f"per-trajectory gradient norms: module {name!r} ({type(module).__name__}) owns trainable "
                f"parameters {[pn for pn, _ in own]} and has no norm rule; freeze it or add a rule"
            )
        for pn, p in own:
            uses.setdefault(id(p), (p, []))[1].append((module, kind, pn))
    for p, us in uses.values():
        kinds = sorted(k for _, k, _ in us)
        if len(us) > 1 and not (kinds == ["embedding", "linear"] and all(r == "weight" for _, _, r in us)):
            raise NotImplementedError(
                f"a parameter of shape {tuple(p.shape)} is shared as {kinds}: no cross-term rule"
            )
    return uses


@contextmanager
def _capturing(model: nn.Module, captures: dict[int, _Capture]) -> Iterator[None]:
    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> None:
        cap = captures[id(module)]
        if cap.y is not None:
            raise NotImplementedError(
                f"{type(module).__name__} was called twice in one forward: not supported"
            )
        cap.x = inputs[0].detach()
        cap.y = output

    handles = [cap.module.register_forward_hook(hook) for cap in captures.values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, so a padded row scores exactly like the unpadded sequence."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, T] log π(input_ids[:, t] | input_ids[:, <t]) in float32; column 0 (nothing predicts it) is 0."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)


def _check_inputs(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
            )
    mask = response_mask.bool()
    if mask[:, 0].any():
        raise ValueError("response_mask[:, 0] must be 0: nothing predicts a sequence's first token")
    if (mask & ~attention_mask.bool()).any():
        rows = sorted({int(r) for r in (mask & ~attention_mask.bool()).nonzero()[:, 0]})
        raise ValueError(f"response_mask marks padding (attention_mask 0) in rows {rows}")
    return mask


def _gram(a: Tensor) -> Tensor:
    return a @ a.transpose(1, 2)


def _sq_norms(
    captures: list[_Capture], uses: dict[int, tuple[nn.Parameter, list[tuple[_Capture, str]]]]
) -> Tensor:
    """Per-row squared gradient norm over all trainable parameters, from saved x and δ."""
    total: Tensor | None = None
    gram_cache: dict[
        tuple[Any, ...], Tensor
    ] = {}  # x·xᵀ of an input shared by several layers (q/k/v, gate/up)

    def add(v: Tensor) -> None:
        nonlocal total
        total = v.double() if total is None else total + v.double()

    # every product is summed in float32 at least (_acc): bf16 Gram matrices and row sums lose ~3 digits
    for _, us in uses.values():
        for cap, role in us:
            assert cap.x is not None and cap.delta is not None
            x, d = cap.x, _acc(cap.delta)
            if cap.kind == "linear" and role == "bias":
                add(d.sum(1).pow(2).sum(-1))
            elif cap.kind == "linear":
                t, d_in, d_out = x.shape[1], x.shape[-1], d.shape[-1]
                if t * (d_in + d_out) <= d_in * d_out:  # ghost: T×T Gram matrices
                    key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()))
                    if key not in gram_cache:
                        gram_cache[key] = _gram(_acc(x))
                    add((gram_cache[key] * _gram(d)).sum((1, 2)))
                else:  # materialise each row's d_out × d_in gradient
                    add((d.transpose(1, 2) @ _acc(x)).pow(2).sum((1, 2)))
            elif cap.kind == "embedding":
                same = (x[:, :, None] == x[:, None, :]).to(d.dtype)
                add((_gram(d) * same).sum((1, 2)))
            else:  # rmsnorm
                add((d * _acc(_rms_normalised(cap.module, x))).sum(1).pow(2).sum(-1))
        if len(us) == 2:  # tied embedding / lm_head: the cross term 2⟨G_emb, G_head⟩
            (emb, _), (head, _) = sorted(us, key=lambda u: u[0].kind)  # "embedding" < "linear"
            assert (
                emb.x is not None and emb.delta is not None and head.x is not None and head.delta is not None
            )
            ids, d_emb, h, d_head = emb.x, _acc(emb.delta), _acc(head.x), _acc(head.delta)
            a = d_emb @ h.transpose(1, 2)  # [B, t, s] = δemb_t · h_s
            g = d_head.gather(
                2, ids[:, None, :].expand(-1, d_head.shape[1], -1)
            )  # [B, s, t] = δhead_{s, id_t}
            add(2 * (a * g.transpose(1, 2)).sum((1, 2)))
    assert total is not None
    return total


def norm_pass(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor
) -> NormPassResult:
    """One forward and one backward to layer outputs: per-row squared score-gradient norms and log-probs.

    Rows are trajectories (prompt + response, padded left or right); ``response_mask[b, t] = 1`` marks a
    token whose log-prob counts in ``f_b = Σ_t log π(input_ids[b, t] | input_ids[b, <t])``. No parameter
    gradient is formed. The result keeps the activations needed by ``accumulate_weighted_gradients``;
    call ``release()`` if the weighted gradient will come from an ordinary backward instead.
    """
    mask = _check_inputs(input_ids, attention_mask, response_mask)
    raw_uses = _trainable_uses(model)
    if not raw_uses:
        raise ValueError("the model has no trainable parameters")
    captures: dict[int, _Capture] = {}
    for _, us in raw_uses.values():
        for module, kind, _ in us:
            captures.setdefault(id(module), _Capture(module, kind))
    with torch.enable_grad(), _capturing(model, captures):
        logp = token_logprobs(model, input_ids, attention_mask)
    f = torch.where(mask, logp, torch.zeros_like(logp)).sum()
    caps = [c for c in captures.values() if c.y is not None]
    if len(caps) != len(captures):
        unused = [type(c.module).__name__ for c in captures.values() if c.y is None]
        raise NotImplementedError(
            f"modules with trainable parameters were not called in the forward: {unused}"
        )
    deltas = torch.autograd.grad(f, [c.y for c in caps], allow_unused=True)
    for cap, d in zip(caps, deltas, strict=True):
        assert cap.y is not None
        cap.delta = torch.zeros_like(cap.y) if d is None else d.detach()
        cap.y = None
    uses = {k: (p, [(captures[id(m)], role) for m, _, role in us]) for k, (p, us) in raw_uses.items()}
    return NormPassResult(_sq_norms(caps, uses), logp.detach(), caps, uses)


def micro_batches(n: int, micro_batch_size: int | None) -> list[tuple[int, int]]:
    """``(start, stop)`` row spans of ``micro_batch_size`` rows (None or 0: all rows at once)."""
    size = micro_batch_size or max(n, 1)
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def per_trajectory_sq_grad_norms(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    micro_batch_size: int | None = None,
) -> Tensor:
    """One value per row: ‖∇θ Σ_t response_mask[t]·log π(input_ids[t] | input_ids[<t])‖² over all trainable
    parameters (float64), by the norm pass, ``micro_batch_size`` rows at a time (default: all at once).
    Produces no parameter gradients."""
    out = []
    for a, b in micro_batches(input_ids.shape[0], micro_batch_size):
        result = norm_pass(model, input_ids[a:b], attention_mask[a:b], response_mask[a:b])
        result.release()
        out.append(result.sq_grad_norms)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
