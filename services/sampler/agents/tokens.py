"""Token fidelity for agent episodes: which token ids each turn's prompt is, and which of them are trained.

An agent sends the whole conversation on every call, as text. What trains must be the ids the model sampled,
so a turn's prompt is built from the episode's own ids, never from a re-tokenisation of returned text:

    S     the episode's context: the previous turn's prompt ids + its sampled ids (the EOS id included when it
          stopped on EOS)
    L     the episode's log: its messages up to and including the last answer, as returned
    M     the request's messages: L repeated (compared canonically: :func:`extension`), then new tool or user
          messages
    R(x, gen)   the chat template's text for x (same tools), with or without the generation prompt

- **splice** (the default): if ``R(L, False)`` is a prefix of ``R(L + new, True)``, the template only
  appended, and the prompt is ``S + encode(glue + tail)``: ``tail`` is the appended text and ``glue`` what the
  template writes after an answer's content (``"<|im_end|>\\n"`` for Qwen), found once per template by
  rendering a probe answer. When ``S`` ends on the special token the glue starts with (the turn stopped on
  EOS), that token is not written twice. The ids after ``S`` are masked out of the loss, as observations of
  multi-turn episodes are (``services/sampler/agent.py``).
- **prefix break**: otherwise the template re-renders earlier turns (the Qwen3 family drops the ``<think>``
  of answers before the last user message, so a new *user* message re-renders; a tool result does not). The
  prompt is then ``encode(R(M, True))`` with reason ``template_rerender``; a request whose ``tools`` differ
  from the episode's is a break too (``tools_changed``): the template renders them ahead of every message.
  Those templates also give the *last* answer an empty ``<think></think>`` when it has no reasoning, so an
  answer without a think block (thinking off) re-renders on every turn, a tool result included.
- **completions** (``/completions``, text prompts): a prompt that starts with the previous prompt and its
  completion is the episode's ids followed by the ids of the rest; any other is a break (``token_mismatch``).
- **template** (opt-in): the prompt is always ``encode(R(M, True))``, what vLLM's own server would show; the
  turn is a break (``token_mismatch``) whenever it does not start with ``S``.
- At a break the episode **restarts** (:meth:`EpisodeTokens.begin_turn`): its sampled ids so far become
  untrained context inside the new prompt, so every trained id is scored in the context it was sampled in.
- The episodes of one group may start from different prompts (an agent adds a system prompt or tools):
  :func:`group_prompt` makes the group's ``prompt_tokens`` their longest common prefix and prepends each
  episode's rest to its response, masked.

Rendering is the tokenizer's own ``apply_chat_template`` (transformers) with ``tokenize=False``, then
``encode(text, add_special_tokens=False)``: one text function gives both the first prompt and the tails, and
for the first prompt it equals ``apply_chat_template(tokenize=True)`` (what :class:`PromptEncoder` gives
in-process episodes). vLLM's ``safe_apply_chat_template`` (``vllm.renderers.hf``) is this same call behind a
template lookup that needs an engine's ``ModelConfig`` (and importing vLLM costs seconds); what it adds
(``developer`` roles as ``system``, unknown template kwargs dropped, template errors as 400s) belongs to the
request layer, not to this rule. :func:`template_message` applies the normalisation of vLLM's
``parse_chat_messages`` that templates depend on (text parts joined, tool-call ``arguments`` as objects).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.sampler.groups import Response

Message = dict[str, Any]

PREFIX_MODES = ("splice", "template")
BREAK_REASONS = ("template_rerender", "tools_changed", "token_mismatch")
"""The ``reason`` of a prefix break (bounded: it labels ``vcpo_agent_prefix_breaks_total``)."""

# Fields OpenAI SDKs add to an assistant message they echo back; no chat template reads them.
_SDK_ECHO_KEYS = frozenset({"refusal", "annotations", "audio", "function_call"})
_PROBE = "\u00a7probe-answer\u00a7"  # text no template writes by itself: finds where an answer's content ends


class TemplateTokenizer(Protocol):
    """What the rule needs of a tokenizer (a transformers tokenizer has it)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> Any: ...

    @property
    def all_special_ids(self) -> list[int]: ...


class MessageError(ValueError):
    """A request's messages that cannot be used; ``index`` is the first offending message, ``code`` the
    OpenAI-style error code, ``param`` the request field to name."""

    code = "invalid_messages"

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"messages[{index}]: {message}")
        self.index = index
        self.param = f"messages[{index}]"


class MessagesDoNotExtend(MessageError):
    """The request's messages do not repeat the episode's conversation before adding to it."""

    code = "messages_do_not_extend"


# ---------------------------------------------------------------------------------------------- messages
def content_text(content: Any) -> Any:
    """A message's content as templates take it: ``None`` is ``""``, a list of text parts is their texts
    joined by newlines (vLLM's "string" content format); anything else is left as given."""
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, str) or (isinstance(p, Mapping) and p.get("type") == "text") for p in content
    ):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content)
    return content


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as a JSON value (an OpenAI client sends a JSON string; empty means ``{}``)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw  # kept as text: compared as such, and rendered as ``{}`` (vLLM's choice)
    return raw


