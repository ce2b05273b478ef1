"""Tool parsers: where a model's turn ends in a tool call, what that call is, and how the answer is shown to it.

The agent loop checks the text of the turn being generated after every engine step; as soon as the parser
finds a complete call, the turn ends there (the request is stopped, so the model never writes past its own
call) and the call goes to the environment. A turn that ends (end of sequence, stop string, token budget)
without a call is the model's final answer: the episode is over.

    fenced_code   SimpleTIR / ToRL style: a fenced Python block is run, its output comes back fenced as output
                      ```python\\nprint(2 + 3)\\n```   ─► Action(tool_name="python", arguments_json={"code": ...})
                      observation ─► "\\n```output\\n5\\n```\\n"
    json          Hermes / Qwen style: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                      observation ─► "\\n<tool_response>\\n...\\n</tool_response>\\n"
    turn          every turn is an action (text games, chat environments): the turn ends where the model
                  stops, and the whole turn's text is the action (tool_name "")

What it decides: a malformed call (``<tool_call>`` with JSON that does not parse) is still a call: it goes to
the environment with the raw text and ``arguments_json`` left empty, so the environment's answer can tell the
model what was wrong; the loop never silently ignores what the model meant as a call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable

from vcpo.v1 import environment_pb2


class ToolParser(ABC):
    name: str
    # Whether a turn that ends without a call still is an action (``turn``: every turn is one).
    every_turn_is_an_action: bool = False

    @abstractmethod
    def find_call(self, turn_text: str) -> environment_pb2.Action | None:
        """The first complete tool call in the text of one turn, or None if there is none (yet)."""

    @abstractmethod
    def format_observation(self, text: str) -> str:
        """The text appended to the conversation for an environment's observation."""


class FencedCodeParser(ToolParser):
    name = "fenced_code"
    _block = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

    def find_call(self, turn_text: str) -> environment_pb2.Action | None:
        match = self._block.search(turn_text)
        if match is None:
            return None
        return environment_pb2.Action(
            text=turn_text[: match.end()],
            tool_name="python",
            arguments_json=json.dumps({"code": match.group(1)}),
        )

    def format_observation(self, text: str) -> str:
        return f"\n```output\n{text}\n```\n"


class JsonToolCallParser(ToolParser):
    name = "json"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def find_call(self, turn_text: str) -> environment_pb2.Action | None:
        match = self._call.search(turn_text)
        if match is None:
            return None
        action = environment_pb2.Action(text=turn_text[: match.end()])
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return action  # malformed: the environment sees the raw text and can say what was wrong
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            action.tool_name = call["name"]
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # some models emit the arguments as a JSON string
                action.arguments_json = arguments
            else:
                action.arguments_json = json.dumps(arguments)
        return action

    def format_observation(self, text: str) -> str:
        return f"\n<tool_response>\n{text}\n</tool_response>\n"


class TurnParser(ToolParser):
    name = "turn"
    every_turn_is_an_action = True

    def find_call(self, turn_text: str) -> environment_pb2.Action | None:
        return None  # a turn is an action only once it has ended (see every_turn_is_an_action)

    def format_observation(self, text: str) -> str:
        return f"\n{text}\n"


PARSERS: dict[str, Callable[[], ToolParser]] = {
    p.name: p for p in (FencedCodeParser, JsonToolCallParser, TurnParser)
}
DEFAULT_PARSER = FencedCodeParser.name


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name or DEFAULT_PARSER]()
    except KeyError:
        raise ValueError(f"unknown tool_parser {name!r}; one of {sorted(PARSERS)}") from None
