"""The sampler service with the real vLLM engine, Redis, weight broker and gRPC: what it writes and when."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from services.common.streams.producer import StreamProducer
from tests.sampler_helpers import assert_logprobs_match, hf_logprobs, hf_model, version_weights
from tests.sampler_stack import Stack, wait_until
from vcpo.v1 import common_pb2, registry_pb2, rollout_pb2

pytestmark = pytest.mark.slow


def check_group(group: rollout_pb2.TrajectoryGroup, model: Any, version: int, n: int) -> None:
    assert group.policy_version_start == group.policy_version_end == version
    assert len(group.trajectories) == n and group.prompt_tokens
    assert group.task.task_id and group.task.reference and group.sampling.n == n
    for traj in group.trajectories:
        tokens = list(traj.response_tokens)
        assert 0 < len(tokens) <= 16 and traj.finish_reason in ("stop", "length")
        assert len(traj.behaviour_logprobs) == len(tokens) == len(traj.loss_mask) and all(traj.loss_mask)
        assert traj.policy_version_start == traj.policy_version_end == version
        assert [(s.start_token, s.policy_version) for s in traj.version_segments] == [(0, version)]
        expected = hf_logprobs(model, list(group.prompt_tokens), tokens)
        assert_logprobs_match(list(traj.behaviour_logprobs), expected)


def test_groups_are_exact_and_the_lag_bound_holds_the_sampler_until_new_weights(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(k=1, groups_per_step=2)
    stack.learner.publish(0)
    stack.start()
    rollouts = stack.specs["rollouts"].key
    # k = 1, 2 groups per step, version 0: (0 + 1 + 1) * 2 = 4 groups may start, no more
    wait_until(lambda: stack.client.xlen(rollouts) >= 4, what="4 groups")
    status = wait_until(
        lambda: (s := stack.status()).state == common_pb2.ServiceStatus.WAITING and s, what="WAITING"
    )
    assert "lag bound reached: 4 groups started, at most 4" in status.detail
    assert "serving version 0" in status.detail and "has not published a newer version" in status.detail
    time.sleep(0.5)
    assert stack.client.xlen(rollouts) == 4
    model0 = hf_model(stack.model_dir, version_weights(stack.model_dir, 0))
    for _, group in [(0, g) for g in stack.learner.step()] + [(1, g) for g in stack.learner.step()]:
        check_group(group, model0, 0, 4)
    # the stand-in published versions 1 and 2: the sampler loads the newest and goes on with it
    groups = stack.learner.step()  # step 2 may train on version-1 or -2 groups only (lag <= 1)
    assert all(2 - g.policy_version_start <= 1 for g in groups)
    model2 = hf_model(stack.model_dir, version_weights(stack.model_dir, 2))
    for group in stack.learner.step():  # step 3: groups started after the sampler loaded version 2
        check_group(group, model2, 2, 4)
    assert not stack.learner.dropped
    assert stack.status().policy_version >= 2
    metrics = stack.service.registry.exposition().decode()
    assert 'vcpo_sampler_policy_version{replica="sampler-0"}' in metrics
    assert (
        "vcpo_sampler_admission_blocked_seconds_total" in metrics
        and "vcpo_sampler_weight_load_seconds" in metrics
    )


def test_bad_tasks_get_clear_errors_are_counted_and_the_sampler_keeps_going(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(k=4, groups_per_step=2, dataset="builtin:arith", max_model_len=128)
    stack.learner.publish(0)
    long_prompt = "12+7= " * 200
    tasks = [
        rollout_pb2.Task(task_id="long", prompt=long_prompt, reference="1"),
        rollout_pb2.Task(task_id="empty", prompt="   ", reference="1"),
        rollout_pb2.Task(task_id="no-such-row", reference="1"),
        rollout_pb2.Task(task_id="env", prompt="hi", environment="calculator"),
        rollout_pb2.Task(task_id="good", prompt="What is 2+2?", reference="4"),
        rollout_pb2.Task(task_id="arith:5"),  # a dataset row by id
    ]
    requests = iter(registry_pb2.SubmitTasksRequest(task=t) for t in tasks)
    reply = stack.registry().SubmitTasks(requests, timeout=10, metadata=stack.auth)
    assert (reply.accepted, reply.rejected) == (2, 4), reply.errors
    assert (
        reply.errors[0].startswith("task #0: task 'long': the prompt is")
        and "max_model_len=128" in reply.errors[0]
    )
    assert reply.errors[0].endswith("[prompt_too_long]")
    assert reply.errors[1].startswith("task #1: task 'empty'") and reply.errors[1].endswith("[empty_prompt]")
    assert "no prompt given and the id is not in the dataset [unknown_task]" in reply.errors[2]
    assert (
        "environment 'calculator' is not registered" in reply.errors[3]
        and "[unknown_environment]" in reply.errors[3]
    )
    # the same bad tasks straight onto the stream (not through the API): the sampler rejects them itself
    StreamProducer(stack.client, stack.specs["tasks"]).put_many([(t, 0) for t in tasks[:4]])
    stack.start()
    produced = wait_until(lambda: stack.client.xlen(stack.specs["rollouts"].key) >= 4, what="groups")
    assert produced
    entries = stack.client.xrange(stack.specs["rollouts"].key)
    task_ids = {rollout_pb2.TrajectoryGroup.FromString(f[b"payload"]).task.task_id for _, f in entries}
    assert {"good", "arith:5"} <= task_ids and not task_ids & {"long", "empty", "no-such-row", "env"}
    arith5 = next(
        rollout_pb2.TrajectoryGroup.FromString(f[b"payload"])
        for _, f in entries
        if rollout_pb2.TrajectoryGroup.FromString(f[b"payload"]).task.task_id == "arith:5"
    )
    assert arith5.task.prompt and arith5.task.reference  # filled in from the dataset
    dead = stack.client.xrange(stack.specs["tasks"].dead_letter_key)
    assert sorted(f[b"dead_kind"].decode() for _, f in dead) == [
        "empty_prompt",
        "prompt_too_long",
        "unknown_environment",
        "unknown_task",
    ]
    metrics = stack.service.registry.exposition().decode()
    for reason in ("prompt_too_long", "empty_prompt", "unknown_task", "unknown_environment"):
        # once at submission, once on the stream
        assert f'vcpo_sampler_task_errors_total{{reason="{reason}",replica="sampler-0"}} 2.0' in metrics
    assert (
        stack.client.xlen(stack.specs["tasks"].key) == 0
    )  # good tasks acknowledged once their group was written
    assert stack.status().figures["task_errors"] == 4


class RunsAhead:
    """The session's in-process engine made to behave like an engine core in another process (vLLM on GPUs):
    each step's tokens reach the sampler one step late, as outputs the core produced ahead of the loop wait
    in its queue; ``quiesce`` hands back what is held. The sampler must take those under the old version."""

    def __init__(self, inner: Any) -> None:
        self.__dict__["inner"] = inner
        self.__dict__["held"] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def step(self) -> list[Any]:
        out, self.__dict__["held"] = self.held, self.inner.step()
        return list(out)

    def has_unfinished(self) -> bool:
        return bool(self.held) or bool(self.inner.has_unfinished())

    def quiesce(self) -> list[Any]:
        out, self.__dict__["held"] = self.held, []
        return list(out)

    def abort(self, request_ids: Any) -> None:
        self.inner.abort(request_ids)
        self.__dict__["held"] = [d for d in self.held if d.request_id not in set(request_ids)]


@pytest.mark.parametrize("runs_ahead", [False, True], ids=["in-process", "core-runs-ahead"])
def test_in_flight_weight_swap_records_the_version_of_every_token(
    make_stack: Callable[..., Stack], vllm_engine: Any, runs_ahead: bool
) -> None:
    engine = RunsAhead(vllm_engine) if runs_ahead else None
    stack = make_stack(k=2, groups_per_step=2, weight_update="in_flight", n=2, max_tokens=96, engine=engine)
    sampler = stack.service.sampler
    stack.learner.publish(0)
    sampler.sync.start()
    try:  # drive the loop by hand, to swap at a known point
        while not (
            sampler.groups
            and all(len(r.tokens) >= 4 for g in sampler.groups.values() for r in g.responses.values())
        ):
            sampler.tick()
        before = {rid: len(r.tokens) for g in sampler.groups.values() for rid, r in g.responses.items()}
        # the groups in flight at the swap; others may have finished already (a response can end early)
        swapping = set(sampler.groups)
        stack.learner.publish(1)
        sampler.sync.poll_now()
        wait_until(
            lambda: sampler.sync.ready() == 1, what="version 1 staged"
        )  # fetched while generation waits
        while swapping & set(sampler.groups):
            sampler.tick()
    finally:
        sampler.shutdown()
    assert sampler.engine.loaded_version == 1
    model0 = hf_model(stack.model_dir, version_weights(stack.model_dir, 0))
    swapped = 0
    for _, fields in stack.client.xrange(stack.specs["rollouts"].key):
        group = rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"])
        if group.group_id not in swapping:
            continue  # emitted before the swap, or started after it
        starts = [t.policy_version_start for t in group.trajectories]
        ends = [t.policy_version_end for t in group.trajectories]
        assert (group.policy_version_start, group.policy_version_end) == (min(starts), max(ends))
        for i, traj in enumerate(group.trajectories):
            segments = [(s.start_token, s.policy_version) for s in traj.version_segments]
            tokens = list(traj.response_tokens)
            if segments == [(0, 0)]:
                continue  # finished before the swap
            rid = f"{group.group_id}/{i}"
            assert len(segments) == 2 and segments[0] == (0, 0) and segments[1][1] == 1
            assert (traj.policy_version_start, traj.policy_version_end) == (0, 1)
            cut = segments[1][0]
            assert before[rid] <= cut < len(tokens)
            # the tokens before the swap were sampled by version 0: their log-probs are version 0's; the
            # first one recorded as version 1's is not (were it version 0's, it was mislabelled)
            expected = hf_logprobs(model0, list(group.prompt_tokens), tokens)
            assert_logprobs_match(list(traj.behaviour_logprobs)[:cut], expected[:cut])
            assert abs(traj.behaviour_logprobs[cut] - float(expected[cut])) > 1e-3
            swapped += 1
    assert swapped >= 2


def test_a_load_that_leaves_the_weights_unknown_gives_up_the_groups_in_flight_and_the_run_goes_on(
    make_stack: Callable[..., Stack],
) -> None:
    """A version whose load fails part-way and cannot be undone (a broadcast version breaking inside the
    engine's workers) leaves the engine on no known version: every group in flight is given up ("weights_lost",
    its task retried), so no token of the mixed model is written, and the sampler goes on (it used to stop on
    the next tokens of those groups). The failure is injected at the weight sync; the rest is real."""
    stack = make_stack(k=2, groups_per_step=2, weight_update="in_flight", n=2, max_tokens=96)
    sampler = stack.service.sampler
    real_apply, failures = sampler.sync.apply, []

    def breaks_part_way(version: int) -> float:
        if version == 1 and not failures:
            failures.append(version)
            sampler.engine.loaded_version = None  # as apply_collective leaves a load that failed part-way
            raise RuntimeError(f"finish_weight_update failed in worker(s) 1 of 2 (version {version})")
        return real_apply(version)

    sampler.sync.apply = breaks_part_way  # type: ignore[method-assign]
    stack.learner.publish(0)
    sampler.sync.start()
    try:
        while not (
            sampler.groups
            and all(len(r.tokens) >= 4 for g in sampler.groups.values() for r in g.responses.values())
        ):
            sampler.tick()
        in_flight, emitted_before = len(sampler.groups), sampler.emitted  # some may have finished already
        stack.learner.publish(1)
        sampler.sync.poll_now()
        wait_until(lambda: sampler.sync.ready() == 1, what="version 1 staged")
        sampler.tick()  # the swap: its load fails part-way
        assert failures == [1] and not sampler.groups
        assert sampler.aborted == {"weights_lost": in_flight}
        while sampler.emitted < emitted_before + 2:  # the aborted requests' last outputs, then version 1
            sampler.tick()
    finally:
        sampler.shutdown()
    assert sampler.engine.loaded_version == 1
    model1 = hf_model(stack.model_dir, version_weights(stack.model_dir, 1))
    written = [
        rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"])
        for _, fields in stack.client.xrange(stack.specs["rollouts"].key)
    ]
    assert len(written) >= emitted_before + 2
    for group in written[:emitted_before]:  # finished before the failed load: version 0's alone
        assert all(t.policy_version_start == t.policy_version_end == 0 for t in group.trajectories)
    for group in written[emitted_before:]:  # every token of every group written since is version 1's
        for traj in group.trajectories:
            assert [(s.start_token, s.policy_version) for s in traj.version_segments] == [(0, 1)]
            expected = hf_logprobs(model1, list(group.prompt_tokens), list(traj.response_tokens))
            assert_logprobs_match(list(traj.behaviour_logprobs), expected)
