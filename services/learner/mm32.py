"""Matrix products with float32 accuracy at tensor-core speed, for the norm pass and the weighted gradient.

The norm pass and the weighted gradient sum products of a bf16 model's activations and backward signals;
summed in bf16 they would lose about three digits, so they are summed in float32 (:func:`acc`). A float32
GEMM on a GPU runs on the CUDA cores, though (an H200 has ~67 TFLOP/s there, ~990 in bf16 on its tensor
cores). :func:`mm32` forms the same product on the tensor cores: bf16 × bf16 products are exact in float32,
and ``torch.mm``/``torch.bmm`` with ``out_dtype=float32`` accumulate and return them in float32. An operand
that is not bf16 (a float32 signal, a coefficient-scaled δ) is split into three bf16 parts that carry all of
float32's 24 significant bits (:func:`bf16_parts`), and the products of the parts are summed, leaving out
those below float32's round-off: three GEMMs when one side is split, four to six when both are.

On an H200, a bf16 VCPO step of a 0.25B model at 16 × 1024 tokens took 4.3 GRPO steps with float32 GEMMs and
2.6 with these (``benchmarks/vcpo_step.py --device cuda --dtype bfloat16 --size 200m --length 1024``, its
``vcpo-f32-gemm`` row, side by side). The split products stayed within 0.05 of float32's worst-case error
bound at that model's shapes (``tests/test_mm32.py`` checks the bound on CUDA), and the step's norms and
gradient differed from the float32 GEMMs' no more than two runs of either path differ (the bf16 backward
is not deterministic). A float32 *model* is split on both sides: at 10M parameters its step was 1.2× slower
than with float32 GEMMs.

Elsewhere (a CPU, float64 references) the product is the plain one of the float32-or-better operands.
:func:`products` forces either way: the memory estimate simulates the GPU's path on fake tensors, and the
benchmark times the two side by side.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from services.learner.logprobs import acc

log = logging.getLogger(__name__)

PARTS = 3  # bf16 parts of a float32 operand: 8 significant bits each, 24 in all
_MODES = ("auto", "split", "plain")
_mode: ContextVar[str] = ContextVar("vcpo_mm32_mode", default="auto")
# torch.mm/bmm with out_dtype (bf16 operands, float32 accumulation and result): CUDA kernels since torch 2.8
MatMul = Callable[[Tensor, Tensor], Tensor]
_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")


@contextmanager
def products(mode: str) -> Iterator[None]:
    """Within: ``"split"`` forms every :func:`mm32` product from bf16 parts (also on a CPU's fake tensors:
    the memory estimate of a GPU step), ``"plain"`` as float32 GEMMs, ``"auto"`` split on CUDA only."""
    if mode not in _MODES:
        raise ValueError(f"mm32 products mode must be one of {_MODES}, got {mode!r}")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def splits(t: Tensor) -> bool:
    """Whether :func:`mm32` forms products with ``t`` from bf16 parts here."""
    mode = _mode.get()
    if mode == "plain" or t.dtype == torch.float64 or not _HAS_OUT_DTYPE:
        return False
    return mode == "split" or (t.is_cuda and _out_dtype_runs(t.device))


@functools.cache
def _out_dtype_runs(device: torch.device) -> bool:
    """Whether this device's build runs bf16 GEMMs with a float32 output (CUDA's does; a ROCm build may not):
    tried once per device, else the products stay float32 GEMMs, with a warning."""
    try:
        one = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return bool(torch.equal(_tensor_core_mm(one, one), torch.full((2, 2), 2.0, device=device)))
    except RuntimeError as e:
        log.warning(
            "bf16 GEMMs with a float32 output do not run on %s (%s): float32 GEMMs instead", device, e
        )
        return False


def bf16_parts(t: Tensor, parts: int = PARTS) -> list[Tensor]:
    """``t`` as bf16 tensors whose sum is ``t`` to ``2^(-8·parts)`` relative: each part is the rounding of
    what the ones before it left (exact in float32); a bf16 ``t`` is its own single part."""
    if t.dtype == torch.bfloat16:
        return [t]
    rest = t.float()
    out = []
    for i in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        if i + 1 < parts:
            rest = rest - part.float()
    return out


def _tensor_core_mm(a: Tensor, b: Tensor) -> Tensor:
    return (
        torch.mm(a, b, out_dtype=torch.float32) if a.dim() == 2 else torch.bmm(a, b, out_dtype=torch.float32)
    )


def split_product(a: Tensor, b: Tensor, mm: MatMul = _tensor_core_mm) -> Tensor:
    """``a @ b`` (2-D, or 3-D batched) in float32 from the operands' bf16 parts: part i of ``a`` times part
    j of ``b`` for i + j < PARTS (the others lie below 2^-24 of the product), each by ``mm`` (bf16 × bf16 →
    float32, accumulated in float32), summed in float32."""
    pa, pb = bf16_parts(a), bf16_parts(b)
    out: Tensor | None = None
    for i, x in enumerate(pa):
        for j, y in enumerate(pb):
            if i + j < PARTS:
                p = mm(x, y)
                out = p if out is None else out.add_(p)
    assert out is not None
    return out


def split_gram(a: Tensor, mm: MatMul = _tensor_core_mm) -> Tensor:
    """``a @ aᵀ`` per batch row from ``a``'s bf16 parts, as :func:`split_product`; the products (i, j) and
    (j, i) are transposes of each other, so a float32 ``a`` takes four GEMMs, not six."""
    parts = bf16_parts(a)
    out: Tensor | None = None
    for i in range(len(parts)):
        for j in range(i, len(parts)):
            if i + j < PARTS:
                p = mm(parts[i], parts[j].transpose(1, 2))
                if j > i:
                    p = p + p.transpose(1, 2)  # the (j, i) product
                out = p if out is None else out.add_(p)
    assert out is not None
    return out


def mm32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (2-D, or 3-D batched) with float32-accurate products summed in float32 at least: float32
    (float64 when an operand is float64). On CUDA from bf16 parts on the tensor cores (module docstring)."""
    if splits(a) and b.dtype != torch.float64:
        return split_product(a, b)
    return acc(a) @ acc(b)


def gram32(a: Tensor) -> Tensor:
    """``a @ aᵀ`` per batch row ([B, T, D] → [B, T, T]) as :func:`mm32`."""
    if splits(a):
        return split_gram(a)
    a = acc(a)
    return a @ a.transpose(1, 2)
