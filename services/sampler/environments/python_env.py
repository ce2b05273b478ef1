"""The built-in code interpreter: the model's Python runs in the reward service's sandbox, its output comes back.

The SimpleTIR setting: reasoning interleaved with code execution, the reward from the final answer (the task's
scorer), so this environment rewards nothing and never ends an episode itself; the model ends it by answering
without a call. Each call runs stateless, in a fresh sandboxed process (nothing carries over between calls:
the model re-defines what it needs). What the model sees: stdout, then the tail of stderr (a traceback), then
a line naming how the run ended when it did not end well (``timeout``, ``memory_limit``, ``violation``, ...),
cut to ``max_observation_chars`` from the end. A call it cannot use (another tool, arguments that are not
``{"code": "..."}``) is answered with an observation that says what is expected: the model's mistake is
something to learn from, not an environment failure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

from services.common.sandbox import SandboxLimits, SandboxSetupError, run_python
from services.sampler.environments.base import Environment, EnvironmentFailure
from vcpo.v1 import environment_pb2, rollout_pb2

TOOL = environment_pb2.ToolSchema(
    name="python",
    description="Run a Python program (standard library only) and read what it prints.",
    parameters_json_schema=json.dumps(
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    ),
)
NO_OUTPUT = "(no output: print what you want to see)"
MARGIN_S = 1.0  # the sandbox's wall limit stays this far inside the call's deadline


class PythonEnvironment(Environment):
    """The ``python`` tool: each call runs ``code`` in a fresh sandboxed process (stateless), under at most
    ``wall_seconds`` of wall clock (less when the call's deadline is nearer), ``memory_bytes`` of address space
    and ``output_bytes`` of output."""

    def __init__(
        self,
        name: str = "python",
        wall_seconds: float = 10.0,
        memory_bytes: int = 512 << 20,
        output_bytes: int = 64 << 10,
        max_observation_chars: int = 2000,
    ) -> None:
        self.name = name
        # the CPU limit sits past the wall limit, so a busy loop ends as a (clearer) ``timeout``
        self.limits = SandboxLimits(
            wall_seconds=wall_seconds,
            memory_bytes=memory_bytes,
            output_bytes=output_bytes,
            cpu_seconds=math.ceil(wall_seconds) + 1,
        )
        self.max_observation_chars = max_observation_chars
        self._sessions: set[str] = set()
        self._lock = threading.Lock()

    def reset(
        self, session_id: str, task: rollout_pb2.Task, timeout_s: float
    ) -> environment_pb2.ResetResponse:
        with self._lock:
            self._sessions.add(session_id)
        return environment_pb2.ResetResponse(tools=[TOOL])

    def step(
        self, session_id: str, action: environment_pb2.Action, timeout_s: float
    ) -> environment_pb2.StepResponse:
        with self._lock:
            if session_id not in self._sessions:
                raise EnvironmentFailure(self.name, "error", f"step in unknown session {session_id!r}")
        code = self._code(action)
        if code is None:
            text = (
                'call the "python" tool with arguments {"code": "<program>"}; got tool '
                f"{action.tool_name!r} with arguments {action.arguments_json[:200]!r}"
            )
            return environment_pb2.StepResponse(observation=environment_pb2.Observation(text=text))
        wall = min(self.limits.wall_seconds, max(0.5, timeout_s - MARGIN_S))
        limits = dataclasses.replace(self.limits, wall_seconds=wall)
        try:
            result = run_python(code, limits=limits)
        except SandboxSetupError as exc:
            raise EnvironmentFailure(self.name, "error", f"the sandbox could not start: {exc}") from None
        parts = [result.stdout]
        if result.stderr:
            parts.append(result.stderr[-1000:])
        if not result.ok:
            parts.append(f"[{result.status}{': ' + result.detail if result.detail else ''}]")
        text = "\n".join(p.rstrip("\n") for p in parts if p) or NO_OUTPUT  # never an empty output block
        if len(text) > self.max_observation_chars:
            cut = len(text) - self.max_observation_chars
            text = f"[... {cut} characters cut]\n" + text[-self.max_observation_chars :]
        info = {"status": result.status, "wall_seconds": f"{result.wall_seconds:.3f}"}
        return environment_pb2.StepResponse(observation=environment_pb2.Observation(text=text), info=info)

    def close(self, session_id: str, timeout_s: float) -> None:
        with self._lock:
            self._sessions.discard(session_id)

    @staticmethod
    def _code(action: environment_pb2.Action) -> str | None:
        if action.tool_name != "python":
            return None
        try:
            arguments = json.loads(action.arguments_json)
        except json.JSONDecodeError:
            return None
        code = arguments.get("code") if isinstance(arguments, dict) else None
        return code if isinstance(code, str) else None
