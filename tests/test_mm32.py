"""mm32: float32-accurate products from bf16 parts (the tensor-core path of the norm pass), checked on a CPU
with the tensor cores' arithmetic emulated (bf16 × bf16 products are exact in float32, sums in float32)."""

from __future__ import annotations

import pytest
import torch

from services.learner import mm32 as m


def emulated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What torch.mm/bmm(out_dtype=float32) computes from bf16 operands: exact products, float32 sums."""
    assert a.dtype == b.dtype == torch.bfloat16
    return a.float() @ b.float()


def operand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # wide dynamic range, like backward signals: magnitudes over 2^-20 .. 2^4
    t = torch.randn(shape, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 5, shape, generator=g)
    )
    return t.to(dtype)


def float32_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32's error bound for a @ b of these operands: (k + 3)·2^-24 · |a| @ |b| (k terms per sum; three
    more for the product's rounding and the parts left out)."""
    k = a.shape[-1]
    return (k + 3) * 2.0**-24 * (a.double().abs() @ b.double().abs())


def test_three_bf16_parts_hold_a_float32() -> None:
    t = operand((4096,), torch.float32, 0)
    parts = m.bf16_parts(t)
    assert len(parts) == 3 and all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert float(((total - t.double()).abs() / t.double().abs()).max()) <= 2.0**-24
    assert float(((parts[0].double() - t.double()).abs() / t.double().abs()).max()) > 2.0**-12  # not trivial
    bf = t.to(torch.bfloat16)
    assert m.bf16_parts(bf) == [bf]


@pytest.mark.parametrize(
    ("da", "db"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
    ids=["f32-bf16", "bf16-f32", "f32-f32"],
)
@pytest.mark.parametrize("batched", [False, True], ids=["2d", "3d"])
def test_split_product_has_float32_accuracy(da: torch.dtype, db: torch.dtype, batched: bool) -> None:
    lead = (3,) if batched else ()
    a, b = operand((*lead, 40, 300), da, 1), operand((*lead, 300, 24), db, 2)
    got = m.split_product(a, b, emulated)
    assert got.dtype == torch.float32
    exact = a.double() @ b.double()
    assert bool(((got.double() - exact).abs() <= float32_bound(a, b)).all())
    # the check can fail: one bf16 part of each float32 operand is bf16's accuracy, far outside the bound
    rounded = emulated(a.to(torch.bfloat16), b.to(torch.bfloat16))
    assert not bool(((rounded.double() - exact).abs() <= float32_bound(a, b)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gram_is_the_product_with_the_transpose(dtype: torch.dtype) -> None:
    a = operand((2, 50, 700), dtype, 3)
    got = m.split_gram(a, emulated)
    exact = a.double() @ a.double().transpose(1, 2)
    assert bool(((got.double() - exact).abs() <= float32_bound(a, a.transpose(1, 2))).all())
    assert torch.equal(got, got.transpose(1, 2))  # the (i, j) and (j, i) products folded exactly


def test_the_plain_path_on_a_cpu_and_for_float64() -> None:
    a, b = operand((5, 7), torch.bfloat16, 4), operand((7, 3), torch.float32, 5)
    assert not m.splits(a)  # a CPU tensor
    assert torch.equal(m.mm32(a, b), a.float() @ b)
    with m.products("split"):
        assert m.splits(a) and not m.splits(a.double())  # float64 references never split
        d = operand((5, 7), torch.float64, 6)
        assert m.mm32(d, b.double()).dtype == torch.float64
    with m.products("plain"):
        assert not m.splits(a)
    assert m.gram32(operand((1, 4, 6), torch.bfloat16, 7)).dtype == torch.float32


def test_products_mode_is_checked_and_restored() -> None:
    with pytest.raises(ValueError, match="mm32 products mode"), m.products("fast"):
        pass
    with m.products("split"):
        with m.products("plain"):
            assert not m.splits(torch.zeros(1))
        assert m.splits(torch.zeros(1))
    assert not m.splits(torch.zeros(1))


def test_the_memory_estimate_follows_the_split_path_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), m.products("split"):
        a, b = torch.empty(2, 8, 16), torch.empty(2, 16, 4, dtype=torch.bfloat16)
        out = m.mm32(a, b)
        assert out.shape == (2, 8, 4) and out.dtype == torch.float32
        assert m.gram32(a).shape == (2, 8, 8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("da", "db"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
    ids=["bf16-bf16", "f32-bf16", "f32-f32"],
)
def test_tensor_core_products_have_float32_accuracy_on_cuda(da: torch.dtype, db: torch.dtype) -> None:
    a, b = operand((4, 256, 1024), da, 8).cuda(), operand((4, 1024, 192), db, 9).cuda()
    assert m.splits(a) and m._out_dtype_runs(a.device)  # CUDA's probe passes
    got = m.mm32(a, b)
    exact = a.double() @ b.double()
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= float32_bound(a, b)).all())
    gram = m.gram32(a)
    assert bool(
        (
            (gram.double() - a.double() @ a.double().transpose(1, 2)).abs()
            <= float32_bound(a, a.transpose(1, 2))
        ).all()
    )
    # and the CUDA cores' float32 GEMM, for the record of what the split replaces, meets the same bound
    with m.products("plain"):
        plain = m.mm32(a, b)
    assert bool(((plain.double() - exact).abs() <= float32_bound(a, b)).all())


def test_a_device_without_float32_output_gemms_keeps_float32_gemms(caplog: pytest.LogCaptureFixture) -> None:
    # a CPU build has no bf16 GEMM with a float32 output: the probe says so once and warns (as a ROCm build might)
    with caplog.at_level("WARNING"):
        assert not m._out_dtype_runs(torch.device("cpu"))
    assert "float32 GEMMs instead" in caplog.text
