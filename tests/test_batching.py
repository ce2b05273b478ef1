"""Scored groups to step tensors: layout, validation with counted reasons, the lag bound, rank placement."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from services.common.synthetic import make_group
from services.common.tiny_model import TinyModelSpec, build_tiny_model
from services.learner.batching import REJECT_REASONS, StepAssembler, check_group, place_groups, to_tensors
from services.learner.logprobs import token_logprobs
from services.learner.vcpo import sequence_log_weights
from vcpo.v1 import rollout_pb2


def scored(
    i: int = 0, n: int = 4, response_len: int = 12, prompt_len: int = 5, version: int = 3
) -> rollout_pb2.TrajectoryGroup:
    return make_group(
        i, n=n, response_len=response_len, prompt_len=prompt_len, policy_version=version, scored=True
    )


def test_rows_are_prompt_then_response_with_aligned_logprobs_and_mask() -> None:
    a, b = scored(0, n=2, response_len=7, prompt_len=3), scored(1, n=3, response_len=20, prompt_len=4)
    batch = to_tensors([a, b], pad_token_id=0)
    assert batch.input_ids.shape == (5, 24) and batch.group_ids.tolist() == [0, 0, 1, 1, 1]
    for row, (g, t) in enumerate(
        [(a, a.trajectories[0]), (a, a.trajectories[1]), *((b, t) for t in b.trajectories)]
    ):
        p, n = len(g.prompt_tokens), len(t.response_tokens)
        assert batch.input_ids[row, :p].tolist() == list(g.prompt_tokens)
        assert batch.input_ids[row, p : p + n].tolist() == list(t.response_tokens)
        assert batch.input_ids[row, p + n :].eq(0).all() and batch.attention_mask[row, p + n :].eq(0).all()
        assert batch.attention_mask[row, : p + n].eq(1).all()
        assert batch.response_mask[row, :p].eq(0).all()
        assert batch.response_mask[row, p : p + n].tolist() == [int(m) for m in t.loss_mask]
        assert torch.allclose(
            batch.behaviour_logprobs[row, p : p + n], torch.tensor(list(t.behaviour_logprobs))
        )
        assert batch.rewards[row] == t.reward.value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    path: Path = build_tiny_model(tmp_path_factory.mktemp("batching") / "model", TinyModelSpec())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_a_group_scored_by_the_same_weights_has_zero_log_weights(model) -> None:  # type: ignore[no-untyped-def]
    """The sampler's log-probs line up with the learner's recomputation column by column."""
    g = torch.Generator().manual_seed(0)
    group = rollout_pb2.TrajectoryGroup(
        group_id="same", prompt_tokens=torch.randint(3, 500, (6,), generator=g).tolist()
    )
    for length in (9, 4, 13):
        response = torch.randint(3, 500, (length,), generator=g).tolist()
        ids = torch.tensor([list(group.prompt_tokens) + response])
        with torch.no_grad():
            logp = token_logprobs(model, ids, torch.ones_like(ids))[0, 6:].tolist()  # the "sampler's" numbers
        mask = [True] * length
        mask[1] = False  # a tool-output token
        group.trajectories.append(
            rollout_pb2.Trajectory(
                response_tokens=response,
                behaviour_logprobs=[lp if m else 0.0 for lp, m in zip(logp, mask, strict=True)],
                loss_mask=mask,
                reward=rollout_pb2.Reward(value=1.0),
            )
        )
    batch = to_tensors([group])
    with torch.no_grad():
        current = token_logprobs(model, batch.input_ids, batch.attention_mask)
    weights = sequence_log_weights(current, batch.behaviour_logprobs, batch.response_mask.bool())
    assert weights.abs().max() < 1e-5


VOCAB = 32_000  # the messages' token ids are below it


def _broken(kind: str) -> rollout_pb2.TrajectoryGroup:
    group = scored(0, n=3)
    t = group.trajectories[1]
    if kind == "empty_group":
        del group.trajectories[:]
    elif kind == "group_too_large":
        group.trajectories.extend([group.trajectories[0]] * 6)
    elif kind == "empty_prompt":
        del group.prompt_tokens[:]
    elif kind == "length_mismatch":
        t.loss_mask.append(True)
    elif kind == "missing_logprobs":
        del t.behaviour_logprobs[:]
    elif kind == "nonfinite_logprobs":
        t.behaviour_logprobs[0] = math.nan
    elif kind == "missing_reward":
        t.ClearField("reward")
    elif kind == "nonfinite_reward":
        t.reward.value = math.nan
    elif kind == "bad_versions":
        t.policy_version_end = t.policy_version_start - 1
    elif kind == "token_out_of_range":
        t.response_tokens[2] = VOCAB
    return group


@pytest.mark.parametrize("kind", REJECT_REASONS)
def test_bad_groups_are_rejected_with_their_reason(kind: str) -> None:
    problem = check_group(_broken(kind), max_group_size=8, vocab_size=VOCAB)
    assert problem is not None and problem[0] == kind and "group 'group-0'" in problem[1]


def test_nan_on_a_masked_out_token_is_fine() -> None:
    group = scored(0)
    t = group.trajectories[0]
    t.loss_mask[0], t.behaviour_logprobs[0] = False, math.nan
    assert check_group(group, 8) is None


def test_assembler_keeps_drops_by_lag_and_counts_rejections() -> None:
    asm = StepAssembler(k=2, groups_per_step=3, max_group_size=8)
    version = 10
    outcomes = [asm.offer(scored(i, version=v), version) for i, v in enumerate([10, 8, 7, 9, 11, 10])]
    assert outcomes == ["kept", "kept", "dropped", "kept", "dropped", "kept"]
    assert dict(asm.dropped_by_lag) == {3: 1, -1: 1}  # too old; from a version that does not exist yet
    assert asm.offer(_broken("nonfinite_reward"), version) == "rejected"
    assert asm.rejected == {"nonfinite_reward": 1} and asm.last_rejection[0] == "nonfinite_reward"
    assert "reward nan" in asm.last_rejection[1]
    assert asm.ready and [g.group_id for g in asm.take()] == ["group-0", "group-1", "group-3"]
    assert not asm.ready and [g.group_id for g in asm.groups] == ["group-5"]


def test_k_zero_keeps_only_groups_of_the_current_version() -> None:
    asm = StepAssembler(k=0, groups_per_step=2, max_group_size=8)
    assert [asm.offer(scored(i, version=v), 5) for i, v in enumerate([5, 4, 5])] == [
        "kept",
        "dropped",
        "kept",
    ]


def test_groups_are_placed_whole_and_balanced() -> None:
    groups = [
        scored(i, n=4, response_len=length) for i, length in enumerate([100, 10, 90, 20, 50, 50, 30, 40])
    ]
    ranks = place_groups(groups, 2)
    assert sorted(i for r in ranks for i in r) == list(range(8))
    tokens = [
        sum(
            len(g.prompt_tokens) * 4 + sum(len(t.response_tokens) for t in g.trajectories)
            for g in (groups[i] for i in r)
        )
        for r in ranks
    ]
    assert abs(tokens[0] - tokens[1]) <= 4 * 10 + 4 * 5  # within about the smallest group
    assert place_groups(groups[:1], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        place_groups(groups, 0)


def test_a_long_tailed_step_is_run_at_its_micro_batches_own_widths() -> None:
    """One rank's rows of the 7B math preset's shape (4 groups of 16: 64 rows, a 150-token prompt, responses
    up to 2048 tokens from a long tail with ~5% cut at the maximum, 4 rows per micro-batch), as to_tensors lays
    them out at the longest row's width: the step's micro-batches (longest rows first, each trimmed to its own
    longest row) run at most 1.2 positions per real token, where running every row at the rank's width
    costs more than twice the real tokens."""
    from services.learner.step import plan_step

    rng = random.Random(0)
    groups = []
    for i in range(4):
        group = scored(i, n=16, response_len=2048, prompt_len=150)
        for t in group.trajectories:
            long = rng.random() < 0.05
            keep = 2048 if long else min(2047, int(rng.lognormvariate(math.log(600), 0.7)))
            del t.response_tokens[keep:], t.behaviour_logprobs[keep:], t.loss_mask[keep:]
        groups.append(group)
    batch = to_tensors(groups)
    real = int(batch.attention_mask.sum())
    assert batch.input_ids.shape == (64, 150 + 2048)  # a truncated response sets the rank's width
    plan = plan_step(batch, 4)
    rows = torch.cat([m.index for m in plan.micro])
    assert sorted(rows.tolist()) == list(range(64))  # every row once
    lengths = batch.attention_mask.sum(1)
    assert lengths[rows].tolist() == sorted(lengths.tolist(), reverse=True)  # longest first
    assert [w for _, w in plan.shapes()] == [int(lengths[m.index].max()) for m in plan.micro]
    assert sum(r * w for r, w in plan.shapes()) / real <= 1.2
    full = plan_step(batch, 4, full_width=True)
    assert sum(r * w for r, w in full.shapes()) / real > 2
