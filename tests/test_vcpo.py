"""The learner's loss (services/learner/vcpo.py, objectives/) against hand values, a slow float64 reference
written independently of the module, properties (hypothesis), bad inputs, and a real 2-process gloo ESS."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.ess import (
    distributed_effective_sample_size,
    effective_sample_size,
    ess_from_partial_sums,
    ess_partial_sums,
    lr_scale,
)
from services.learner.objectives.vcpo import opob_baseline, opob_baseline_with_stats
from services.learner.vcpo import (
    METRIC_KEYS,
    ObjectiveConfig,
    PolicyBatch,
    policy_loss,
    sequence_log_weights,
    trajectory_coefficients,
)

F64 = torch.float64
OBJECTIVES = ("vcpo", "grpo", "rloo", "reinforce")
AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "token-mean")
IS_MODES = ("truncated", "masked", "none")
WEIGHTINGS = ("paper", "exact", "released")
FAST = settings(max_examples=60, deadline=None)


def make_batch(
    seed: int, sizes=(3, 2, 4, 1), t: int = 5, spread: float = 0.5, dtype=F64, grad=True
) -> PolicyBatch:
    """Interleaved groups with arbitrary ids, ragged masks, rewards on a coarse grid (so ties happen)."""
    gen = torch.Generator().manual_seed(seed)
    b = sum(sizes)
    gid = torch.tensor([i * 37 - 50 for i, n in enumerate(sizes) for _ in range(n)])
    perm = torch.randperm(b, generator=gen)
    lp = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    beh = lp + spread * torch.randn(b, t, generator=gen, dtype=F64)
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[:, 0] = True
    rewards = torch.randint(0, 3, (b,), generator=gen).to(F64) / 2
    g = torch.rand(b, generator=gen, dtype=F64) * 2 + 0.01
    lp = lp[perm].to(dtype).requires_grad_(grad)
    return PolicyBatch(lp, beh[perm].to(dtype), mask[perm], rewards[perm], gid[perm], g[perm])


def reference_coefficients(batch: PolicyBatch, cfg: ObjectiveConfig) -> list[float]:
    """docs/research/vcpo.md §1–§4 with Python loops and plain float64 exp (inputs keep |ℓ| small)."""
    lp, beh = batch.logprobs.detach().tolist(), batch.behaviour_logprobs.tolist()
    mask, rewards = batch.loss_mask.bool().tolist(), batch.rewards.tolist()
    gids, g = batch.group_ids.tolist(), batch.sq_grad_norms.tolist()
    n = len(rewards)
    valid = [
        i
        for i in range(n)
        if any(mask[i]) and all(math.isfinite(x) for x, m in zip(beh[i], mask[i], strict=True) if m)
    ]
    ell = {i: sum(a - c for a, c, m in zip(lp[i], beh[i], mask[i], strict=True) if m) for i in valid}
    length = {i: sum(mask[i]) for i in valid}
    log_c = math.log(cfg.truncation)

    def wbar(i: int) -> float:
        return {"truncated": min(math.exp(ell[i]), cfg.truncation), "none": 1.0}.get(
            cfg.importance_weighting, math.exp(ell[i]) if ell[i] <= log_c else 0.0
        )

    def big_w(i: int) -> float:
        gi = max(g[i], 0.0)
        if cfg.baseline_weighting == "paper":
            return math.exp(2 * ell[i]) * gi
        if cfg.baseline_weighting == "released":
            return wbar(i) ** 2 * gi * math.exp(2 * ell[i])
        a = wbar(i) / (length[i] if cfg.loss_aggregation == "seq-mean-token-mean" else 1)
        return a * a * gi

    groups: dict[int, list[int]] = defaultdict(list)
    for i in valid:
        groups[gids[i]].append(i)
    batch_mean = sum(rewards[i] for i in valid) / max(len(valid), 1)
    adv = {}
    for members in groups.values():
        rs = [rewards[i] for i in members]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        ws = [big_w(i) for i in members]
        b = sum(w * r for w, r in zip(ws, rs, strict=True)) / sum(ws) if sum(ws) > 0 else mean
        for i in members:
            r = rewards[i]
            a = {
                "vcpo": r - b,
                "grpo": r - mean,
                "rloo": r - (sum(rs) - r) / max(len(rs) - 1, 1),
                "reinforce": r - batch_mean,
            }[cfg.objective]
            if cfg.objective in ("vcpo", "grpo") and cfg.std_normalize and std > 1e-8:
                a /= std
            if cfg.objective != "reinforce" and (len(rs) == 1 or max(rs) == min(rs)):
                a = 0.0
            adv[i] = a
    if cfg.objective == "reinforce" and len({rewards[i] for i in valid}) <= 1:
        adv = dict.fromkeys(valid, 0.0)
    total_len = sum(length.values())
    out = [0.0] * n
    for i in valid:
        denom = {"seq-mean-token-mean": len(valid) * length[i], "seq-mean-token-sum": len(valid)}
        out[i] = -adv[i] * wbar(i) / denom.get(cfg.loss_aggregation, total_len)
    return out


# ---------------------------------------------------------------- hand-computed values


def test_sequence_log_weights_ignore_masked_out_garbage() -> None:
    lp = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, -1.0]])
    beh = torch.tensor([[-1.5, -1.0, -math.inf], [-0.5, math.nan, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    lw = sequence_log_weights(lp, beh, mask)
    assert lw.dtype == F64 and not lw.requires_grad
    assert lw.tolist() == [0.5 - 1.0, 2.0]


def test_ess_hand_values() -> None:
    assert effective_sample_size(torch.zeros(4)) == (4.0, 1.0)
    ess, rho = effective_sample_size(torch.tensor([0.0, math.log(2.0)], dtype=F64))  # (1+2)²/(1+4)
    assert ess == pytest.approx(1.8, rel=1e-14) and rho == pytest.approx(0.9, rel=1e-14)
    ess, rho = effective_sample_size(torch.tensor([0.0, -50.0, -50.0, -50.0]))
    assert ess == pytest.approx(1.0, rel=1e-15) and rho == pytest.approx(0.25, rel=1e-15)
    assert effective_sample_size(torch.tensor([-math.inf, 3.0])) == (1.0, 0.5)
    ess, rho = effective_sample_size(torch.tensor([1000.0, -1000.0, 1000.0], dtype=torch.float32))
    assert ess == pytest.approx(2.0) and rho == pytest.approx(2 / 3)
    for bad in ([], [math.nan, 0.0], [math.inf, 0.0], [-math.inf, -math.inf]):
        assert all(math.isnan(v) for v in effective_sample_size(torch.tensor(bad)))


def test_lr_scale_rules() -> None:
    assert lr_scale(0.25) == 0.5
    assert lr_scale(0.25, rule="linear") == 0.25
    assert lr_scale(0.25, rule="off") == 1.0
    assert lr_scale(0.25, base_ratio=0.5) == pytest.approx(math.sqrt(0.5))
    assert lr_scale(0.7, base_ratio=0.55) == 1.0 == lr_scale(1.0, rule="linear")
    for rho, rule in itertools.product((math.nan, math.inf, -math.inf), ("sqrt", "linear", "off")):
        assert lr_scale(rho, rule=rule) == 0.0
    for kwargs in ({"rule": "cube"}, {"base_ratio": 0.0}, {"base_ratio": 1.5}, {"base_ratio": math.nan}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            lr_scale(0.5, **kwargs)
    with pytest.raises(ValueError, match="ess_ratio"):
        lr_scale(-0.1)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_opob_matches_direct_formula(weighting: str) -> None:
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(9, generator=gen, dtype=F64)
    lw = torch.randn(9, generator=gen, dtype=F64) * 1.5
    g = torch.rand(9, generator=gen, dtype=F64)
    gid = torch.tensor([5, 5, 5, -2, -2, 9, 9, 9, 9])
    lengths = torch.tensor([3.0, 1, 7, 2, 2, 5, 4, 1, 9], dtype=F64)
    wbar = torch.clamp(lw.exp(), max=2.0)  # C = 2: truncation is active for some
    w = {
        "paper": lw.exp() ** 2 * g,
        "exact": (wbar / lengths) ** 2 * g,
        "released": wbar**2 * g * lw.exp() ** 2,
    }
    b = opob_baseline(r, lw, g, gid, weighting, truncation=2.0, lengths=lengths)
    for k in gid.unique():
        sel = gid == k
        expected = (w[weighting][sel] * r[sel]).sum() / w[weighting][sel].sum()
        assert torch.allclose(b[sel], expected.expand(int(sel.sum())), rtol=1e-13, atol=0)


def test_opob_log_space_fallbacks_and_clamp() -> None:
    r = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.2, 0.7], dtype=F64)
    gid = torch.tensor([0, 0, 1, 1, 2, 2])
    lw = torch.tensor([1000.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # float32 in: e^2000 overflows outside log space
    g = torch.tensor([1.0, 1.0, 0.0, -1.0, math.nan, 1.0])
    b, fallbacks = opob_baseline_with_stats(r, lw, g, gid)
    assert b.tolist() == pytest.approx([1.0, 1.0, 0.6, 0.6, 0.45, 0.45], rel=1e-15)
    assert fallbacks == 2  # group 1: all weights zero; group 2: a NaN norm
    b = opob_baseline(r, torch.zeros(6), torch.full((6,), math.inf), gid)
    assert b.tolist() == pytest.approx([0.5, 0.5, 0.6, 0.6, 0.45, 0.45], rel=1e-15)
    with pytest.raises(ValueError, match="lengths"):
        opob_baseline(r, lw, g, gid, "exact")
    with pytest.raises(ValueError, match="weighting"):
        opob_baseline(r, lw, g, gid, "optimal")


def test_advantages_of_each_objective() -> None:
    # group 4: rewards [1, 0, 0, 0]; group 9: [2, 2] (all equal); group -1: singleton. On-policy, equal norms.
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=F64)
    gid = torch.tensor([4, 4, 4, 4, 9, 9, -1])
    lp = torch.full((7, 2), -1.0, dtype=F64)
    batch = PolicyBatch(lp, lp.clone(), torch.ones(7, 2, dtype=torch.bool), r, gid, torch.ones(7, dtype=F64))
    std = math.sqrt(0.1875)
    grpo = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0, 0, 0]
    rloo = [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0]
    mean = 10 / 7
    expected = {"vcpo": grpo, "grpo": grpo, "rloo": rloo, "reinforce": [x - mean for x in r.tolist()]}
    for objective, adv in expected.items():
        cfg = ObjectiveConfig(objective=objective, loss_aggregation="seq-mean-token-sum")
        coef, m = trajectory_coefficients(batch, cfg)
        assert (-coef * 7).tolist() == pytest.approx(adv, rel=1e-14, abs=1e-15), objective
        assert m["singleton_groups"] == 1 and m["baseline_fallbacks"] == 0
    coef, _ = trajectory_coefficients(batch, ObjectiveConfig(objective="grpo", std_normalize=False))
    assert (coef[:4] * -7 * 2).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25], rel=1e-14)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_closed_form(aggregation: str) -> None:
    lp = torch.tensor(
        [[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0], [-2.0, -1.0, -1.0]], dtype=F64, requires_grad=True
    )
    beh = torch.tensor([[-1.0, -2.5, 9.0], [-0.3, -0.1, math.nan], [-2.0, 2.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    r = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    batch = PolicyBatch(lp, beh, mask, r, torch.tensor([0, 0, 1]), torch.ones(3, dtype=F64))
    cfg = ObjectiveConfig(objective="grpo", loss_aggregation=aggregation, truncation=1.5)
    loss, m = policy_loss(batch, cfg)
    loss.backward()
    wbar = torch.tensor([1.5, 1.0, 1.0], dtype=F64)  # ℓ = 0.5 (truncated at 1.5), 0, 0 (a singleton: Â = 0)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=F64)
    lengths = mask.sum(-1).to(F64)
    denom = {"seq-mean-token-mean": 3 * lengths, "seq-mean-token-sum": torch.full((3,), 3.0, dtype=F64)}
    coef = -adv * wbar / denom.get(aggregation, lengths.sum())
    assert torch.allclose(lp.grad, coef[:, None] * mask, rtol=1e-15, atol=0)
    assert loss.item() == pytest.approx(float((coef * (lp.detach() * mask).sum(-1)).sum()), rel=1e-15)
    assert m["frac_truncated"] == pytest.approx(1 / 3) and m["log_weight_max"] == 0.5


def test_ppo_clipping_zeroes_clipped_tokens() -> None:
    eps = 0.2
    lp = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    # log-ratios: r = 1.5 (above), 1.1 (inside), 0.5 (below), 1 (padding, masked out)
    beh = -torch.tensor([[math.log(1.5), math.log(1.1), math.log(0.5), 0.0]] * 2, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]] * 2, dtype=torch.bool)
    batch = PolicyBatch(lp, beh, mask, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), None)
    cfg = ObjectiveConfig(objective="grpo", ppo_clip=eps, loss_aggregation="seq-mean-token-sum")
    loss, m = policy_loss(batch, cfg)
    loss.backward()
    # Â = +1 / −1. Â>0: r=1.5 clipped (no grad); Â<0: r=0.5 clipped (no grad). Gradient of −r·Â/B is −Â·r/B.
    expected = torch.tensor([[0.0, -1.1 / 2, -0.5 / 2, 0], [1.5 / 2, 1.1 / 2, 0.0, 0]], dtype=F64)
    assert torch.allclose(lp.grad, expected, rtol=1e-13, atol=1e-15)
    terms = [1.2, 1.1, 0.5, -1.5, -1.1, -0.8]
    assert loss.item() == pytest.approx(-sum(terms) / 2, rel=1e-13)
    assert m["ppo_clip_fraction"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="ppo_clip"):
        trajectory_coefficients(batch, cfg)


def test_ppo_on_policy_gradient_equals_unweighted_coefficients() -> None:
    batch = make_batch(11, spread=0.0)
    for aggregation in AGGREGATIONS:
        batch.logprobs.grad = None
        kw = {"loss_aggregation": aggregation, "importance_weighting": "none"}
        policy_loss(batch, ObjectiveConfig(ppo_clip=0.2, **kw))[0].backward()
        coef, _ = trajectory_coefficients(batch, ObjectiveConfig(**kw))
        assert torch.allclose(batch.logprobs.grad, coef[:, None] * batch.loss_mask, rtol=1e-12, atol=1e-15)


def test_loss_is_coefficient_form_everywhere() -> None:
    batch = make_batch(5, spread=1.0)
    batch.behaviour_logprobs[2, ~batch.loss_mask[2]] = math.nan
    for objective, aggregation, mode, weighting in itertools.product(
        OBJECTIVES, AGGREGATIONS, IS_MODES, WEIGHTINGS
    ):
        cfg = ObjectiveConfig(
            objective, mode, 1.5, baseline_weighting=weighting, loss_aggregation=aggregation
        )
        batch.logprobs.grad = None
        loss, m = policy_loss(batch, cfg)
        coef, m2 = trajectory_coefficients(batch, cfg)
        assert loss.item() == (coef * (batch.logprobs * batch.loss_mask).sum(-1)).sum().item()
        loss.backward()
        assert torch.equal(batch.logprobs.grad, coef[:, None] * batch.loss_mask)
        assert coef.tolist() == pytest.approx(reference_coefficients(batch, cfg), rel=1e-10, abs=1e-15)
        assert m == m2 and list(m) == list(METRIC_KEYS) and all(type(v) is float for v in m.values())


# ---------------------------------------------------------------- properties

log_weight_lists = st.lists(st.floats(-1000, 1000), min_size=1, max_size=40)


@FAST
@given(log_weight_lists)
def test_ess_finite_and_bounded(lw: list[float]) -> None:
    ess, rho = effective_sample_size(torch.tensor(lw, dtype=F64))
    assert math.isfinite(ess) and 1.0 - 1e-12 <= ess <= len(lw) and 0 < rho <= 1


@FAST
@given(st.floats(-1000, 1000), st.integers(1, 500))
def test_ess_equal_weights_is_one(value: float, n: int) -> None:
    assert effective_sample_size(torch.full((n,), value, dtype=F64))[1] == pytest.approx(1.0, abs=1e-12)


@FAST
@given(log_weight_lists, st.lists(st.integers(0, 40), max_size=4))
def test_partial_sums_over_shards_equal_single_batch(lw: list[float], cuts: list[int]) -> None:
    t = torch.tensor(lw, dtype=F64)
    bounds = [0, *sorted(min(c, len(lw)) for c in cuts), len(lw)]
    shards = [t[a:b] for a, b in itertools.pairwise(bounds)]
    shift = max(float(s.max()) for s in shards if s.numel())
    parts = [ess_partial_sums(s, shift) for s in shards]
    ess, rho = ess_from_partial_sums(*(sum(p[k] for p in parts) for k in range(3)))
    single = effective_sample_size(t)
    assert ess == pytest.approx(single[0], rel=1e-12) and rho == pytest.approx(single[1], rel=1e-12)


@FAST
@given(st.integers(0, 2**31), st.sampled_from(WEIGHTINGS), st.floats(-30, 30))
def test_baseline_is_a_weighted_mean_inside_the_range(seed: int, weighting: str, offset: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    gid = torch.randint(-3, 3, (12,), generator=gen) * 1000
    r = torch.randint(0, 3, (12,), generator=gen).to(F64) / 10  # ties: the range check is exact, not approx
    lw = offset + 3 * torch.randn(12, generator=gen, dtype=F64)
    g = torch.rand(12, generator=gen, dtype=F64)
    lengths = torch.randint(1, 9, (12,), generator=gen).to(F64)
    b = opob_baseline(r, lw, g, gid, weighting, lengths=lengths)
    for k in gid.unique():
        sel = gid == k
        assert r[sel].min() <= b[sel].min() and b[sel].max() <= r[sel].max() and b[sel].unique().numel() == 1
    mean = opob_baseline(r, torch.full((12,), offset, dtype=F64), torch.ones(12, dtype=F64), gid, "paper")
    for k in gid.unique():
        assert torch.allclose(mean[gid == k], r[gid == k].mean(), rtol=1e-12, atol=1e-15)
    perm = torch.randperm(12, generator=gen)
    b_perm = opob_baseline(r[perm], lw[perm], g[perm], gid[perm], weighting, lengths=lengths[perm])
    assert torch.allclose(b_perm, b[perm], rtol=1e-13, atol=1e-15)


@FAST
@given(st.integers(0, 2**31), st.floats(-20, 20), st.sampled_from(("seq-mean-token-sum", "token-mean")))
def test_weightings_agree_where_the_spec_says(seed: int, scale: float, aggregation: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    gid, r = torch.randint(0, 4, (10,), generator=gen), torch.randn(10, generator=gen, dtype=F64)
    lw, g = scale * torch.rand(10, generator=gen, dtype=F64), torch.rand(10, generator=gen, dtype=F64)
    kw = {"truncation": math.inf, "aggregation": aggregation}
    paper = opob_baseline(r, lw, g, gid, "paper", **kw)
    assert torch.allclose(opob_baseline(r, lw, g, gid, "exact", **kw), paper, rtol=1e-12, atol=1e-14)
    none = {"importance_weighting": "none", "truncation": 2.0}
    assert torch.allclose(opob_baseline(r, lw, g, gid, "released", **none), paper, rtol=1e-12, atol=1e-14)
    lengths = torch.full((10,), 7.0, dtype=F64)  # on-policy, equal lengths: all three agree
    on = [opob_baseline(r, torch.zeros(10, dtype=F64), g, gid, w, lengths=lengths) for w in WEIGHTINGS]
    assert torch.allclose(on[0], on[1], rtol=1e-13) and torch.allclose(on[0], on[2], rtol=1e-13)


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from(OBJECTIVES),
    st.sampled_from(AGGREGATIONS),
    st.sampled_from(IS_MODES),
    st.sampled_from(WEIGHTINGS),
    st.floats(0.0, 2.0),
)
def test_coefficients_match_reference_and_permute(
    seed, objective, aggregation, mode, weighting, spread
) -> None:
    batch = make_batch(seed, spread=spread, grad=False)
    cfg = ObjectiveConfig(objective, mode, 2.0, baseline_weighting=weighting, loss_aggregation=aggregation)
    coef, _ = trajectory_coefficients(batch, cfg)
    assert coef.tolist() == pytest.approx(reference_coefficients(batch, cfg), rel=1e-9, abs=1e-14)
    perm = torch.randperm(coef.numel(), generator=torch.Generator().manual_seed(seed))
    fields = [getattr(batch, f)[perm] for f in PolicyBatch.__dataclass_fields__]
    coef_perm, _ = trajectory_coefficients(PolicyBatch(*fields), cfg)
    assert torch.allclose(coef_perm, coef[perm], rtol=1e-12, atol=1e-15)
    for k in batch.group_ids.unique():  # a group whose rewards are all equal contributes exactly zero
        sel = batch.group_ids == k
        if objective != "reinforce" and batch.rewards[sel].unique().numel() == 1:
            assert (coef[sel] == 0).all()


@FAST
@given(
    st.integers(0, 2**31),
    st.sampled_from(OBJECTIVES),
    st.floats(0.0, 0.5),
    st.sampled_from([math.inf, 8.0]),
    st.floats(0.0, 300.0),
)
def test_loss_always_finite(seed: int, objective: str, clip: float, c: float, spread: float) -> None:
    batch = make_batch(seed, spread=spread, dtype=torch.float32)
    batch.logprobs.data[~batch.loss_mask] = math.nan
    batch.behaviour_logprobs[0, :] = -math.inf  # a dead trajectory: skipped, counted
    loss, m = policy_loss(batch, ObjectiveConfig(objective, truncation=c, ppo_clip=clip))
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(batch.logprobs.grad).all())
    assert m["skipped_nonfinite"] == 1 and m["num_valid"] == m["num_trajectories"] - 1


# ---------------------------------------------------------------- bad inputs, skips and counters


def test_bad_inputs_raise_naming_what_and_where() -> None:
    def fresh(**change) -> PolicyBatch:
        batch = make_batch(1, sizes=(2, 2), t=3)
        for k, v in change.items():
            setattr(batch, k, v)
        return batch

    lp_inf = make_batch(1, sizes=(2, 2), t=3).logprobs.detach().clone()
    lp_inf[3, 0] = -math.inf
    cases = {
        "behaviour_logprobs": fresh(behaviour_logprobs=torch.zeros(4, 4)),
        "PolicyBatch.logprobs must be a 2-D": fresh(logprobs=torch.zeros(4)),
        "rewards must have shape": fresh(rewards=torch.zeros(3)),
        "group_ids must have an integer": fresh(group_ids=torch.zeros(4)),
        r"rewards are non-finite at \[2\]": fresh(rewards=torch.tensor([0.0, 1.0, math.nan, 0.0])),
        r"logprobs on masked tokens are non-finite at \[\(3, 0\)\]": fresh(logprobs=lp_inf),
        r"loss_mask must be bool or 0/1, bad values at \[\(0, 1\)\]": fresh(
            loss_mask=torch.tensor([[1, 2, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
        ),
        "sq_grad_norms is required": fresh(sq_grad_norms=None),
        "sq_grad_norms must have shape": fresh(sq_grad_norms=torch.ones(2, 2)),
    }
    for message, batch in cases.items():
        with pytest.raises(ValueError, match=message):
            policy_loss(batch, ObjectiveConfig())
    with pytest.raises(ValueError, match="ess_ratio"):
        policy_loss(fresh(), ObjectiveConfig(), ess_ratio=1.5)
    bad_fields = [
        ("objective", "ppo"),
        ("truncation", 0.0),
        ("truncation", math.nan),
        ("rho_base", 0.0),
        ("rho_base", 1.1),
        ("ppo_clip", -0.1),
        ("ppo_clip", math.inf),
        ("loss_aggregation", "sum"),
        ("importance_weighting", "clip"),
        ("ess_rule", "log"),
        ("baseline_weighting", "x"),
        ("std_normalize", 1),
    ]
    for field, value in bad_fields:
        with pytest.raises(ValueError, match=f"ObjectiveConfig.{field} .*{value!r}"):
            ObjectiveConfig(**{field: value})
    assert ObjectiveConfig(truncation=math.inf).truncation == math.inf


def test_skipped_trajectories_are_counted_and_excluded() -> None:
    batch = make_batch(2, sizes=(3, 3), t=4)
    batch.loss_mask[1] = False  # empty
    batch.behaviour_logprobs[4, batch.loss_mask[4].nonzero()[0]] = math.nan  # non-finite on a masked token
    batch.logprobs.data[1] = math.nan  # garbage outside the mask changes nothing
    coef, m = trajectory_coefficients(batch, ObjectiveConfig())
    assert (m["skipped_empty"], m["skipped_nonfinite"], m["num_valid"]) == (1, 1, 4)
    keep = torch.tensor([0, 2, 3, 5])
    fields = [getattr(batch, f)[keep] for f in PolicyBatch.__dataclass_fields__]
    clean, m_clean = trajectory_coefficients(PolicyBatch(*fields), ObjectiveConfig())
    assert coef[1] == 0 and coef[4] == 0 and torch.equal(coef[keep], clean)
    assert m["ess"] == m_clean["ess"] and m["num_tokens"] == m_clean["num_tokens"]


def test_masked_out_garbage_changes_nothing() -> None:
    clean, dirty = make_batch(4), make_batch(4)
    out = ~dirty.loss_mask
    dirty.logprobs.data[out] = torch.tensor([math.nan, math.inf, -math.inf], dtype=F64).repeat(
        int(out.sum())
    )[: int(out.sum())]
    dirty.behaviour_logprobs[out] = math.nan
    for cfg in (ObjectiveConfig(), ObjectiveConfig(objective="rloo", ppo_clip=0.3)):
        (a, ma), (b, mb) = policy_loss(clean, cfg), policy_loss(dirty, cfg)
        a.backward()
        b.backward()
        assert a.item() == b.item() and ma == mb and torch.equal(clean.logprobs.grad, dirty.logprobs.grad)
        clean.logprobs.grad = dirty.logprobs.grad = None


def test_skipped_steps_return_a_differentiable_zero() -> None:
    batch = make_batch(6, sizes=(2, 2), t=3)
    batch.loss_mask[:] = False
    batch.loss_mask[0, 0] = True
    batch.behaviour_logprobs[0, 0] = math.inf
    loss, m = policy_loss(batch, ObjectiveConfig())
    loss.backward()
    assert loss.item() == 0 and m["step_skipped"] == 1 and m["lr_scale"] == 0 and math.isnan(m["ess"])
    assert (m["skipped_empty"], m["skipped_nonfinite"]) == (3, 1) and torch.equal(
        batch.logprobs.grad, torch.zeros(4, 3, dtype=F64)
    )
    for kwargs in ({"ess_ratio": math.nan}, {"ess_ratio": math.inf}):
        loss, m = policy_loss(make_batch(6), ObjectiveConfig(ppo_clip=0.2), **kwargs)
        assert loss.item() == 0 and loss.requires_grad and m["step_skipped"] == 1 and m["lr_scale"] == 0
    lp0, zeros = torch.zeros(0, 3, requires_grad=True), torch.zeros(0)
    empty = PolicyBatch(
        lp0, torch.zeros(0, 3), torch.zeros(0, 3), zeros, torch.zeros(0, dtype=torch.long), zeros
    )
    assert policy_loss(empty, ObjectiveConfig())[1]["step_skipped"] == 1
    huge = make_batch(7, sizes=(5, 5), spread=0.1, dtype=torch.float32)  # C = inf, ℓ ≈ 200: w̄ overflows
    huge.behaviour_logprobs[0, 0] -= 200
    huge.rewards[0] = 5.0  # a reward of its own, so Â_0 ≠ 0 and the overflow reaches the loss
    loss, m = policy_loss(huge, ObjectiveConfig(objective="rloo", truncation=math.inf))
    assert loss.item() == 0 and m["step_skipped"] == 1
    loss, m = policy_loss(huge, ObjectiveConfig(objective="rloo"), ess_ratio=0.3)
    assert m["step_skipped"] == 0 and m["ess_ratio"] == 0.3 and m["lr_scale"] == pytest.approx(math.sqrt(0.3))
    assert m["frac_truncated"] == pytest.approx(1 / 10) and m["log_weight_max"] > 190


def test_overflow_guards_do_not_skip_healthy_steps() -> None:
    batch = make_batch(8, sizes=(3, 3), spread=0.1)
    first = batch.group_ids == batch.group_ids.min()
    batch.rewards[first] = 1.0  # an all-equal group: Â = 0 exactly ...
    batch.rewards[~first] = torch.tensor([0.0, 1.0, 0.0], dtype=F64)
    batch.behaviour_logprobs[first, 0] -= 800  # ... so its w̄ = e^800 = inf must not poison the step
    loss, m = policy_loss(batch, ObjectiveConfig(objective="grpo", truncation=math.inf))
    assert m["step_skipped"] == 0 and math.isfinite(loss.item()) and loss.item() != 0
    ppo = make_batch(9, sizes=(2,), t=2, dtype=torch.float32)
    ppo.rewards[:] = torch.tensor([1.0, 0.0])
    ppo.behaviour_logprobs[:, 0] = -100.0  # token log-ratio ≈ 100: exp overflows float32 unless clamped
    loss, m = policy_loss(ppo, ObjectiveConfig(objective="rloo", ppo_clip=0.2))
    loss.backward()
    assert m["step_skipped"] == 0 and math.isfinite(loss.item()) and torch.isfinite(ppo.logprobs.grad).all()


# ---------------------------------------------------------------- two real processes


DIST_CASES = [
    [[0.1, -3.0, 2.0], []],
    [[-1000.0, 5.0], [1000.0, 999.5, -20.0]],
    [[0.0, 0.0], [0.0, 0.0, 0.0]],
    [[], [-7.0]],
    [[math.nan], [1.0]],
]


def _dist_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = [distributed_effective_sample_size(torch.tensor(c[rank], dtype=F64)) for c in DIST_CASES]
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def test_distributed_ess_is_identical_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_dist_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    for case, a, b in zip(DIST_CASES, r0, r1, strict=True):
        single = effective_sample_size(torch.tensor(case[0] + case[1], dtype=F64))
        if math.isnan(single[1]):
            assert all(math.isnan(v) for v in a + b)
            continue
        assert a == b
        assert a == pytest.approx(list(single), rel=1e-13)
    assert r0[2] == [5.0, 1.0]
    assert distributed_effective_sample_size(torch.zeros(3)) == (3.0, 1.0)  # not initialised: local value
