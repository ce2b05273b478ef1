"""Agents on a real sampler: the agent API of the sampler service (the session's vLLM engine, Redis, a weight
broker, a learner stand-in), driven by the official ``openai`` client; what reaches the rollouts stream is checked
against Hugging Face's forward of the version that sampled each token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from deploy.ledger import take_ledger
from tests.sampler_helpers import assert_logprobs_match, hf_model, version_weights
from tests.sampler_stack import Stack, rollouts, wait_until

pytestmark = pytest.mark.slow


def context_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j >= 1 under ``model`` (index j - 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_an_agents_episodes_train_on_the_sampled_ids_with_each_versions_log_probs(
    make_stack: Callable[..., Stack],
) -> None:
    stack = make_stack(
        k=3, groups_per_step=1, n=2, weight_update="in_flight", agents={"enabled": True, "port": 0}
    )
    stack.learner.publish(0)
    stack.start()
    service = stack.service
    assert service.agents is not None and '"agents_url"' in service.endpoints.read_text()
    with httpx.Client(
        base_url=service.agents.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=120
    ) as http:
        first, second = http.post("/v1/episodes").json(), http.post("/v1/episodes").json()
        assert first["task_id"] == second["task_id"]

        other = openai.OpenAI(base_url=second["base_url"], api_key=stack.token)
        last_b = other.chat.completions.create(model="policy", messages=second["messages"])

        agent = openai.OpenAI(base_url=first["base_url"], api_key=stack.token)
        messages: list[Any] = list(first["messages"])
        for follow_up in ("and double it", "now add one"):
            reply = agent.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": follow_up}]
            if follow_up == "and double it":  # the policy moves on mid-episode; the group stays within k
                stack.learner.publish(1)
                wait_until(lambda: service.engine.loaded_version == 1, what="version 1 loaded")
        stream = agent.chat.completions.create(model="policy", messages=messages, stream=True)
        last_a = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        assert http.post(f"/v1/episodes/{first['id']}/finish", json={"reward": 1.0}).status_code == 200
        assert http.post(f"/v1/episodes/{second['id']}/finish", json={}).json()["group_complete"]

    (group,) = wait_until(lambda: rollouts(stack), what="the agents' group")
    a, b = group.trajectories
    assert (a.num_turns, b.num_turns) == (3, 1)
    assert (a.text, b.text) == (last_a, last_b.choices[0].message.content)
    assert a.reward.scorer == "agent" and a.reward.value == 1.0 and not b.HasField("reward")
    assert [(s.policy_version) for s in a.version_segments] == [0, 1]
    assert [(s.start_token, s.policy_version) for s in b.version_segments] == [(0, 0)]
    models = {v: hf_model(stack.model_dir, version_weights(stack.model_dir, v)) for v in (0, 1)}
    prompt = list(group.prompt_tokens)
    for trajectory in (a, b):
        tokens, mask = list(trajectory.response_tokens), list(trajectory.loss_mask)
        got = list(trajectory.behaviour_logprobs)
        assert len(tokens) == len(mask) == len(got) and sum(mask) > 0
        assert all(p == 0.0 for p, m in zip(got, mask, strict=True) if not m)
        bounds = [*(s.start_token for s in trajectory.version_segments[1:]), len(tokens)]
        for segment, end in zip(trajectory.version_segments, bounds, strict=True):
            expected = context_logprobs(models[segment.policy_version], prompt + tokens)[len(prompt) - 1 :]
            span = [i for i in range(segment.start_token, end) if mask[i]]
            assert span, f"segment {segment} holds no sampled token"
            assert_logprobs_match([got[i] for i in span], [float(expected[i]) for i in span])
    # the ledger counts the agents' groups apart (raised in the script that wrote the group)
    keys = {name: stack.specs[name].key for name in ("rollouts", "scored")}
    dead = {name: stack.specs[name].dead_letter_key for name in keys}
    ledger = take_ledger(stack.client, keys, dead, None, {}, k=3)
    assert (ledger["agent_groups_produced"], ledger["rollouts_produced"]) == (1, 1)
    metrics = service.registry.exposition().decode()
    assert 'vcpo_agent_episodes_total{event="claimed",replica="sampler-0"} 2.0' in metrics
    assert 'vcpo_agent_turn_seconds_count{replica="sampler-0"} 4.0' in metrics
