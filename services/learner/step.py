"""One optimizer step's gradient: the model-facing half of the objective (VCPO.md §4–§5).

    TrajectoryTensors (prompt+response rows, behaviour log-probs, rewards, group ids)
      │
      ├─ an objective that needs gradient norms (vcpo), no PPO clipping, memory mode "saved":
      │    per micro-batch: norm_pass → log π (detached), ‖∇ log π(τ_i)‖², saved activations
      │    whole step:      trajectory_coefficients → c_i, ESS, ρ, OPOB, metrics   (vcpo.py, pure)
      │    one backward:    accumulate_weighted_gradients(c) → .grad               (no second forward)
      │
      ├─ the same, memory mode "recompute":
      │    per micro-batch: streaming_norm_pass → log π, ‖∇ log π(τ_i)‖²            (nothing kept)
      │    whole step:      trajectory_coefficients → c_i ...
      │    per micro-batch: forward → backward of Σ_i c_i Σ_t m_it log π_it          (ordinary autograd)
      │
      └─ any other objective (grpo, rloo, reinforce) or PPO clipping (per-token weights):
           [an objective that needs norms: norms by the streaming norm pass]
           per micro-batch: forward → policy_loss → backward                       (ordinary autograd)

Both leave the step's gradient in the parameters' ``.grad`` and return the metrics; the caller applies
``metrics["lr_scale"]`` to the learning rate for this one step, clips and steps the optimizer. The saved
norm-pass path keeps every micro-batch's activations until the coefficients are known (the memory of one
batched forward of the step's trajectories); the recompute path's memory is one micro-batch's
(:class:`MemoryOptions`).
With ``logit_chunk_tokens``, every path but the saved norm pass runs the output head in slices of the
positions, as many per micro-batch on every rank.

Micro-batches (:class:`StepPlan`): a rank's rows are sorted longest first, cut into micro-batches, and each
micro-batch is trimmed to the columns that hold its own rows' tokens, so a forward runs on [rows, its longest
row], not on the width of the rank's longest trajectory (one truncated response would otherwise set the
width of every micro-batch). Trimming drops only columns that are padding in every row of the micro-batch:
padding is masked out of attention, the loss and the norms, and positions skip it, so no value changes.
Every per-row result of the passes goes back to the batch's row order and width (zeros in the trimmed
columns) before any whole-step quantity is formed: the coefficients, ESS, baselines and metrics see the rows
as given, and the gradient pass hands each micro-batch its own rows' coefficients.

Distributed (DeepSpeed ZeRO-3, each rank holding whole groups): :class:`StepInputs` with
``backward=engine.backward`` and a :class:`StepCollectives`. Then every rank runs the same number of micro-batches (padding rows where it has
too few), ρ is the global one, and each rank's loss is rescaled so that the data-parallel average of the
ranks' gradients is the gradient of the one loss over all ranks' trajectories.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.learner.grad_norms import (
    accumulate_weighted_gradients,
    micro_batches,
    norm_pass,
    streaming_norm_pass,
)
from services.learner.logprobs import chunk_count, token_logprobs
from services.learner.vcpo import (
    ObjectiveConfig,
    PolicyBatch,
    policy_loss,
    trajectory_coefficients,
    valid_log_weights,
)


@dataclass
class TrajectoryTensors:
    """A step's trajectories as model inputs; every [B, T] tensor is aligned with ``input_ids``."""

    input_ids: Tensor  # [B, T] prompt + response tokens, padded left or right
    attention_mask: Tensor  # [B, T] 1 for real tokens
    response_mask: Tensor  # [B, T] 1 for tokens the model generated and is trained on
    behaviour_logprobs: Tensor  # [B, T] sampler's log-prob of token t at column t (ignored where mask is 0)
    rewards: Tensor  # [B]
    group_ids: Tensor  # [B]

    def select(self, index: Tensor, lo: int = 0, hi: int | None = None) -> TrajectoryTensors:
        """Rows ``index`` (in that order), and columns ``lo:hi`` of every [B, T] tensor."""
        return TrajectoryTensors(
            *(
                (t[:, lo:hi] if t.dim() == 2 else t).index_select(0, index)
                for t in (getattr(self, f.name) for f in fields(self))
            )
        )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class MemoryOptions:
    """How a step trades memory for time (``learner.memory_mode``, ``learner.logit_chunk_tokens``).

    ``saved``: the VCPO norm pass keeps every micro-batch's activations until the step's coefficients are
    known, then forms the gradient from them with no second forward (fastest; memory grows with the step).
    ``recompute``: the norm pass keeps only the norms and log-probs of each micro-batch; a second, ordinary
    forward and backward per micro-batch forms the gradient (memory of one micro-batch; one more forward).
    ``logit_chunk_tokens > 0``: outside the saved norm pass, the output head and log-softmax run that many
    positions at a time (no [B, T, vocab] tensor). ``auto`` is resolved before a step (memory.py).
    """

    mode: Literal["saved", "recompute"] = "saved"
    logit_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("saved", "recompute"):
            raise ValueError(f"memory mode must be 'saved' or 'recompute', got {self.mode!r}")
        if self.logit_chunk_tokens < 0:
            raise ValueError(f"logit_chunk_tokens must be >= 0, got {self.logit_chunk_tokens}")


