"""Sampling from a Hugging Face policy in-process, and its mean reward as RL would see it.

Used to judge a warm start (``--eval-prompts`` of ``python -m services.learner.warm_start``), by the warm-start
benchmark and by the replay experiment, all without a vLLM engine.

- :func:`sample_responses`: responses sampled at the RL temperature (plain softmax sampling, no top-k/top-p),
  cut at the stop token the sampler stops on (kept, as vLLM keeps the EOS).
- :func:`policy_reward` / :func:`sampled_reward`: prompts encoded as the sampler encodes them, responses
  decoded with special tokens skipped (as the sampler decodes) and scored by the reward scorer registry
  (:mod:`services.reward.scorers`, the reward service's public scoring library).

Torch and transformers are imported inside the functions so importing this module stays cheap.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.learner.warm_start import pad_token_id, stop_token_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from vcpo.v1 import rollout_pb2


def sample_responses(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    n: int,
    max_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[list[int]]]:
    """``n`` responses to each prompt, sampled from softmax(logits / temperature) (0: greedy), no top-k/top-p.

    A response ends with the first stop token (kept, as vLLM keeps the EOS) or after ``max_tokens`` tokens.
    Prompts of equal length are batched together with a KV cache, so no padding enters the attention.
    """
    import torch

    if n < 1 or max_tokens < 1:
        raise ValueError(
            f"sample_responses: n and max_tokens must be >= 1, got n={n} max_tokens={max_tokens}"
        )
    if temperature < 0:
        raise ValueError(f"sample_responses: temperature must be >= 0, got {temperature}")
    out: list[list[list[int]]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    with torch.inference_mode():
        for indices in by_length.values():
            rows = [i for i in indices for _ in range(n)]
            ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long)
            tokens = torch.full((len(rows), max_tokens), pad_id, dtype=torch.long)
            done = torch.zeros(len(rows), dtype=torch.bool)
            lengths = torch.full((len(rows),), max_tokens, dtype=torch.long)
            cache = None
            for t in range(max_tokens):
                result = model(input_ids=ids, past_key_values=cache, use_cache=True)
                cache = result.past_key_values
                logits = result.logits[:, -1].float()
                if temperature == 0:
                    token = logits.argmax(dim=-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                token = torch.where(done, torch.full_like(token, pad_id), token)
                tokens[:, t] = token
                stopped = ~done & torch.isin(token, stops)
                lengths = torch.where(stopped, torch.full_like(lengths, t + 1), lengths)
                done |= stopped
                if bool(done.all()):
                    break
                ids = token[:, None]
            for row, i in enumerate(rows):
                out[i].append(tokens[row, : int(lengths[row])].tolist())
    return out


def sampled_reward(
    model_dir: str | os.PathLike[str],
    dataset: str,
    *,
    n_prompts: int,
    n_samples: int,
    temperature: float = 1.0,
    max_tokens: int = 32,
    seed: int = 0,
    split: str = "train",
    system_prompt: str = "",
    max_model_len: int = 256,
    scorer: str = "math",
) -> float:
    """Mean reward of ``n_samples`` sampled responses to each of ``n_prompts`` tasks of a split.

    The tasks are the first ``n_prompts`` in a ``random.Random(seed)`` order of the split (builtin datasets
    are generated with ``seed`` too); see :func:`policy_reward` for how responses are sampled and scored.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.datasets import load_dataset

    if n_prompts < 1:
        raise ValueError(f"sampled_reward: n_prompts must be >= 1, got {n_prompts}")
    tasks = load_dataset(dataset, split=split, seed=seed)
    if not tasks:
        raise ValueError(f"sampled_reward: dataset {dataset!r} split {split!r} is empty")
    random.Random(seed).shuffle(tasks)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return policy_reward(
        model,
        tokenizer,
        tasks[:n_prompts],
        n_samples=n_samples,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        system_prompt=system_prompt,
        max_model_len=max_model_len,
        scorer=scorer,
    )


def policy_reward(
    model: PreTrainedModel,
    tokenizer: Any,
    tasks: Sequence[rollout_pb2.Task],
    *,
    n_samples: int,
    temperature: float = 1.0,
    max_tokens: int = 32,
    seed: int = 0,
    system_prompt: str = "",
    max_model_len: int = 256,
    scorer: str = "math",
) -> float:
    """Mean reward of ``n_samples`` responses to each task, sampled as RL samples them.

    Prompts are encoded by :class:`PromptEncoder`; responses are sampled by :func:`sample_responses` with a
    ``torch.Generator`` seeded with ``seed``, decoded with special tokens skipped (as the sampler decodes)
    and scored by the reward service's scorer named ``scorer``.
    """
    import torch

    from services.common.prompts import PromptEncoder
    from services.reward.scorers import ScoreInput, get_scorer

    if not tasks or n_samples < 1:
        raise ValueError(
            f"policy_reward: needs tasks and n_samples >= 1, got {len(tasks)} tasks, {n_samples}"
        )
    score = get_scorer(scorer)
    encoder = PromptEncoder(tokenizer, max_model_len, max_tokens, system_prompt=system_prompt)
    responses = sample_responses(
        model,
        [encoder.encode(task) for task in tasks],
        n=n_samples,
        max_tokens=max_tokens,
        stop_ids=stop_token_ids(tokenizer, model.generation_config),
        pad_id=pad_token_id(tokenizer),
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )
    rewards = [
        score(ScoreInput(tokenizer.decode(r, skip_special_tokens=True), task.reference, task.task_id)).value
        for task, group in zip(tasks, responses, strict=True)
        for r in group
    ]
    return sum(rewards) / len(rewards)
