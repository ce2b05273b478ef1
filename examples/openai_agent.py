"""A tool-using agent written with the official ``openai`` client, whose episodes train the policy of a running
system through its agent API (docs/guides/agents.md).

    make run RUN_ARGS="--set agents.enabled=true" &     # the local run, serving the agent API
    python examples/openai_agent.py --episodes 16       # finds runs/local/agents.json and the API token

Each episode: claim one (``POST /v1/episodes``: the task's messages and the episode's ``base_url``), talk to the
model through ``base_url`` as to any OpenAI endpoint, run the calculator whenever it calls it, and finish the
episode (``POST .../finish`` with ``{}``: the task's scorer judges the last answer). Any agent framework that
takes an OpenAI ``base_url`` can run inside an episode the same way.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses) and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (2 + 3) * 4"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "Use the calculator tool for arithmetic, then give the final answer as a number."
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error message the model can read."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))  # type: ignore[operator]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))  # type: ignore[operator]
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result) if float(result).is_integer() else result)


def connection(args: argparse.Namespace) -> tuple[str, str]:
    """The agent API's base URL and token: from the flags, else from the run's agents.json."""
    base_url, token_file = args.base_url, args.token_file
    if not base_url or not token_file:
        path = Path(args.run_dir) / "agents.json"
        if not path.exists():
            sys.exit(
                f"{path} not found: start a run with [agents] enabled = true, or pass --base-url and --token-file"
            )
        found = json.loads(path.read_text())
        base_url = base_url or found["base_url"]
        if not token_file:
            if "token_file" not in found:
                sys.exit(
                    "the run's token is set in its run file (sampler.api_token): pass it with --token-file"
                )
            token_file = found["token_file"]
    return base_url.rstrip("/"), Path(token_file).read_text().strip()


def run_episode(base_url: str, token: str, max_turns: int) -> str:
    """Claim an episode, play it to its end and finish it; returns a line saying how it went."""
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as http:
        claimed = http.post("/v1/episodes")
        if claimed.status_code != 200:
            return f"no episode: {claimed.json()['error']['message']}"
        episode = claimed.json()
        model = openai.OpenAI(base_url=episode["base_url"], api_key=token, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, *episode["messages"]]
        calls = 0
        try:
            for _ in range(min(max_turns, episode["max_turns"])):
                reply = model.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    try:
                        expression = json.loads(call.function.arguments).get("expression", "")
                    except (json.JSONDecodeError, AttributeError):
                        expression = ""
                    result = calculate(str(expression)) if expression else "error: no expression given"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                    calls += 1
        except openai.APIStatusError as exc:  # e.g. 409 episode_stale: the run moved on; claim another
            return f"{episode['id']}: ended by the server ({exc.code}): {exc.message}"
        finished = http.post(f"/v1/episodes/{episode['id']}/finish", json={})
        if finished.status_code != 200:
            return f"{episode['id']}: not finished ({finished.json()['error']['code']})"
        answer = (
            str(messages[-1].get("content") or "")[:60] if messages[-1].get("role") == "assistant" else ""
        )
        return f"{episode['id']}: task {episode['task_id']}, {calls} calculator call(s), answer {answer!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/local", help="the run whose agents.json to read")
    parser.add_argument("--base-url", default="", help="the agent API (e.g. http://127.0.0.1:8000)")
    parser.add_argument("--token-file", default="", help="a file holding the run's API token")
    parser.add_argument("--episodes", type=int, default=8, help="episodes to play")
    parser.add_argument("--concurrency", type=int, default=4, help="episodes played at once")
    parser.add_argument("--max-turns", type=int, default=6, help="chat completions per episode, at most")
    args = parser.parse_args()
    base_url, token = connection(args)
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(run_episode, base_url, token, args.max_turns) for _ in range(args.episodes)]
        for future in futures:
            print(future.result(), flush=True)


if __name__ == "__main__":
    main()