class StepCollectives(Protocol):
    """What the ranks of a distributed step agree on; a single-process step needs none of it.

    Every method is a collective: all ranks call it, in the same order, once per step.
    """

    def num_micro_batches(self, local: int) -> int:
        """The step's micro-batch count on every rank (the most any rank needs): ZeRO-3 gathers parameters
        in every forward, so all ranks must run the same number of forwards and backwards."""
        ...

    def ess_ratio(self, log_weights: Tensor) -> float:
        """The global ρ from this rank's valid log weights (:func:`distributed_effective_sample_size`)."""
        ...

    def max_ints(self, values: list[int]) -> list[int]:
        """The element-wise maximum over ranks of ``values`` (the same length on every rank): how many slices
        each micro-batch's output head runs in, since under ZeRO-3 every call gathers the head's weight."""
        ...

    def loss_scale(self, metrics: dict[str, float], aggregation: str) -> float:
        """The factor turning this rank's loss (normalised by its own trajectory or token count) into its
        share of the global loss, times the world size the data-parallel gradient average divides by; 0
        when any rank had to skip the step."""
        ...


Backward = Callable[[Tensor], None]


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One forward's rows: ``index`` into the step's batch (empty: a padding micro-batch, run as one row with
    nothing to train on), and the columns ``[lo, hi)`` that hold every token of those rows."""

    index: Tensor  # [rows] int64, on the batch's device
    lo: int
    hi: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, positions per row)`` of its forward."""
        return max(len(self.index), 1), self.hi - self.lo


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The step's micro-batches over ``batch`` (:func:`plan_step`) and the way back to the batch's rows."""

    batch: TrajectoryTensors
    micro: list[MicroBatch]
    # each micro-batch's random-number state at its first forward (replay_masks)
    _rng: dict[int, tuple[Tensor, Tensor | None]] = field(default_factory=dict)

    def replay_masks(self, i: int) -> None:
        """Before every forward of micro-batch ``i``: the first records the random-number state, later ones
        restore it, so every pass draws the first's dropout masks (LoRA's, a model's own): the norm pass's
        norms are those of the gradient pass's gradient, a detached pass's log-probs the live pass's."""
        device = self.batch.input_ids.device
        state = self._rng.get(i)
        if state is None:
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            self._rng[i] = (torch.get_rng_state(), cuda)
            return
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)

    def rows(self) -> list[TrajectoryTensors]:
        """Every micro-batch's model inputs: its rows, trimmed to its columns."""
        return [
            self.batch.select(m.index, m.lo, m.hi) if len(m.index) else _padding_row(self.batch)
            for m in self.micro
        ]

    def widen(self, m: MicroBatch, t: Tensor) -> Tensor:
        """A micro-batch's ``[rows, hi − lo]`` result at the batch's width (zeros in the trimmed columns);
        ``[rows]`` results as they are."""
        return t if t.dim() == 1 else F.pad(t, (m.lo, int(self.batch.input_ids.shape[1]) - m.hi))

    def gather(self, parts: list[Tensor]) -> Tensor:
        """The micro-batches' per-row results (``[rows]`` or ``[rows, hi − lo]``) as one tensor over the
        batch's rows, in its order and at its width; padding micro-batches' results are dropped.
        Differentiable in ``parts``."""
        real = [(m, p) for m, p in zip(self.micro, parts, strict=True) if len(m.index)]
        index = torch.cat([m.index for m, _ in real])
        values = torch.cat([self.widen(m, p) for m, p in real])
        return values.new_zeros((len(self.batch), *values.shape[1:])).index_copy(0, index, values)

    def split(self, per_row: Tensor) -> list[Tensor]:
        """A ``[B]`` tensor in the batch's row order as the micro-batches' rows (a padding one's row: 0)."""
        return [
            per_row.index_select(0, m.index) if len(m.index) else per_row.new_zeros(1) for m in self.micro
        ]

    def shapes(self) -> list[tuple[int, int]]:
        return [m.shape for m in self.micro]


