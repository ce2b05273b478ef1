"""A custom tool-use environment, served over gRPC: what a user writes to bring their own.

It imports nothing from this project's services, only gRPC and the generated ``vcpo.v1`` messages (any
language's protoc output of ``protos/vcpo/v1/environment.proto`` serves the same protocol):

    python examples/calculator_env.py --port 50070 [--max-calls 4]

One tool, ``calculator``: the model calls it with ``{"expression": "17 * 23"}`` (the ``json`` tool parser:
``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``) and reads the value. Arithmetic only
(numbers, + - * / // % **, parentheses), evaluated from the syntax tree: nothing else runs. Each session counts
its calls; past ``--max-calls`` the episode is over. The final answer is scored by the task's scorer (the
registration names one), so this environment gives no reward itself. Register it and submit tasks with
``examples/submit_tasks.py``.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import signal
import threading
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vcpo.v1 import environment_pb2, environment_pb2_grpc

TOOL = environment_pb2.ToolSchema(
    name="calculator",
    description="Evaluate an arithmetic expression.",
    parameters_json_schema=json.dumps(
        {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    ),
)
OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError (or ArithmeticError) for anything else."""
    if len(expression) > 1000:
        raise ValueError("expression too long")

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            value = OPS[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > 4096:  # bounds the work of what follows
                raise ValueError("number too large")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    return walk(ast.parse(expression, mode="eval"))  # type: ignore[no-any-return]


class Calculator(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def Reset(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.ResetResponse:
        with self.lock:
            self.calls[request.session_id] = 0
        return environment_pb2.ResetResponse(tools=[TOOL])

    def Step(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.StepResponse:
        with self.lock:
            if request.session_id not in self.calls:
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
            self.calls[request.session_id] += 1
            calls = self.calls[request.session_id]
        action = request.action
        try:
            if action.tool_name != "calculator":
                raise ValueError(f"unknown tool {action.tool_name!r}; the tool is 'calculator'")
            text = str(evaluate(str(json.loads(action.arguments_json)["expression"])))
        except (ValueError, KeyError, TypeError, SyntaxError, ArithmeticError, RecursionError) as exc:
            text = f"error: {exc}"  # the model's mistake: it reads why
        return environment_pb2.StepResponse(
            observation=environment_pb2.Observation(text=text), done=calls >= self.max_calls
        )

    def Close(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.CloseResponse:
        with self.lock:
            self.calls.pop(request.session_id, None)
        return environment_pb2.CloseResponse()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=50070)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--max-calls", type=int, default=4)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    environment_pb2_grpc.add_EnvironmentServicer_to_server(Calculator(args.max_calls), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    for service in ("", "vcpo.v1.Environment"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"listening on {args.host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()


if __name__ == "__main__":
    main()
