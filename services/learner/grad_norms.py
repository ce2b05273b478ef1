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
      LoRA (peft):   a projection's A and B are Linear modules (the Linear rule); an embedding's
                     out = E[id] + s·Aᵀ[id] Bᵀ gives B the Linear rule with input s·Aᵀ[id] and Aᵀ the
                     Embedding rule with δ' = s·δ B (norm_rules.LoraEmbedding); the frozen base adds nothing
    ‖∇θ log π(τ_i)‖² = the sum over parameters.

Padding contributes nothing: padded positions get δ = 0 (masked out of f, and masked keys receive no
attention). Any micro-batch size gives the same values.

The step's loss gradient is Σ_i c_i ∇f_i for per-trajectory coefficients c_i known only after the norms
(ESS and OPOB need them). Its backward signals are the norm pass's δ scaled by c_i row by row, so
:meth:`NormPassResult.accumulate_weighted_gradients` forms Σ_i c_i δ_iᵀ x_i from what the pass saved and
hands each parameter its gradient through a one-node autograd function: an ordinary backward, so gradient
hooks (ZeRO-3's partition-and-reduce) run as usual, with no second forward or full backward.

That keeps every micro-batch's x and δ until the step's coefficients are known. :func:`streaming_norm_pass`
keeps nothing: a tap after each module saves its input as an ordinary activation (so activation checkpointing
may drop and recompute it) and, in the backward, adds the module's term from (x, δ) the moment δ exists.
With the output head in slices, the streaming pass does the head's share without autograd
(:func:`head_pass`): δ_s = m_s (e_{y_s} − softmax_s) needs only a slice of the vocabulary's logits, and the
Gram form, the per-row form and ∂f/∂hidden are all sums over vocabulary slices; the decoder's backward starts
from ∂f/∂hidden.

The per-module rules live in ``norm_rules.py``, the log-probs (whole or with the head in slices) in
``logprobs.py``; this module runs the passes: hooks and taps, the saved and streaming norm passes, and the
weighted gradient from what the saved pass kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from services.learner.logprobs import acc, decoder_and_head, decoder_hidden, token_logprobs
from services.learner.mm32 import mm32
from services.learner.norm_rules import (
    LoraEmbedding,
    RowNorms,
    adapter_names,
    full_shape,
    head_parts,
    head_pass,
    rms_normalised,
    trainable_uses,
)


def _is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shape and dtype without values) of the memory estimate."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@dataclass
class _Capture:
    """What one module saw in the forward: its input, its output, and (after backward) the output's grad."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "rmsnorm" | "lora_embedding"
    x: Tensor | None = None  # input activations (token ids for an embedding)
    y: Tensor | None = None  # output, kept until the backward
    delta: Tensor | None = None  # ∂f/∂y
    roles: list[str] = field(default_factory=list)  # as _TapSpec.roles
    lora: LoraEmbedding | None = None  # its adapters' values, copied in the forward


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
        if not _is_fake(c) and not torch.isfinite(c).all():
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


def _weighted_grad_fn(
    param: nn.Parameter, uses: list[tuple[tuple[_Capture, str], Tensor]]
) -> Callable[[], Tensor]:
    def make() -> Tensor:
        # formed and summed over micro-batches in float32 at least (bf16 models: one rounding, at the end)
        grad = torch.zeros(full_shape(param), dtype=acc(param.data).dtype, device=param.device)
        for (cap, role), coefficients in uses:
            assert cap.x is not None and cap.delta is not None
            d = acc(cap.delta) * coefficients.to(grad.dtype)[:, None, None]
            if cap.kind == "linear" and role == "weight":
                grad += mm32(d.reshape(-1, d.shape[-1]).T, cap.x.reshape(-1, cap.x.shape[-1]))
            elif cap.kind == "linear" and role == "bias":
                grad += d.sum((0, 1))
            elif cap.kind == "embedding":
                grad.index_add_(0, cap.x.reshape(-1), d.reshape(-1, d.shape[-1]))
            elif cap.kind == "rmsnorm":
                grad += (d * acc(rms_normalised(cap.module, cap.x))).sum((0, 1))
            elif cap.kind == "lora_embedding":
                assert cap.lora is not None
                which, adapter = role.split(":", 1)
                if which == "B":  # [out, r]: Σ_t d_t u_tᵀ
                    u = cap.lora.inputs_of_b(adapter, cap.x)
                    grad += mm32(d.reshape(-1, d.shape[-1]).T, u.reshape(-1, u.shape[-1]))
                else:  # [r, vocab]: column id_t receives s·d_t B
                    g = cap.lora.signal_of_a(adapter, d)
                    grad.T.index_add_(0, cap.x.reshape(-1), g.reshape(-1, g.shape[-1]))
        return grad.to(param.dtype)

    return make


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
        if cap.kind == "lora_embedding":
            cap.lora = LoraEmbedding(module, adapter_names(cap.roles))

    handles = [cap.module.register_forward_hook(hook) for cap in captures.values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _check_inputs(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} differs from input_ids shape {tuple(input_ids.shape)}"
            )
    mask = response_mask.bool()
    if _is_fake(mask):  # a memory estimate (memory.py): shapes only, no values to check
        return mask
    if mask[:, 0].any():
        raise ValueError("response_mask[:, 0] must be 0: nothing predicts a sequence's first token")
    if (mask & ~attention_mask.bool()).any():
        rows = sorted({int(r) for r in (mask & ~attention_mask.bool()).nonzero()[:, 0]})
        raise ValueError(f"response_mask marks padding (attention_mask 0) in rows {rows}")
    return mask


def _sq_norms(
    captures: list[_Capture], uses: dict[int, tuple[nn.Parameter, list[tuple[_Capture, str]]]], ids: Tensor
) -> Tensor:
    """Per-row squared gradient norm over all trainable parameters, from saved x and δ."""
    norms = RowNorms(ids)  # the saved pass keeps every input anyway: cache every Gram
    for _, us in uses.values():
        for cap, role in us:
            assert cap.x is not None and cap.delta is not None
            if cap.kind == "linear":
                norms.linear(cap.x, cap.delta, role)
            elif cap.kind == "embedding":
                norms.embedding(cap.x, cap.delta)
            elif cap.kind == "lora_embedding":
                assert cap.lora is not None
                norms.lora_embedding(cap.x, cap.delta, cap.lora, [role])
            else:
                norms.rmsnorm(cap.module, cap.x, cap.delta)
        if len(us) == 2:  # tied embedding / lm_head: the cross term 2⟨G_emb, G_head⟩
            (emb, _), (head, _) = sorted(us, key=lambda u: u[0].kind)  # "embedding" < "linear"
            assert emb.delta is not None and head.x is not None and head.delta is not None
            norms.hold_head_cross(head.delta, head.x)
            norms.tied_cross(emb.delta)
    return norms.total


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
    raw_uses = trainable_uses(model)
    if not raw_uses:
        raise ValueError("the model has no trainable parameters")
    captures: dict[int, _Capture] = {}
    for _, us in raw_uses.values():
        for module, kind, role in us:
            captures.setdefault(id(module), _Capture(module, kind)).roles.append(role)
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
    return NormPassResult(_sq_norms(caps, uses, input_ids), logp.detach(), caps, uses)


@dataclass
class _TapSpec:
    """One parametrised module of the streaming pass: which of its parameters train, and its tied role."""

    module: nn.Module
    kind: str  # "linear" | "embedding" | "rmsnorm" | "lora_embedding"
    roles: list[str] = field(default_factory=list)  # "weight", "bias"; a LoRA embedding's "A:<adapter>", ...
    tied: bool = False  # its weight is the tied embedding / output head
    called: bool = False
    lora: LoraEmbedding | None = None  # a LoRA embedding's adapters, copied in the forward


class _Tap(torch.autograd.Function):
    """The identity on a module's output whose backward hands (input, output grad) to ``on_delta``.

    The input is saved like any activation, so under activation checkpointing it is dropped after the forward
    and recomputed in the backward with the rest of its layer. ``anchor`` (a scalar leaf) links every tap to
    one tensor the backward is taken to, so the backward reaches every tap and forms no parameter gradient.
    """

    @staticmethod
    def forward(
        ctx: Any, y: Tensor, anchor: Tensor, x: Tensor, on_delta: Callable[[Tensor, Tensor], None]
    ) -> Tensor:
        ctx.on_delta = on_delta
        ctx.save_for_backward(x)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, delta: Tensor) -> tuple[Tensor, None, None, None]:
        (x,) = ctx.saved_tensors
        ctx.on_delta(x, delta.detach())
        return delta, None, None, None


def _on_delta(spec: _TapSpec, norms: RowNorms) -> Callable[[Tensor, Tensor], None]:
    def on_delta(x: Tensor, delta: Tensor) -> None:
        if spec.kind == "linear":
            for role in spec.roles:
                norms.linear(x, delta, role)
            if spec.tied:
                norms.hold_head_cross(delta, x)
        elif spec.kind == "embedding":
            norms.embedding(x, delta)
            if spec.tied:
                norms.tied_cross(delta)
        elif spec.kind == "lora_embedding":
            assert spec.lora is not None
            norms.lora_embedding(x, delta, spec.lora, spec.roles)
        else:
            norms.rmsnorm(spec.module, x, delta)

    return on_delta


@contextmanager
def _tapping(specs: dict[int, _TapSpec], norms: RowNorms, anchor: Tensor) -> Iterator[list[bool]]:
    """Tap every module in ``specs`` while the context is open (the forward and the backward, which may
    recompute checkpointed layers). Yields a one-item list: set it to True before the backward, after which
    repeated calls are recomputations, not a module used twice."""
    backward = [False]
    handlers = {key: _on_delta(spec, norms) for key, spec in specs.items()}

    def hook(module: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> Tensor:
        spec = specs[id(module)]
        if not backward[0]:
            if spec.called:
                raise NotImplementedError(
                    f"{type(module).__name__} was called twice in one forward: not supported"
                )
            spec.called = True
            if spec.kind == "lora_embedding":
                spec.lora = LoraEmbedding(module, adapter_names(spec.roles))
        return _Tap.apply(output, anchor, inputs[0].detach(), handlers[id(module)])

    handles = [spec.module.register_forward_hook(hook) for spec in specs.values()]
    try:
        yield backward
    finally:
        for h in handles:
            h.remove()


def streaming_norm_pass(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    chunks: int = 0,
) -> tuple[Tensor, Tensor]:
    """Per-row squared score-gradient norms and log-probs, keeping nothing after it returns.

    The same values as :func:`norm_pass`, but each module's contribution is formed inside the backward, from
    its input and output gradient, the moment that gradient exists; both are then dropped. Peak memory is one
    ordinary forward's activations plus one module's norm arithmetic, and activation (gradient) checkpointing
    of the model applies. ``chunks > 0``: the output head's log-probs, norm and backward signal come from
    :func:`head_pass` in as many slices, without autograd; no [B, T, vocab] tensor exists. Returns
    ``(sq_grad_norms [B] float64, token_logprobs [B, T] detached)``; no parameter gradient is formed.
    """
    mask = _check_inputs(input_ids, attention_mask, response_mask)
    raw_uses = trainable_uses(model)
    if not raw_uses:
        raise ValueError("the model has no trainable parameters")
    head = decoder_and_head(model)[1] if chunks > 0 else None
    specs: dict[int, _TapSpec] = {}
    for _, us in raw_uses.values():
        for module, kind, role in us:
            spec = specs.setdefault(id(module), _TapSpec(module, kind))
            spec.roles.append(role)
            spec.tied = spec.tied or len(us) == 2
    head_spec, adapter_roles = None, {}
    if head is not None:  # the sliced head pass forms the head's norms (and its LoRA adapters') itself
        base, adapters = head_parts(head)
        head_spec = specs.pop(id(base), None)
        for name, a, b, _ in adapters:
            adapter_roles[name] = [m for m, mod in (("A", a), ("B", b)) if specs.pop(id(mod), None)]
    norms = RowNorms(input_ids, gram_cache=2)
    anchor = torch.zeros((), device=input_ids.device, requires_grad=True)
    with torch.enable_grad(), _tapping(specs, norms, anchor) as backward:
        if head is not None:
            hidden = decoder_hidden(decoder_and_head(model)[0], input_ids, attention_mask)
            logp, grad_hidden = head_pass(
                norms if head_spec is not None or any(adapter_roles.values()) else None,
                head,
                head_spec.roles if head_spec else [],
                hidden,
                input_ids,
                mask,
                chunks,
                head_spec is not None and head_spec.tied,
                adapter_roles,
            )
        else:
            logp = token_logprobs(model, input_ids, attention_mask)
        unused = [type(s.module).__name__ for s in specs.values() if not s.called]
        if unused:
            raise NotImplementedError(
                f"modules with trainable parameters were not called in the forward: {unused}"
            )
        backward[0] = True
        if head is None:
            f = torch.where(mask, logp, torch.zeros_like(logp)).sum()
            torch.autograd.grad(f, [anchor], allow_unused=True)
        elif hidden.requires_grad:  # else only the head trains: its norm is all there is
            torch.autograd.grad(hidden, [anchor], grad_outputs=grad_hidden, allow_unused=True)
    return norms.total.detach(), logp.detach()


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