def plan_step(
    batch: TrajectoryTensors,
    micro_batch_size: int | None,
    collectives: StepCollectives | None = None,
    full_width: bool = False,
) -> StepPlan:
    """The step's micro-batches: ``micro_batch_size`` rows each (:func:`step_spans`: the count every rank
    agrees on when distributed), the rows sorted by their token span, longest first (ties in the batch's
    order), each micro-batch trimmed to the columns holding its rows' tokens (at least two, as a padding row).

    ``full_width``: the rows in the batch's order, every micro-batch at the batch's full width (the layout
    before trimming; kept so ``benchmarks/learner_step.py`` times both on one batch).
    """
    spans = step_spans(len(batch), micro_batch_size, collectives)
    width = int(batch.input_ids.shape[1])
    device = batch.input_ids.device
    none = torch.zeros(0, dtype=torch.long, device=device)
    if full_width:
        return StepPlan(
            batch,
            [
                MicroBatch(torch.arange(a, b, device=device), 0, width)
                if b > a
                else MicroBatch(none, 0, min(width, 2))
                for a, b in spans
            ],
        )
    real = batch.attention_mask.detach().to("cpu").bool()  # one copy: the plan is host arithmetic
    columns = torch.arange(width)
    first = torch.where(real, columns, width).amin(1)
    last = torch.where(real, columns, -1).amax(1)
    order = torch.argsort((last - first + 1).clamp(min=0), descending=True, stable=True)
    micro = []
    for a, b in spans:
        if b == a:
            micro.append(MicroBatch(none, 0, min(width, 2)))
            continue
        rows = order[a:b]
        lo, hi = int(first[rows].min()), int(last[rows].max()) + 1
        if hi - lo < 2:  # no token, or one: two columns, as a padding row has
            lo = max(0, min(lo, width - 2))
            hi = min(width, lo + 2)
        micro.append(MicroBatch(rows.to(device), lo, hi))
    return StepPlan(batch, micro)


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One step's gradient to form: the model, this rank's trajectories, the objective, and how to run it.

    ``micro_batch_size``: rows per forward (default: all at once). ``ess_ratio``: the global ρ when known,
    else this step's (or the ranks' agreed one with ``collectives``). ``backward``: runs the backward of a
    scalar (default ``Tensor.backward``; ``engine.backward`` under DeepSpeed). ``collectives``: what the ranks
    of a distributed step agree on (:class:`StepCollectives`); ``None`` in a single process. ``full_width``:
    run every micro-batch at the batch's full width, rows unsorted (:func:`plan_step`; for benchmarks).
    """

    model: nn.Module
    batch: TrajectoryTensors
    config: ObjectiveConfig
    micro_batch_size: int | None = None
    ess_ratio: float | None = None
    backward: Backward | None = None
    collectives: StepCollectives | None = None
    memory: MemoryOptions = MemoryOptions()
    full_width: bool = False

    def plan(self) -> StepPlan:
        """The step's micro-batches (:func:`plan_step`)."""
        return plan_step(self.batch, self.micro_batch_size, self.collectives, self.full_width)

    def run_backward(self, loss: Tensor) -> None:
        (self.backward or Tensor.backward)(loss)


def backward(step: StepInputs) -> dict[str, float]:
    """The step's gradient by the right path for its objective: the norm pass for an objective that needs
    gradient norms (vcpo) without PPO clipping, autograd otherwise."""
    config = step.config
    plan = step.plan()
    if config.spec.needs_sq_grad_norms and config.ppo_clip == 0:
        return _vcpo_backward(step, plan)
    norms = None
    if config.spec.needs_sq_grad_norms:  # with PPO clipping: the norm pass's norms, then the per-token loss
        chunks = head_chunks(plan, step.memory, step.collectives)
        norms = plan.gather([n for n, _ in _streaming_norms(step.model, plan, plan.rows(), chunks)])
    return _policy_gradient_backward(step, plan, norms)


