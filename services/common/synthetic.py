"""Synthetic messages of every stream type, realistic in size and shape (tokens, log-probs, masked tool spans,
version segments), for load generation: the stream benchmark and the tests build their traffic from these."""

from __future__ import annotations

import random
import time

from vcpo.v1 import common_pb2, rollout_pb2, weights_pb2


def make_task(i: int = 0) -> rollout_pb2.Task:
    return rollout_pb2.Task(
        task_id=f"task-{i}",
        environment="python" if i % 2 else "",
        prompt=f"What is {i} + {i + 1}?",
        messages=[common_pb2.ChatMessage(role="user", content=f"What is {i} + {i + 1}?")],
        reference=str(2 * i + 1),
        scorer="math",
        metadata={"source": "unit", "index": str(i)},
        payload_json='{"difficulty": 1}',
        split="train",
    )


def make_group(
    i: int = 0,
    n: int = 8,
    response_len: int = 512,
    prompt_len: int = 128,
    policy_version: int = 3,
    scored: bool = False,
    seed: int = 0,
    vocab: int = 32_000,
) -> rollout_pb2.TrajectoryGroup:
    """A group of ``n`` responses of ``response_len`` tokens with per-token log-probs and a loss mask."""
    rng = random.Random(seed + i)
    trajectories = []
    for j in range(n):
        tokens = [rng.randrange(vocab) for _ in range(response_len)]
        mask = [not (100 <= t < 120) for t in range(response_len)]  # a masked "tool output" span
        logprobs = [-rng.random() * 5 if m else 0.0 for m in mask]
        traj = rollout_pb2.Trajectory(
            response_tokens=tokens,
            behaviour_logprobs=logprobs,
            loss_mask=mask,
            text=f"response {j}",
            finish_reason="stop",
            policy_version_start=policy_version,
            policy_version_end=policy_version + (j % 2),
            version_segments=[
                rollout_pb2.VersionSegment(start_token=0, policy_version=policy_version),
                *(
                    [
                        rollout_pb2.VersionSegment(
                            start_token=response_len // 2, policy_version=policy_version + 1
                        )
                    ]
                    if j % 2
                    else []
                ),
            ],
            num_turns=2,
        )
        if scored:
            traj.reward.CopyFrom(rollout_pb2.Reward(value=float(j % 2), scorer="math", latency_seconds=0.01))
        trajectories.append(traj)
    return rollout_pb2.TrajectoryGroup(
        group_id=f"group-{i}",
        run_id="test",
        task=make_task(i),
        prompt_tokens=[rng.randrange(vocab) for _ in range(prompt_len)],
        trajectories=trajectories,
        policy_version_start=policy_version,
        policy_version_end=policy_version + 1,
        sampling=common_pb2.SamplingParams(
            n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=response_len
        ),
        sampler_id="sampler-0",
        started_unix=time.time(),
        finished_unix=time.time(),
        scored_unix=time.time() if scored else 0.0,
    )


def make_announcement(version: int = 1) -> weights_pb2.WeightAnnouncement:
    tensors = [
        weights_pb2.TensorMeta(
            name="model.embed_tokens.weight",
            dtype="float32",
            shape=[512, 128],
            nbytes=262144,
            checksum="sha256:00",
        ),
        weights_pb2.TensorMeta(
            name="lm_head.weight", dtype="float32", shape=[512, 128], nbytes=262144, checksum="sha256:11"
        ),
    ]
    return weights_pb2.WeightAnnouncement(
        policy_version=version,
        manifest=weights_pb2.VersionManifest(
            policy_version=version, run_id="test", tensors=tensors, total_bytes=524288, checksum="sha256:22"
        ),
        location="127.0.0.1:50052",
        published_unix=time.time(),
    )
