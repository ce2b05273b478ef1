"""What the agent API hands the sampler's loop (:class:`~services.sampler.agents.episodes.EpisodeBook`), the
errors and results it gets back (a command's ``future`` is answered on the loop's thread), and the records the
book keeps of open groups and episodes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from services.sampler.agents.tokens import EpisodeTokens, Message
from services.sampler.engine import Sampling
from services.sampler.groups import Group


class AgentError(Exception):
    """A request the book refuses: ``status`` (HTTP), ``code`` (OpenAI-style ``error.code``), ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


# ---------------------------------------------------------------------------------------------- commands
@dataclass
class Claim:
    deadline: float
    future: Future[dict[str, Any]] = field(default_factory=Future)


@dataclass
class Turn:
    """A chat completion: ``answer`` makes the assistant message of the turn's text (tool calls parsed);
    ``on_text`` gets each new piece of text as it is sampled (streaming)."""

    episode_id: str
    messages: Sequence[Any]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # temperature, top_p, max_tokens, stop, seed: those the request set
    answer: Callable[[str], Message]
    on_text: Callable[[str], None] | None = None
    prompt: str | None = None  # a completions turn's prompt (then ``messages`` is empty)
    future: Future[TurnResult] = field(default_factory=Future)


@dataclass
class Finish:
    episode_id: str
    reward: float | None
    future: Future[dict[str, Any]] = field(default_factory=Future)


@dataclass
class Abandon:
    episode_id: str
    future: Future[dict[str, Any]] = field(default_factory=Future)


@dataclass
class Cancel:
    """The client of the episode's turn went away: roll the turn back (never answered)."""

    episode_id: str
    turn: Turn
    future: Future[dict[str, Any]] = field(default_factory=Future)


Command = Claim | Turn | Finish | Abandon | Cancel


@dataclass(frozen=True)
class TurnResult:
    message: Message  # the assistant message, as returned (and as the next request must repeat it)
    text: str
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    request_id: str = ""  # the engine request of the turn
    engine_seconds: float = 0.0  # from the turn's request to the engine until its last token


# ---------------------------------------------------------------------------------------------- state
@dataclass
class InFlight:
    turn: Turn
    request_id: str
    start: int  # index in the response where the turn's sampled ids begin
    prompt_len: int
    before: tuple[EpisodeTokens | None, list[Message], list[dict[str, Any]] | None, int]  # to roll back
    sent: int = 0  # characters of text streamed
    pieces: list[str] = field(default_factory=list)  # the engine's own text of each delta (stop strings cut)
    raw: bool = False  # some delta came without text: the turn's text is its ids decoded
    added_at: float = field(default_factory=time.monotonic)  # when the turn went to the engine


@dataclass
class Episode:
    id: str
    group: AgentGroup
    claimed: bool = False
    expires_at: float = 0.0
    tokens: EpisodeTokens | None = None
    log: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    turns: int = 0
    turn: InFlight | None = None
    finished: bool = False
    reward: float | None = None
    text: bool = False  # played with completions (text prompts), not chat completions


@dataclass
class AgentGroup:
    group: Group
    messages: list[dict[str, str]]  # the task's prompt as chat messages (what a claim hands out)
    deadline: float  # the latest an unclaimed episode may still be claimed
    episodes: list[Episode] = field(default_factory=list)
    failure: AgentError | None = None  # given up: every later request of its episodes gets this

    @property
    def done(self) -> bool:
        return all(e.finished for e in self.episodes)


def turn_sampling(max_model_len: int, prompt_len: int, default: Sampling, asked: dict[str, Any]) -> Sampling:
    """A turn's sampling: the request's settings over the run's (``default``), ``max_tokens`` within the
    context; 400 ``context_length_exceeded`` naming the limit when the prompt or ``max_tokens`` does not fit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise AgentError(
            400,
            "context_length_exceeded",
            f"the conversation is {prompt_len} tokens; the model's context (sampler.max_model_len) is "
            f"{max_model_len}, which leaves no room for an answer",
            "messages",
        )
    max_tokens = asked.get("max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise AgentError(
            400,
            "context_length_exceeded",
            f"max_tokens = {max_tokens}, but the conversation is {prompt_len} tokens and the model's context "
            f"(sampler.max_model_len) is {max_model_len}: at most {room}",
            "max_tokens",
        )
    values = {key: value for key, value in asked.items() if value is not None}
    values["max_tokens"] = max_tokens or min(default.max_tokens, room)
    return dataclasses.replace(default, **values)


def stopping_error() -> AgentError:
    """What the requests of a stopping sampler replica get (each its own: raised on many threads)."""
    return AgentError(503, "sampler_stopping", "this sampler replica is stopping; its episodes ended")


def stale_error(group: Group, lag: int, k: int) -> AgentError:
    return AgentError(
        409,
        "episode_stale",
        f"the policy moved on: group {group.group_id} started at version {group.version} and the newest is "
        f"{group.version + lag}, more than the run's lag bound k = {k} ahead; the group was given up and its "
        "task retried: claim a new episode",
    )
