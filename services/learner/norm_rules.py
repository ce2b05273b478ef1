"""What each trainable module contributes to a row's squared score-gradient norm (the table in grad_norms.py).

A module's share of ``‖∇θ log π(τ_i)‖²`` follows from its input x and its output gradient δ alone: Linear
weights in the ghost Gram form or per-row materialised (whichever is cheaper), biases, embeddings,
RMSNorm weights, the cross term of a tied embedding / output head, and peft LoRA adapters (a projection's A
and B are Linear modules; a LoRA embedding's through :class:`LoraEmbedding`). :func:`trainable_uses` names
the rule of every trainable parameter and refuses one without a rule. :class:`RowNorms` sums the shares row
by row in float64 from float32-or-better products (:mod:`mm32`: on the tensor cores on a GPU);
:func:`head_pass` forms the output head's share (a LoRA head's too) and the decoder's backward signal
without autograd, over slices of the vocabulary, for the streaming pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from services.learner.logprobs import acc, acc_dtype, slices, target_logprobs
from services.learner.mm32 import gram32, mm32


def rms_normalised(module: nn.Module, x: Tensor) -> Tensor:
    """x̂ exactly as Qwen2/Llama RMSNorm computes it (float32 statistics, cast back)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return h.to(x.dtype)


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The parameter's real shape, also when ZeRO-3 has partitioned it away (``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _ghost(tokens: int, d_in: int, d_out: int) -> bool:
    """Whether a linear layer's per-row norm is cheaper from T×T Gram matrices than from its d_out × d_in
    per-row gradient."""
    return tokens * (d_in + d_out) <= d_in * d_out


