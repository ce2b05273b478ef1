"""A test environment served from its own process: scripted answers, and ways to misbehave.

    python tests/envs/scripted_env.py --port 0 --mode normal|hang|crash|die [--steps 2] [--log calls.jsonl]

normal: Reset gives no observation and no tools; Step answers ``obs N: got C chars`` (N counts the session's
steps), reward 1.0 on the step that ends the episode (the ``--steps``-th), else 0. hang: Step never answers.
crash: Step raises (the server answers INTERNAL). die: the process exits on the first Step. Every call is
logged as one JSON line (method, session_id, action text, observation) so tests can check what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run as a script

from services.sampler.environments.base import Environment
from services.sampler.environments.server import serve_environment
from vcpo.v1 import environment_pb2, rollout_pb2


class Scripted(Environment):
    def __init__(self, mode: str, steps: int, log: Path | None) -> None:
        self.name, self.mode, self.steps, self.log = "scripted", mode, steps, log
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def _record(self, **call: Any) -> None:
        if self.log is not None:
            with self.lock, self.log.open("a") as f:
                f.write(json.dumps(call) + "\n")

    def reset(self, session_id: str, task: rollout_pb2.Task, timeout_s: float) -> Any:
        self._record(method="reset", session_id=session_id, task_id=task.task_id)
        return environment_pb2.ResetResponse()

    def step(self, session_id: str, action: environment_pb2.Action, timeout_s: float) -> Any:
        if self.mode == "hang":
            time.sleep(3600)
        if self.mode == "crash":
            raise RuntimeError("the scripted environment crashed")
        if self.mode == "die":
            os._exit(1)
        with self.lock:
            n = self.counts[session_id] = self.counts.get(session_id, 0) + 1
        text = f"obs {n}: got {len(action.text)} chars"
        self._record(method="step", session_id=session_id, action=action.text, observation=text)
        done = n >= self.steps
        return environment_pb2.StepResponse(
            observation=environment_pb2.Observation(text=text), reward=1.0 if done else 0.0, done=done
        )

    def close(self, session_id: str, timeout_s: float) -> None:
        self._record(method="close", session_id=session_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=["normal", "hang", "crash", "die"], default="normal")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()
    server = serve_environment(Scripted(args.mode, args.steps, args.log), args.port, max_workers=32)
    print(f"listening on 127.0.0.1:{server.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
