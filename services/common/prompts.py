"""Prompt encoding: a Task's conversation through the tokenizer's chat template, within the engine's length.

    PromptEncoder.encode(task) ─► prompt token ids (chat template) ── or TaskError(reason)

The sampler, the evaluator and the learner's warm start encode prompts with this one class, so the tokens the
warm start trains on are the tokens the sampler samples from.

- A task that cannot be sampled raises :class:`TaskError`, whose ``reason`` is a short, bounded label for a
  metric (``empty_prompt``, ``prompt_too_long``, ...) and whose message names the task.
- A prompt is rejected only when it leaves no room for a single response token; a long prompt that leaves
  fewer than ``max_tokens`` is sampled with :meth:`PromptEncoder.response_budget` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from vcpo.v1 import rollout_pb2

TASK_ERROR_REASONS = (
    "empty_prompt",
    "prompt_too_long",
    "unknown_task",
    "unknown_environment",
    "bad_row",
    "bad_payload",
    "environment_failed",
    "bad_split",
    "unknown_scorer",
    "environment_draining",
)
"""The ``reason`` labels :class:`TaskError` is raised with (bounded, so they can label a metric)."""


class TaskError(ValueError):
    """A task that cannot be sampled; ``reason`` is a short metric label, ``str(exc)`` names the task."""

    def __init__(self, reason: str, task_id: str, message: str) -> None:
        super().__init__(f"task {task_id!r}: {message}")
        self.reason = reason
        self.task_id = task_id
        self.message = message

    def __reduce__(self) -> tuple[type[TaskError], tuple[str, str, str]]:
        # The default reduce would call TaskError(str(self)): keep the three fields across copies and Ray.
        return (type(self), (self.reason, self.task_id, self.message))


class ChatTokenizer(Protocol):
    """What :class:`PromptEncoder` needs of a tokenizer (a transformers tokenizer has it)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> Any: ...


class PromptEncoder:
    """Turns a Task into prompt token ids with the tokenizer's chat template, within the engine's length."""

    def __init__(
        self, tokenizer: ChatTokenizer, max_model_len: int, max_tokens: int, system_prompt: str = ""
    ) -> None:
        if max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and a response token), got {max_model_len}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.system_prompt = system_prompt

    def messages(self, task: rollout_pb2.Task) -> list[dict[str, str]]:
        """The conversation to template: ``task.messages``, else the system prompt (if any) and the prompt."""
        if task.messages:
            return [{"role": m.role, "content": m.content} for m in task.messages]
        if not task.prompt.strip():
            raise TaskError("empty_prompt", task.task_id, "the prompt is empty and there are no messages")
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out.append({"role": "user", "content": task.prompt})
        return out

    def encode(self, task: rollout_pb2.Task, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids, with the generation prompt; TaskError if empty or too long for one response token.
        ``tools`` (JSON schemas of an environment's tools) go to the chat template, which describes them to
        the model in its own format (a template without tool support leaves them out)."""
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        result = self.tokenizer.apply_chat_template(
            self.messages(task), tokenize=True, add_generation_prompt=True, **kwargs
        )
        tokens = token_ids(result)
        if len(tokens) + 1 > self.max_model_len:
            raise TaskError(
                "prompt_too_long",
                task.task_id,
                f"the prompt is {len(tokens)} tokens; max_model_len={self.max_model_len} leaves no room "
                "for a response token",
            )
        return tokens

    def response_budget(self, prompt_len: int) -> int:
        """Tokens a response to a prompt of ``prompt_len`` tokens may have: ``max_tokens`` or what fits."""
        return max(0, min(self.max_tokens, self.max_model_len - prompt_len))


def token_ids(result: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` output as a plain list of ints.

    transformers 5 returns a BatchEncoding (``input_ids`` and ``attention_mask``); older versions and
    ``return_dict=False`` a list; with ``return_tensors`` a (1, n) tensor.
    """
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        if len(result) != 1:
            raise ValueError(f"apply_chat_template returned a batch of {len(result)} prompts, expected one")
        result = result[0]
    return [int(t) for t in result]
