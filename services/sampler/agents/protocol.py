"""What the agent API reads and answers with, apart from the app: OpenAI-style errors, the parameters it refuses,
tool calls read by a vLLM tool parser, request bodies, and waiting for the loop while watching the client."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from typing import Any

from fastapi import Request

from services.sampler.agents.commands import AgentError, TurnResult
from services.sampler.agents.tokens import Message

TEXT_UNSUPPORTED = {
    "echo": "the prompt is the agent's own",
    "suffix": "insertion is not sampling a continuation",
    "best_of": "it samples several completions and returns one",
}
UNSUPPORTED = {
    "logprobs": "log-probs are recorded for training, not returned",
    "response_format": "structured outputs would change the behaviour policy's distribution",
    "use_beam_search": "beam search is not sampling from the policy",
}


class Forward(Exception):
    """Raised by the routing dependency: the request belongs to replica ``owner``."""

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.owner = owner


def error_body(error: AgentError) -> dict[str, Any]:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


class ToolCalls:
    """Reads tool calls out of an answer's text with a vLLM tool parser (``name``: its registered name)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        try:
            self.parser = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(
                f"agents.tool_parser = {name!r} is not a vLLM tool parser; known: {known}"
            ) from None
        self.tokenizer = tokenizer

    def message(self, text: str, request: Any) -> Message:
        parser = self.parser(self.tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return {"role": "assistant", "content": text}
        calls = [call.model_dump(exclude_none=True) for call in info.tool_calls]
        return {"role": "assistant", "content": info.content or None, "tool_calls": calls}


def usage_of(result: TurnResult, usage: Any) -> Any:
    return usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AgentError(400, "invalid_json", f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise AgentError(400, "invalid_json", "the request body must be a JSON object")
    return body


GONE: Any = object()


async def unless_gone(request: Request, future: Future[Any]) -> Any:
    """``future``'s result, or :data:`GONE` once the client has disconnected (``future`` is then cancelled if
    the loop has not taken it up yet)."""
    wrapped = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({wrapped}, timeout=0.5)
        if done:
            return wrapped.result()
        if await request.is_disconnected():
            wrapped.cancel()
            return GONE


def describe(errors: Any) -> str:
    parts = []
    for e in list(errors)[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"