class RowNorms:
    """Per-row squared gradient norm, summed module by module from each module's input x and output grad δ.

    Every product is summed in float32 at least (:func:`_acc`): bf16 Gram matrices and row sums lose ~3
    digits. ``gram_cache`` bounds how many inputs' Gram matrices are kept for reuse by the layers that share
    an input (q/k/v, gate/up); the cache holds the input too, so its address cannot be reused meanwhile.
    """

    def __init__(self, ids: Tensor, gram_cache: int | None = None) -> None:
        self.ids = ids  # the embedding's input: the tied cross term gathers the output head's δ at them
        self.total: Tensor = torch.zeros(ids.shape[0], dtype=torch.float64, device=ids.device)
        self._grams: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        self._gram_cache = gram_cache
        # the output head's share of a tied cross term until the embedding's δ arrives: (g, h) with
        # g[b, s, t] = δhead_{s, id_t} and h the head's input
        self.head_cross: tuple[Tensor, Tensor] | None = None

    def add(self, v: Tensor) -> None:
        self.total += v.double()

    def input_gram(self, x: Tensor) -> Tensor:
        # the cache holds x, so its storage (and that storage's id) stays the same while the entry lives
        key = (id(x.untyped_storage()), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
        hit = self._grams.get(key)
        if hit is not None:
            return hit[1]
        gram = gram32(x)
        if self._gram_cache is not None and len(self._grams) >= self._gram_cache:
            self._grams.pop(next(iter(self._grams)))
        self._grams[key] = (x, gram)
        return gram

    def linear(self, x: Tensor, delta: Tensor, role: str) -> None:
        if role == "bias":
            self.add(acc(delta).sum(1).pow(2).sum(-1))
        elif _ghost(x.shape[1], x.shape[-1], delta.shape[-1]):  # ghost: T×T Gram matrices
            self.add((self.input_gram(x) * gram32(delta)).sum((1, 2)))
        else:  # materialise each row's d_out × d_in gradient
            self.add(mm32(delta.transpose(1, 2), x).pow(2).sum((1, 2)))

    def embedding(self, ids: Tensor, delta: Tensor) -> None:
        gram = gram32(delta)
        self.add((gram * (ids[:, :, None] == ids[:, None, :]).to(gram.dtype)).sum((1, 2)))

    def rmsnorm(self, module: nn.Module, x: Tensor, delta: Tensor) -> None:
        self.add((acc(delta) * acc(rms_normalised(module, x))).sum(1).pow(2).sum(-1))

    def lora_embedding(
        self, ids: Tensor, delta: Tensor, adapters: LoraEmbedding, roles: Sequence[str]
    ) -> None:
        """A peft LoRA embedding's adapters, out = base(ids) + s·Aᵀ[ids] Bᵀ: B is a linear map of the input
        u = s·Aᵀ[ids]; Aᵀ is an embedding whose row id_t receives s·δ_t B."""
        for role in roles:
            which, name = role.split(":", 1)
            if which == "B":
                self.linear(adapters.inputs_of_b(name, ids), delta, "weight")
            else:
                self.embedding(ids, adapters.signal_of_a(name, delta))

    def hold_head_cross(self, head_delta: Tensor, head_x: Tensor) -> None:
        """Keep the output head's part of the tied cross term: its δ gathered at the token ids, its input."""
        d_head = acc(head_delta)
        g = d_head.gather(2, self.ids[:, None, :].expand(-1, d_head.shape[1], -1))  # [B, s, t]
        self.head_cross = (g, head_x)

    def tied_cross(self, emb_delta: Tensor) -> None:
        """2⟨G_emb, G_head⟩ = 2 Σ_{t,s} δhead_{s, id_t} (δemb_t · h_s), with the held head part."""
        if self.head_cross is None:
            raise RuntimeError("tied embedding: the output head's backward signal did not reach the norms")
        g, h = self.head_cross
        a = mm32(emb_delta, h.transpose(1, 2))  # [B, t, s] = δemb_t · h_s
        self.add(2 * (a * g.transpose(1, 2)).sum((1, 2)))
        self.head_cross = None


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _refuse_unsupported_embedding(name: str, embedding: nn.Embedding) -> None:
    if embedding.max_norm is not None or embedding.scale_grad_by_freq:
        raise NotImplementedError(f"{name}: embeddings with max_norm/scale_grad_by_freq are not supported")


def _lora_embedding_params(name: str, module: nn.Module) -> list[tuple[str, nn.Parameter]] | None:
    """A peft LoRA embedding's trainable adapter matrices as ``("A:<adapter>" | "B:<adapter>", param)``;
    None for any other module. Variants (DoRA, ...) and scaled embeddings have no rule and are refused."""
    if not (hasattr(module, "lora_embedding_A") and hasattr(module, "base_layer")):
        return None
    out = []
    for adapter in module.lora_embedding_A:
        pair = (("A", module.lora_embedding_A[adapter]), ("B", module.lora_embedding_B[adapter]))
        trainable = [(f"{which}:{adapter}", p) for which, p in pair if p.requires_grad]
        if not trainable:
            continue
        if adapter not in module.active_adapters:
            raise NotImplementedError(f"{name}: adapter {adapter!r} trains but is not active")
        if adapter in getattr(module, "lora_variant", {}) or module._get_embed_scale() is not None:
            raise NotImplementedError(
                f"{name}: only plain LoRA on an unscaled embedding has a norm rule (adapter {adapter!r})"
            )
        out += trainable
    if out:
        _refuse_unsupported_embedding(name, module.base_layer)
    return out


def adapter_names(roles: Sequence[str]) -> list[str]:
    return sorted({role.split(":", 1)[1] for role in roles})


def trainable_uses(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]:
    """Every trainable parameter and the (module, kind, role) uses of it; unsupported owners are errors."""
    uses: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    lora_owned: set[int] = set()  # a LoRA embedding's matrices live in ParameterDicts below it
    for name, module in model.named_modules():
        lora = _lora_embedding_params(name, module)
        if lora:
            for role, p in lora:
                uses[id(p)] = (p, [(module, "lora_embedding", role)])
                lora_owned.add(id(p))
        own = [
            (pn, p)
            for pn, p in module.named_parameters(recurse=False)
            if p.requires_grad and id(p) not in lora_owned
        ]
        if not own:
            continue
        if isinstance(module, nn.Linear):
            kind = "linear"
        elif isinstance(module, nn.Embedding):
            kind = "embedding"
            _refuse_unsupported_embedding(name, module)
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


class LoraEmbedding:
    """The full values of a peft LoRA embedding's adapters (Aᵀ [vocab, r], B [out, r], scaling s), copied
    in the forward, where ZeRO-3 can gather them, for the rules that need them after (or inside) the
    backward, when a partitioned parameter holds only its shard."""

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        params = [p for n in names for p in (module.lora_embedding_A[n], module.lora_embedding_B[n])]
        with torch.no_grad(), gathered(params):
            self.weights = {
                n: (
                    acc(module.lora_embedding_A[n]).t().contiguous(),
                    acc(module.lora_embedding_B[n]).clone(),
                    float(module.scaling[n]),
                )
                for n in names
            }

    def inputs_of_b(self, name: str, ids: Tensor) -> Tensor:
        a_t, _, scaling = self.weights[name]
        return nn.functional.embedding(ids, a_t) * scaling

    def signal_of_a(self, name: str, delta: Tensor) -> Tensor:
        _, b, scaling = self.weights[name]
        return (mm32(delta.reshape(-1, delta.shape[-1]), b) * scaling).reshape(*delta.shape[:-1], -1)


@contextmanager
def gathered(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """The full values of ZeRO-3-partitioned parameters for the duration (read-only); a no-op otherwise.
    A parameter ZeRO-3 already holds whole (a small persistent one, or one the running forward fetched: a
    LoRA embedding's adapters, read in its forward) is left as it is: its owner releases it."""
    from_zero3 = [p for p in params if hasattr(p, "ds_id")]
    if not from_zero3:
        yield
        return
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitioned = [p for p in from_zero3 if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not partitioned:
        yield
        return

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


HeadAdapter = tuple[str, nn.Linear, nn.Linear, float]  # a LoRA adapter of the head: name, A, B, scaling


def head_parts(head: nn.Module) -> tuple[nn.Linear, list[HeadAdapter]]:
    """The output head's base linear map and its active peft LoRA adapters (logits = base(h) + Σ s·B(A(h)));
    a plain ``nn.Linear`` head has none. Adapters the sliced pass cannot reproduce exactly are refused."""
    if isinstance(head, nn.Linear):
        return head, []
    base = getattr(head, "base_layer", None)
    if not isinstance(base, nn.Linear) or not hasattr(head, "lora_A"):
        raise ValueError(f"the output head is a {type(head).__name__}: neither nn.Linear nor LoRA on one")
    adapters: list[HeadAdapter] = []
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b, dropout = head.lora_A[name], head.lora_B[name], head.lora_dropout[name]
        if name in getattr(head, "lora_variant", {}) or b.bias is not None:
            raise NotImplementedError(
                f"output head: adapter {name!r} is not plain LoRA (a variant or a bias)"
            )
        if head.training and not isinstance(dropout, nn.Identity) and dropout.p > 0:
            raise NotImplementedError(
                f"output head: adapter {name!r} has dropout {dropout.p}, which the sliced head pass cannot "
                "reproduce: set the head's LoRA dropout to 0 or learner.logit_chunk_tokens = 0"
            )
        adapters.append((name, a, b, float(head.scaling[name])))
    return base, adapters


@torch.no_grad()
def head_pass(
    norms: RowNorms | None,
    head: nn.Module,
    roles: Sequence[str],
    hidden: Tensor,
    input_ids: Tensor,
    response_mask: Tensor,
    chunks: int,
    tied: bool,
    adapter_roles: dict[str, list[str]] | None = None,
) -> tuple[Tensor, Tensor]:
    """The output head's whole share of the norm pass, without autograd: ``(log-probs [B, T] as
    :func:`token_logprobs`, ∂f/∂hidden [B, T, H] in hidden's dtype)``, and the head's per-row squared gradient
    norm added to ``norms`` (``None``: the head does not train).

    Two sweeps over the gathered head weight, so no ``[B, T, vocab]`` tensor exists:

    - positions in ``chunks`` slices: the logits' logsumexp and the targets' log-probs;
    - vocabulary in ``chunks`` slices: the backward signal δ_s = m_s (e_{y_s} − p_s) of f = Σ_s m_s log π(y_s),
      with p_s = exp(logits_s − logsumexp_s), from that slice of the logits alone. Its products with the head's
      weight sum to ∂f/∂hidden; the Gram matrix Σ_v δ_t[v] δ_s[v] (ghost form) and the per-row gradient's
      squared norm are sums over the slices too.

    The decoder's backward then starts from ∂f/∂hidden, so the head is never recomputed or differentiated
    through (a checkpointed head would run its forward twice more). ``tied``: also keep the head's part of the
    cross term with the embedding (δhead_{s, id_t}) for :meth:`RowNorms.tied_cross`.

    A LoRA head (:func:`head_parts`) adds s·(h Aᵀ) B_vᵀ to each slice's logits. ``adapter_roles`` names which
    of each adapter's matrices train ("A", "B"): B's gradient is a linear map's of the input s·h Aᵀ and that
    slice's δ (a sum over slices, like the weight's); A's is a linear map's of h and s·e with
    e_t = Σ_v δ_t[v] B_v, summed over the slices first. e also carries the adapters' part of ∂f/∂hidden.
    """
    h = hidden[:, :-1].detach()
    targets, m = input_ids[:, 1:], response_mask[:, 1:]
    hdt = acc_dtype(h.dtype)
    mf = m.to(hdt)
    b_rows, s_len, width = h.shape
    base, adapters = head_parts(head)
    adapter_roles = adapter_roles or {}
    vocab = full_shape(base.weight)[0]
    vocab_chunk = -(-vocab // chunks)
    train_weight = norms is not None and "weight" in roles
    ghost_weight = train_weight and _ghost(s_len, width, vocab)
    train_b = [norms is not None and "B" in adapter_roles.get(n, []) for n, *_ in adapters]
    ghost_b = [
        t and _ghost(s_len, full_shape(b.weight)[1], vocab)
        for t, (_, _, b, _) in zip(train_b, adapters, strict=True)
    ]
    dd = h.new_zeros(b_rows, s_len, s_len, dtype=hdt) if ghost_weight or any(ghost_b) else None
    b_sq = h.new_zeros(b_rows, dtype=hdt)
    weight_sq = h.new_zeros(b_rows, dtype=hdt)
    bias_sq = h.new_zeros(b_rows, dtype=hdt)
    cross = h.new_zeros(b_rows, s_len, input_ids.shape[1], dtype=hdt) if norms is not None and tied else None
    grad_h = h.new_zeros(b_rows, s_len, width, dtype=hdt)
    logp = h.new_zeros(b_rows, input_ids.shape[1], dtype=hdt)
    with gathered(list(head.parameters())):
        weight, bias = base.weight, base.bias
        # each adapter's A(h), in the model's dtype as peft forms it, and s·A(h), B's input, for the norms
        lora_in = [nn.functional.linear(h, a.weight) for _, a, _, _ in adapters]
        lora_x = [acc(u) * scaling for u, (_, _, _, scaling) in zip(lora_in, adapters, strict=True)]
        lora_e = [h.new_zeros(b_rows, s_len, u.shape[-1], dtype=hdt) for u in lora_in]

        def logits_of(rows: slice, v0: int, v1: int) -> Tensor:
            out = nn.functional.linear(h[:, rows], weight[v0:v1], None if bias is None else bias[v0:v1])
            for u, (_, _, b, scaling) in zip(lora_in, adapters, strict=True):
                out = out + nn.functional.linear(u[:, rows], b.weight[v0:v1]) * scaling
            return acc(out)

        lses = []
        for a, b in slices(s_len, chunks):
            logp[:, a + 1 : b + 1], lse = target_logprobs(logits_of(slice(a, b), 0, vocab), targets[:, a:b])
            lses.append(lse)
        logsumexp = torch.cat(lses, dim=1)
        for v0 in range(0, vocab, vocab_chunk):
            v1 = min(v0 + vocab_chunk, vocab)
            w = weight[v0:v1]
            logits = logits_of(slice(None), v0, v1)
            d = logits.sub_(logsumexp[..., None]).exp_().mul_(-mf[..., None])  # −m_s p_s, in place
            del logits
            hit = ((targets >= v0) & (targets < v1)).to(hdt) * mf
            d.scatter_add_(2, (targets - v0).clamp(0, v1 - v0 - 1)[..., None], hit[..., None])
            grad_h += d.to(w.dtype) @ w
            for i, (_, _, b, _) in enumerate(adapters):
                lora_e[i] += mm32(d.reshape(-1, v1 - v0), b.weight[v0:v1]).reshape(lora_e[i].shape)
                if train_b[i] and not ghost_b[i]:
                    b_sq += mm32(d.transpose(1, 2), lora_x[i]).pow(2).sum((1, 2))
            if dd is not None:
                dd += gram32(d)
            if train_weight and not ghost_weight:
                weight_sq += mm32(d.transpose(1, 2), h).pow(2).sum((1, 2))
            if norms is not None and "bias" in roles:
                bias_sq += d.sum(1).pow(2).sum(-1)
            if cross is not None:
                inside = (input_ids >= v0) & (input_ids < v1)
                idx = (input_ids - v0).clamp(0, v1 - v0 - 1)[:, None, :].expand(-1, s_len, -1)
                cross += torch.where(inside[:, None, :], d.gather(2, idx), 0.0)
        for e, (name, a, _, scaling) in zip(lora_e, adapters, strict=True):
            grad_h += (e * scaling).to(a.weight.dtype) @ a.weight
            if norms is not None and "A" in adapter_roles.get(name, []):
                norms.linear(h, e * scaling, "weight")
    if norms is not None:
        if ghost_weight:
            assert dd is not None
            weight_sq = (norms.input_gram(h) * dd).sum((1, 2))
        for i, x in enumerate(lora_x):
            if ghost_b[i]:
                assert dd is not None
                b_sq += (gram32(x) * dd).sum((1, 2))
        norms.add(weight_sq + bias_sq + b_sq)
        if cross is not None:  # cross[b, s, t] = δhead_{s, id_t} = m_s ([y_s = id_t] − p_s[id_t])
            norms.head_cross = (cross, h)
    grad_hidden = torch.cat([grad_h, grad_h.new_zeros(b_rows, 1, width)], dim=1).to(hidden.dtype)
    return logp, grad_hidden
