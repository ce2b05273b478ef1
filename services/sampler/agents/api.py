"""The agent API: OpenAI-compatible chat completions inside episodes, served by a sampler replica.

    GET  /v1/models                                     the policy being trained
    POST /v1/episodes                                   claim an episode of the next task (its messages, base_url)
    POST /v1/episodes/{id}/v1/chat/completions          a turn (OpenAI's request and answer; stream as SSE)
    POST /v1/episodes/{id}/finish   {"reward": r} | {}  end it (with {}: the task's scorer judges the last answer)
    POST /v1/episodes/{id}/abandon                      give it up (its group is given up, the task retried)

Every route needs the run's API token (``Authorization: Bearer``) and speaks TLS when the sampler's client API
does (``sampler.api_tls``). Requests are parsed with vLLM's own OpenAI protocol models and answers built with
them; tool calls are read out of the model's text by a vLLM tool parser (``agents.tool_parser``). What the
server does with a turn (the episode's token ids, the lag bound, the ends of groups) is
:class:`~services.sampler.agents.episodes.EpisodeBook`'s, on the sampler's loop; this module only waits for
its answers. Errors are OpenAI-style: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Streaming sends the answer's text as it is sampled; with tools, the whole answer (content and tool calls)
comes in one chunk at the turn's end, once the parser has read it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from services.common.tls import ServerTls
from services.sampler.agents.commands import Abandon, AgentError, Cancel, Claim, Finish, Turn, TurnResult
from services.sampler.agents.episodes import EpisodeBook
from services.sampler.agents.protocol import (
    GONE,
    TEXT_UNSUPPORTED,
    UNSUPPORTED,
    Forward,
    ToolCalls,
    describe,
    error_body,
    read_json,
    unless_gone,
    usage_of,
)
from services.sampler.agents.tokens import Message
from services.sampler.metrics import SamplerMetrics

log = logging.getLogger(__name__)


class AgentApi:
    """The FastAPI app on a uvicorn server in a thread of the sampler's process."""

    def __init__(
        self,
        book: EpisodeBook,
        *,
        model: str,
        token: str,
        tokenizer: Any,
        tool_parser: str,
        claim_timeout_s: float,
        metrics: SamplerMetrics | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
        tls: ServerTls | None = None,
        replica: str = "",
        peer: Callable[[str], str | None] | None = None,
    ) -> None:
        """``replica``: this replica's name (what its episode ids start with); ``peer``: another replica's
        agent API URL by its name (None: unknown), for the requests of episodes it holds."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.book, self.model, self.claim_timeout_s, self.metrics = book, model, claim_timeout_s, metrics
        self._request_model = ChatCompletionRequest
        self._token = token.encode()
        self.replica, self.peer = replica, peer
        self._client: Any = None  # the httpx client that passes requests on (made in the server's loop)
        self.tools = ToolCalls(tool_parser, tokenizer) if tool_parser else None
        self.app = self._build()
        tls = tls or ServerTls()
        self.scheme = "https" if tls.enabled else "http"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"the agent API cannot bind {host}:{port} (agents.port): {exc.strerror}") from exc
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            ssl_certfile=tls.cert_file or None,
            ssl_keyfile=tls.key_file or None,
            ssl_ca_certs=tls.client_ca_file or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca_file else ssl.CERT_NONE,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="agent-api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent API did not start on {host}:{self.port}")
            time.sleep(0.01)
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"{self.scheme}://{local}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the app
    def _build(self) -> FastAPI:
        def authenticate(request: Request) -> None:
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
                raise AgentError(
                    401,
                    "invalid_api_key",
                    "missing or wrong API token: send 'Authorization: Bearer <the run's API token>' "
                    "(sampler.api_token, or <run_dir>/api_token)",
                )

        app = FastAPI(
            title="vcpo-rl agent API",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            dependencies=[Depends(authenticate)],
        )

        @app.exception_handler(AgentError)
        async def agent_error(request: Request, exc: AgentError) -> JSONResponse:
            return self._error(exc)

        @app.exception_handler(RequestValidationError)
        async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
            return self._error(AgentError(400, "invalid_request", describe(exc.errors())))

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

            card = ModelCard(id=self.model, owned_by="vcpo-rl", max_model_len=self.book.engine.max_model_len)
            return ModelList(data=[card]).model_dump()

        @app.post("/v1/episodes")
        async def claim(request: Request) -> Any:
            episode = await unless_gone(request, self.book.submit(Claim(time.time() + self.claim_timeout_s)))
            if episode is GONE:
                return {}
            episode["base_url"] = f"{str(request.base_url).rstrip('/')}/v1/episodes/{episode['id']}/v1"
            self._count("claimed")
            return episode

        def route(episode_id: str) -> None:
            """An episode another replica holds: its requests go there (they check the token too)."""
            owner = episode_id.split(".", 1)[0]
            if self.peer is not None and owner != self.replica and owner.startswith("sampler-"):
                raise Forward(owner)

        @app.exception_handler(Forward)
        async def forward(request: Request, exc: Forward) -> Any:
            return await self._forward(exc.owner, request)

        routed = [Depends(route)]

        @app.post("/v1/episodes/{episode_id}/finish", dependencies=routed)
        async def finish(episode_id: str, request: Request) -> dict[str, Any]:
            body = await read_json(request)
            reward = body.get("reward")
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
                raise AgentError(400, "invalid_reward", f"reward must be a number, got {reward!r}", "reward")
            if reward is not None and not float("-inf") < reward < float("inf"):
                raise AgentError(400, "invalid_reward", f"reward must be finite, got {reward!r}", "reward")
            result: dict[str, Any] = await asyncio.wrap_future(
                self.book.submit(Finish(episode_id, None if reward is None else float(reward)))
            )
            self._count("finished")
            return result

        @app.post("/v1/episodes/{episode_id}/abandon", dependencies=routed)
        async def abandon(episode_id: str) -> dict[str, Any]:
            result: dict[str, Any] = await asyncio.wrap_future(self.book.submit(Abandon(episode_id)))
            return result

        @app.post("/v1/episodes/{episode_id}/v1/chat/completions", response_model=None, dependencies=routed)
        async def chat(episode_id: str, request: Request) -> Any:
            return await self._chat(episode_id, request)

        @app.post("/v1/episodes/{episode_id}/v1/completions", response_model=None, dependencies=routed)
        async def completions(episode_id: str, request: Request) -> Any:
            return await self._chat(episode_id, request, text=True)

        return app

    async def _chat(self, episode_id: str, request: Request, text: bool = False) -> Any:
        """A chat completion, or with ``text`` a completion (a text prompt)."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        started = time.monotonic()
        body = await read_json(request)
        try:
            parsed = (CompletionRequest if text else self._request_model).model_validate(body)
        except ValidationError as exc:
            raise AgentError(400, "invalid_request", describe(exc.errors())) from None
        for key, why in {**UNSUPPORTED, **(TEXT_UNSUPPORTED if text else {})}.items():
            if body.get(key):
                raise AgentError(400, "unsupported_parameter", f"{key} is not supported here: {why}", key)
        if (parsed.n or 1) != 1:
            raise AgentError(400, "unsupported_parameter", "n must be 1: an episode is one conversation", "n")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if text and (not isinstance(prompt, str) or not prompt):
            raise AgentError(400, "invalid_prompt", "prompt must be one non-empty string", "prompt")
        tool_choice = getattr(parsed, "tool_choice", None)
        if tool_choice not in (None, "auto", "none"):
            raise AgentError(
                400, "unsupported_parameter", "tool_choice may be 'auto' or 'none' here", "tool_choice"
            )
        tools = None if text or not parsed.tools else [t.model_dump(exclude_none=True) for t in parsed.tools]
        reads_calls = self.tools is not None and bool(tools) and tool_choice != "none"

        def answer(completion: str) -> Message:
            if text:
                return {"role": "completion", "content": completion}
            if reads_calls and self.tools is not None:
                return self.tools.message(completion, parsed)
            return {"role": "assistant", "content": completion}

        stop = parsed.stop if isinstance(parsed.stop, list) else [parsed.stop] if parsed.stop else []
        sampling = {
            "temperature": parsed.temperature,
            "top_p": parsed.top_p,
            "max_tokens": getattr(parsed, "max_completion_tokens", None) or body.get("max_tokens"),
            "stop": tuple(stop) or None,
            "seed": parsed.seed,
        }
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        on_text = None
        if parsed.stream and not reads_calls:

            def on_text(piece: str) -> None:
                loop.call_soon_threadsafe(pieces.put_nowait, piece)

        messages = [] if text else body.get("messages") or []
        turn = Turn(episode_id, messages, tools, sampling, answer, on_text, prompt if text else None)
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            future = asyncio.wrap_future(self.book.submit(turn))
            return StreamingResponse(
                self._stream(episode_id, turn, future, pieces, include_usage, started, text),
                media_type="text/event-stream",
            )
        result = await unless_gone(request, self.book.submit(turn))
        if result is GONE:
            self.book.submit(Cancel(episode_id, turn))  # a turn that began: rolled back
            return {}
        self._observe(started)
        headers = {  # like OpenAI's openai-processing-ms: where a turn's time went
            "x-vcpo-engine-ms": f"{result.engine_seconds * 1000:.1f}",
            "x-vcpo-server-ms": f"{(time.monotonic() - started) * 1000:.1f}",
        }
        reply = self._text_completion(result) if text else self._completion(result)
        return JSONResponse(reply.model_dump(exclude_none=True), headers=headers)

    def _completion(self, result: TurnResult) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        message = ChatMessage.model_validate(result.message)
        choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason=result.finish_reason)
        return ChatCompletionResponse(
            id=f"chatcmpl-{result.request_id}",
            model=self.model,
            choices=[choice],
            usage=usage_of(result, UsageInfo),
        )

    def _text_completion(self, result: TurnResult) -> Any:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        choice = CompletionResponseChoice(index=0, text=result.text, finish_reason=result.finish_reason)
        return CompletionResponse(
            id=f"cmpl-{result.request_id}",
            model=self.model,
            choices=[choice],
            usage=usage_of(result, UsageInfo),
        )

    async def _stream(
        self,
        episode_id: str,
        turn: Turn,
        future: asyncio.Future[TurnResult],
        pieces: asyncio.Queue[str],
        include_usage: bool,
        started: float,
        text: bool,
    ) -> AsyncIterator[str]:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )
        from vllm.entrypoints.openai.completion.protocol import (
            CompletionResponseStreamChoice,
            CompletionStreamResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        chunk_id = f"{'cmpl' if text else 'chatcmpl'}-{episode_id}-{int(time.time() * 1000)}"

        def chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> str:
            if text:
                piece = CompletionResponseStreamChoice(
                    index=0, text=delta.get("content", ""), finish_reason=finish
                )
                body: Any = CompletionStreamResponse(
                    id=chunk_id, model=self.model, choices=[] if usage else [piece], usage=usage
                )
                return f"data: {body.model_dump_json(exclude_none=True)}\n\n"
            choices = (
                []
                if usage
                else [
                    ChatCompletionResponseStreamChoice.model_validate(
                        {"index": 0, "delta": delta, "finish_reason": finish}
                    )
                ]
            )
            body = ChatCompletionStreamResponse(id=chunk_id, model=self.model, choices=choices, usage=usage)
            return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

        done = False
        try:
            if not text:
                yield chunk({"role": "assistant", "content": ""})
            while not future.done() or not pieces.empty():
                getter = asyncio.ensure_future(pieces.get())
                either: set[asyncio.Future[Any]] = {getter, future}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield chunk({"content": getter.result()})
                else:
                    getter.cancel()
            done = True
            try:
                result = future.result()
            except AgentError as exc:
                yield f"data: {json.dumps(error_body(exc))}\n\n"
                yield "data: [DONE]\n\n"
                return
            if turn.on_text is None:  # the whole answer at once (its tool calls parsed)
                message = {k: v for k, v in result.message.items() if k != "role"}
                calls = [{"index": i, **call} for i, call in enumerate(message.pop("tool_calls", []) or [])]
                yield chunk({**message, "tool_calls": calls} if calls else message)
            yield chunk({}, result.finish_reason)
            if include_usage:
                yield chunk({}, usage=usage_of(result, UsageInfo))
            yield "data: [DONE]\n\n"
            self._observe(started)
        finally:
            if not done:  # the client went away mid-turn
                self.book.submit(Cancel(episode_id, turn))

    async def _forward(self, owner: str, request: Request) -> Any:
        import httpx

        assert self.peer is not None
        url = await asyncio.to_thread(self.peer, owner)
        if not url:
            return self._error(
                AgentError(
                    404, "episode_lost", f"no sampler replica {owner!r} serves the agent API in this run"
                )
            )
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None, verify=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        upstream = self._client.build_request(
            request.method, url + request.url.path, headers=headers, content=await request.body()
        )
        try:
            reply = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return self._error(
                AgentError(503, "replica_unreachable", f"sampler replica {owner!r} at {url}: {exc}")
            )
        passed = {
            k: v for k, v in reply.headers.items() if k.lower() in ("content-type",) or k.startswith("x-vcpo")
        }
        return StreamingResponse(
            reply.aiter_raw(),
            status_code=reply.status_code,
            headers=passed,
            background=BackgroundTask(reply.aclose),
        )

    # ------------------------------------------------------------------ helpers
    def _error(self, error: AgentError) -> JSONResponse:
        if self.metrics is not None:
            self.metrics.agent_errors.labels(self.metrics.replica, error.code).inc()
        return JSONResponse(error_body(error), status_code=error.status)

    def _count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.agent_episodes.labels(self.metrics.replica, event).inc()

    def _observe(self, started: float) -> None:
        if self.metrics is not None:
            self.metrics.agent_turn.labels(self.metrics.replica).observe(time.monotonic() - started)