def vcpo_backward(step: StepInputs) -> dict[str, float]:
    """Accumulate the VCPO gradient of ``step.batch`` into ``.grad`` by the norm pass; return the metrics.

    ``memory.mode == "saved"``: one backward for the whole step (``step.backward``) hands every parameter its
    gradient from the saved activations of all micro-batches. ``"recompute"``: the streaming norm pass per
    micro-batch, then per micro-batch an ordinary forward and backward of ``Σ_i c_i Σ_t m_it log π_it``: the
    same gradient.
    """
    config = step.config
    if not config.spec.needs_sq_grad_norms or config.ppo_clip > 0:
        raise ValueError(
            f"vcpo_backward needs an objective weighted by gradient norms (vcpo) without PPO clipping, got "
            f"{config.objective!r} with ppo_clip={config.ppo_clip}; use policy_gradient_backward"
        )
    return _vcpo_backward(step, step.plan())


def _vcpo_backward(step: StepInputs, plan: StepPlan) -> dict[str, float]:
    if step.memory.mode == "recompute":
        return _vcpo_recompute(step, plan)
    passes = [norm_pass(step.model, *_ids(rows), rows.response_mask) for rows in plan.rows()]
    try:
        coefficients, metrics = _step_coefficients(
            step,
            plan.gather([p.token_logprobs for p in passes]),
            plan.gather([p.sq_grad_norms for p in passes]),
        )
        accumulate_weighted_gradients(passes, plan.split(coefficients), step.backward)
    finally:
        for p in passes:
            p.release()
    return metrics


def policy_gradient_backward(step: StepInputs, sq_grad_norms: Tensor | None = None) -> dict[str, float]:
    """Accumulate the gradient of any objective by ordinary forward/backward per micro-batch.

    The objective's statistics (baselines, ESS) need the whole step, so log-probs are first computed without
    a graph for all rows, then each micro-batch is re-run with one and weighted by the whole-step values.
    With one micro-batch (the default) the first pass is skipped. ``sq_grad_norms``: every row's (in the
    batch's row order), for an objective that needs them.
    """
    if step.config.spec.needs_sq_grad_norms and sq_grad_norms is None:
        raise ValueError(
            f"objective {step.config.objective!r} needs per-trajectory gradient norms: "
            "use vcpo_backward or backward"
        )
    return _policy_gradient_backward(step, step.plan(), sq_grad_norms)


def _policy_gradient_backward(
    step: StepInputs, plan: StepPlan, sq_grad_norms: Tensor | None
) -> dict[str, float]:
    model, batch, config, collectives = step.model, step.batch, step.config, step.collectives
    chunks = head_chunks(plan, step.memory, collectives)
    rows = plan.rows()

    def objective(logprobs: Tensor, rho: float | None) -> tuple[Tensor, dict[str, float]]:
        policy = _policy(batch, logprobs, sq_grad_norms)
        if collectives is not None and rho is None:
            rho = collectives.ess_ratio(valid_log_weights(policy, config))
        return policy_loss(policy, config, rho)

    if len(rows) == 1:
        plan.replay_masks(0)
        live = token_logprobs(model, *_ids(rows[0]), chunks[0])
        loss, metrics = objective(plan.gather([live]), step.ess_ratio)
        scale = _scale(step, metrics)
        step.run_backward(loss * scale)
        return metrics
    with torch.no_grad():
        passes = []
        for i, (r, n) in enumerate(zip(rows, chunks, strict=True)):
            plan.replay_masks(i)
            passes.append(token_logprobs(model, *_ids(r), n))
        detached = plan.gather(passes)
    _, metrics = objective(detached, step.ess_ratio)
    scale = _scale(step, metrics)
    rho = metrics["ess_ratio"] if step.ess_ratio is None else step.ess_ratio
    # every micro-batch's loss is the whole-step loss restricted to its rows, with the whole-step statistics:
    # run the full-batch loss with the graph only through this micro-batch's log-probs
    for i, (r, m, n) in enumerate(zip(rows, plan.micro, chunks, strict=True)):
        plan.replay_masks(i)
        live = token_logprobs(model, *_ids(r), n)
        if not len(
            m.index
        ):  # a padding micro-batch: zero gradient, but the same collectives as the other ranks
            step.run_backward(live.sum() * 0.0)
            continue
        loss, _ = objective(detached.index_put((m.index,), plan.widen(m, live)), rho)
        step.run_backward(loss * scale)
    return metrics