def _check_shape(message: Any, index: int) -> Mapping[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise MessageError(index, "a message must be an object with a string 'role'")
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list)
        and all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls)
    ):
        raise MessageError(index, "'tool_calls' must be a list of objects with a 'function' object")
    return message


def template_message(message: Mapping[str, Any], index: int = 0) -> Message:
    """A message as chat templates expect it: content as text, tool-call arguments as an object (not the
    JSON string OpenAI clients send), no ``None`` fields and none of the SDKs' echo-only fields."""
    _check_shape(message, index)
    out = {k: v for k, v in message.items() if v is not None and k not in _SDK_ECHO_KEYS}
    out["content"] = content_text(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = []
        for call in calls:
            function = dict(call["function"])
            arguments = _arguments(function.get("arguments"))
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
            out["tool_calls"].append({**call, "type": call.get("type") or "function", "function": function})
    else:
        out.pop("tool_calls", None)
    return out


def _canonical(message: Any, index: int) -> dict[str, Any]:
    """What must match when a client repeats a message: role, name, content as text, and each tool call's
    name and JSON-equal arguments. Ids are left out (the episode renders its own copy of the log, so an id
    a framework rewrote changes no token); so are reasoning fields, which clients drop or keep at will."""
    _check_shape(message, index)
    calls = []
    for call in message.get("tool_calls") or []:
        function = call["function"]
        arguments = _arguments(function.get("arguments"))
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return {
        "role": message["role"],
        "name": message.get("name") or None,
        "content": content_text(message.get("content")),
        "tool_calls": calls,
    }


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def extension(log: Sequence[Mapping[str, Any]], messages: Sequence[Any]) -> list[Message]:
    """The request's messages past the episode's ``log``, after checking the ones before repeat it.

    Raises :class:`MessagesDoNotExtend` naming the first message that does not repeat the log (or the first
    missing one when the request is shorter), and :class:`MessageError` for a malformed message."""
    for i, stored in enumerate(log):
        if i >= len(messages):
            raise MessagesDoNotExtend(
                len(messages),
                f"missing: the episode's conversation has {len(log)} messages through its last answer and "
                f"the request has {len(messages)}; send the whole conversation, then the new messages",
            )
        want, got = _canonical(stored, i), _canonical(messages[i], i)
        for key, value in want.items():
            if got[key] != value:
                raise MessagesDoNotExtend(
                    i,
                    f"{key} {_short(got[key])} differs from the episode's message {i} ({_short(value)}); "
                    "repeat the conversation as it was returned and add new messages only at the end",
                )
    for j in range(len(log), len(messages)):
        _check_shape(messages[j], j)
    return [dict(m) for m in messages[len(log) :]]


def _tools_key(tools: Sequence[Any] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True)


# ---------------------------------------------------------------------------------------------- rendering
class ChatRenderer:
    """A chat as text and ids with the model's chat template (``chat_template`` overrides the tokenizer's;
    ``template_kwargs`` go to every render, e.g. ``enable_thinking``)."""

    def __init__(
        self,
        tokenizer: TemplateTokenizer,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self._glue: str | None = None

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool,
    ) -> str:
        kwargs: dict[str, Any] = dict(self.template_kwargs)
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        if tools:
            kwargs["tools"] = list(tools)
        out = self.tokenizer.apply_chat_template(
            [template_message(m, i) for i, m in enumerate(messages)],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, not text")
        return out

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
        """The prompt ids of a conversation, generation prompt included."""
        return self.encode(self.text(messages, tools, add_generation_prompt=True))

    @property
    def glue(self) -> str:
        """What the template writes after an answer's content, before the next message (probed once)."""
        if self._glue is None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
            rendered = self.text(probe, add_generation_prompt=False)
            if rendered.count(_PROBE) != 1:
                raise ValueError(
                    "the chat template does not write an assistant message's content verbatim, so the splice "
                    "prefix rule cannot tell what follows an answer; use the 'template' prefix mode"
                )
            self._glue = rendered.split(_PROBE, 1)[1]
        return self._glue


# ---------------------------------------------------------------------------------------------- the rule
@dataclass(frozen=True)
class TurnPrompt:
    """One turn's prompt: ``ids`` go to the engine; ``new_ids`` are the ids past the episode's context (all
    of ``ids`` on a first turn or a break), never trained on; ``log`` is the conversation the prompt renders
    (the episode's log, then the request's new messages), to which the answer is appended."""

    ids: list[int]
    new_ids: list[int]
    log: list[Message]
    break_reason: str | None = None


class PrefixRule:
    """Builds each turn's prompt ids by the splice or template rule (module docstring)."""

    def __init__(self, renderer: ChatRenderer, mode: str = "splice") -> None:
        if mode not in PREFIX_MODES:
            raise ValueError(f"prefix mode {mode!r}: expected one of {', '.join(PREFIX_MODES)}")
        self.renderer, self.mode = renderer, mode
        if mode == "splice":
            _ = renderer.glue  # a template the probe cannot read is named now, not on some later turn

    def first_turn(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> TurnPrompt:
        if not messages:
            raise MessageError(0, "missing: a conversation needs at least one message")
        log = extension([], messages)
        ids = self.renderer.ids(log, tools)
        return TurnPrompt(ids, list(ids), log)

    def next_turn(
        self,
        context: Sequence[int],
        log: Sequence[Mapping[str, Any]],
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        log_tools: Sequence[Any] | None = None,
    ) -> TurnPrompt:
        """The prompt of a turn after the first: ``context`` is S, ``log`` and ``log_tools`` the messages and
        tools the episode's previous turn was rendered with (its answer appended), ``messages`` and ``tools``
        the request's. Raises :class:`MessagesDoNotExtend` when ``messages`` does not repeat ``log``."""
        if not context or not log or log[-1].get("role") != "assistant":
            raise ValueError(
                "a next turn needs the episode's context ids and a log ending in its last answer"
            )
        convo = [*(dict(m) for m in log), *extension(log, messages)]
        render = self.renderer
        if self.mode == "template":
            ids = render.ids(messages, tools)
            if ids[: len(context)] == list(context):
                return TurnPrompt(ids, ids[len(context) :], convo)
            return TurnPrompt(ids, list(ids), convo, "token_mismatch")
        if _tools_key(tools) != _tools_key(log_tools):
            ids = render.ids(convo, tools)
            return TurnPrompt(ids, list(ids), convo, "tools_changed")
        head = render.text(log, tools, add_generation_prompt=False)
        full = render.text(convo, tools, add_generation_prompt=True)
        if not full.startswith(head):
            ids = render.encode(full)
            return TurnPrompt(ids, list(ids), convo, "template_rerender")
        new_ids = render.encode(render.glue + full[len(head) :])
        if new_ids and new_ids[0] == context[-1] and new_ids[0] in render.tokenizer.all_special_ids:
            new_ids = new_ids[1:]  # the turn stopped on the token the glue starts with: it is already in S
        return TurnPrompt([*context, *new_ids], new_ids, convo)

    def text_turn(self, context: Sequence[int], transcript: str, prompt: str) -> TurnPrompt:
        """A completions turn: the first prompt is encoded whole (as vLLM's server encodes one); a later
        prompt that starts with ``transcript`` (the previous prompt and its completion, as returned) is
        ``context`` followed by the ids of the rest, any other a break (``token_mismatch``). The log is the
        prompt, to which the completion is appended."""
        log: list[Message] = [{"role": "prompt", "content": prompt}]
        if context and prompt.startswith(transcript):
            new_ids = self.renderer.encode(prompt[len(transcript) :])
            return TurnPrompt([*context, *new_ids], new_ids, log)
        ids = [int(t) for t in self.renderer.tokenizer.encode(prompt)]
        return TurnPrompt(ids, list(ids), log, "token_mismatch" if context else None)


# ---------------------------------------------------------------------------------------------- records
@dataclass
class EpisodeTokens:
    """An episode's ids: ``start`` (its first prompt, or the prompt of its last prefix break), then
    ``response``: the turns' new prompt ids (masked, log-prob 0) and the sampled ids (trained, with their
    behaviour log-probs and versions, recorded by ``response.extend`` as the engine produces them)."""

    start: list[int]
    response: Response
    untrained: int = 0  # sampled ids dropped from training by prefix breaks

    @classmethod
    def first(cls, turn: TurnPrompt, version: int) -> EpisodeTokens:
        return cls(list(turn.ids), Response(version, multi_turn=True))

    @property
    def context(self) -> list[int]:
        """S: every id the episode has read or sampled, in order."""
        return [*self.start, *self.response.tokens]

    def begin_turn(self, turn: TurnPrompt, version: int) -> None:
        """Record a later turn's prompt before its ids go to the engine (``version``: the loaded one)."""
        if turn.break_reason is not None:  # restart: the new prompt is the context the turns are scored in
            self.untrained += sum(self.response.mask)
            self.start, self.response = list(turn.ids), Response(version, multi_turn=True)
            return
        context = self.context
        if turn.ids[: len(context)] != context or turn.ids[len(context) :] != turn.new_ids:
            raise ValueError("the turn's prompt is not the episode's context followed by its new ids")
        self.response.append_observation(list(turn.new_ids))
        self.response.turns += 1


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    if not sequences:
        return []
    first = list(sequences[0])
    n = len(first)
    for seq in sequences[1:]:
        n = min(n, len(seq))
        for i in range(n):
            if seq[i] != first[i]:
                n = i
                break
    return first[:n]


def group_prompt(episodes: Sequence[EpisodeTokens]) -> list[int]:
    """The group's ``prompt_tokens`` when its episodes are done: the longest common prefix of their starts.
    Each episode's rest of its start is prepended to its response (masked), so ``prompt + response`` is
    still its context. An empty common prefix is a ValueError (the learner rejects a group without prompt
    ids); it cannot happen with a template that begins every conversation with the same token."""
    common = common_prefix([e.start for e in episodes])
    if not common:
        raise ValueError("the group's episodes share no prompt token (agent_no_common_prompt)")
    for episode in episodes:
        episode.response.prepend_context(episode.start[len(common) :])
        episode.start = list(common)
    return common