def _vcpo_recompute(step: StepInputs, plan: StepPlan) -> dict[str, float]:
    """VCPO with memory bounded by one micro-batch: norms first, then one weighted pass per micro-batch."""
    chunks = head_chunks(plan, step.memory, step.collectives)
    rows = plan.rows()
    streamed = _streaming_norms(step.model, plan, rows, chunks)
    logprobs, norms = plan.gather([lp for _, lp in streamed]), plan.gather([n for n, _ in streamed])
    coefficients, metrics = _step_coefficients(step, logprobs, norms)
    # a padding micro-batch weighs its row by 0: no gradient, the same collectives as its peers
    for i, (r, c, n) in enumerate(zip(rows, plan.split(coefficients), chunks, strict=True)):
        plan.replay_masks(i)
        logp = token_logprobs(step.model, *_ids(r), n)
        terms = torch.where(r.response_mask.bool(), logp, torch.zeros_like(logp)).sum(1)
        step.run_backward((c.to(terms.dtype) * terms).sum())
    return metrics


def _step_coefficients(
    step: StepInputs, logprobs: Tensor, sq_grad_norms: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """The step's per-trajectory coefficients (global ρ when distributed, scaled to this rank's share of the
    global loss) and its metrics, from the norm passes' log-probs and norms of all rows (the batch's order)."""
    policy = _policy(step.batch, logprobs, sq_grad_norms)
    ess_ratio = step.ess_ratio
    if step.collectives is not None:
        ess_ratio = step.collectives.ess_ratio(valid_log_weights(policy, step.config))
    coefficients, metrics = trajectory_coefficients(policy, step.config, ess_ratio)
    return coefficients * _scale(step, metrics), metrics


def _streaming_norms(
    model: nn.Module, plan: StepPlan, rows: list[TrajectoryTensors], chunks: list[int]
) -> list[tuple[Tensor, Tensor]]:
    """``(sq_grad_norms, token_logprobs)`` of every micro-batch, keeping no activations."""
    out = []
    for i, (r, n) in enumerate(zip(rows, chunks, strict=True)):
        plan.replay_masks(i)
        out.append(streaming_norm_pass(model, *_ids(r), r.response_mask, n))
    return out


def head_chunks(
    plan: StepPlan, memory: MemoryOptions, collectives: StepCollectives | None = None
) -> list[int]:
    """Per micro-batch, the slices its output head runs in (0: unchunked), from its own width; agreed over
    ranks when distributed."""
    if memory.logit_chunk_tokens == 0:
        return [0] * len(plan.micro)
    local = [chunk_count(m.hi - m.lo, memory.logit_chunk_tokens) for m in plan.micro]
    return local if collectives is None else collectives.max_ints(local)


def _scale(step: StepInputs, metrics: dict[str, float]) -> float:
    """This rank's loss factor (1 when not distributed); the metrics' loss is rescaled to match."""
    if step.collectives is None:
        return 1.0
    scale = step.collectives.loss_scale(metrics, step.config.loss_aggregation)
    metrics["loss"] *= scale
    return scale


def step_spans(
    n: int, micro_batch_size: int | None, collectives: StepCollectives | None = None
) -> list[tuple[int, int]]:
    """The step's micro-batches as ``(start, stop)`` row spans: ``micro_batch_size`` rows each, or, in a
    distributed step, the count every rank agrees on with rows spread evenly (a rank with fewer rows than
    micro-batches gets empty spans, run as one padding row)."""
    spans = micro_batches(n, micro_batch_size)
    if collectives is None:
        return spans
    count = collectives.num_micro_batches(len(spans))
    if count == len(spans):
        return spans
    bounds = [n * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


def _padding_row(batch: TrajectoryTensors) -> TrajectoryTensors:
    """One two-token row with nothing to train on: its forward and backward carry no gradient."""
    ids = batch.input_ids[:1, :2].clone()
    zeros = torch.zeros_like(ids)
    return TrajectoryTensors(
        ids,
        torch.ones_like(ids),
        zeros,
        torch.zeros(ids.shape, dtype=batch.behaviour_logprobs.dtype, device=ids.device),
        batch.rewards[:1].clone(),
        batch.group_ids[:1].clone(),
    )


def _ids(batch: TrajectoryTensors) -> tuple[Tensor, Tensor]:
    return batch.input_ids, batch.attention_mask


def _policy(batch: TrajectoryTensors, logprobs: Tensor, sq_grad_norms: Tensor | None) -> PolicyBatch:
    return PolicyBatch(
        logprobs=logprobs,
        behaviour_logprobs=batch.behaviour_logprobs,
        loss_mask=batch.response_mask.bool(),
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        sq_grad_norms=sq_grad_norms,
    )
