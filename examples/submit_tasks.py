"""A client of a running system: register a custom environment, submit tasks for it, watch its status.

It needs only gRPC and the generated ``vcpo.v1`` messages (``make proto``, or any language's protoc output of
``protos/``). With ``make run`` going in another terminal:

    python examples/calculator_env.py --port 50070 &
    python examples/submit_tasks.py --env-endpoint 127.0.0.1:50070 --tasks 8

It finds the run from its directory (``--run-dir``, default: this repository's ``runs/local``): the sampler's
port in ``<run_dir>/sampler/sampler-0.endpoints.json`` (the local preset gives it a free port, which its
replica writes there when it serves) and the API token in ``<run_dir>/api_token`` (or the run's
``sampler.api_token_file``). ``--sampler HOST:PORT`` and ``--token-file`` name them instead (a cluster: the
Service's address and the Secret).

Every registry call carries ``authorization: Bearer <token>``; a wrong token is refused (UNAUTHENTICATED).
``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS) reaches a sampler whose API uses TLS.
Exit codes: 0 done, 1 the sampler refused or failed a call, 2 bad flags, no run to reach, or no token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from vcpo.v1 import registry_pb2, registry_pb2_grpc, rollout_pb2

PROBLEMS = [
    ("What is 17 * 23?", "391"),
    ("What is 1234 + 4321?", "5555"),
    ("What is 2 ** 10?", "1024"),
    ("What is 99 * 99?", "9801"),
]
RUN_DIR = Path(__file__).resolve().parent.parent / "runs" / "local"  # where `make run` writes


class NoRun(Exception):
    """The run directory does not say where a live sampler listens, or what it needs to be reached."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}


def run_sampler_config(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The ``[sampler]`` section of the configuration the launcher resolved for the run (empty without one)."""
    resolved = run_dir / "config.resolved.json"
    return resolved, dict(read_json(resolved).get("sampler") or {})


def alive(pid: object) -> bool:
    """Whether the process ``pid`` runs on this machine (an endpoints file outlives its run)."""
    if not isinstance(pid, int):
        return True  # nothing to check against
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but running
    return True


def run_sampler(run_dir: Path) -> str:
    """The address of the run's first live sampler replica: each writes ``sampler-<i>.endpoints.json`` (its
    gRPC port and PID) when it serves. The run is on this machine, so the address is 127.0.0.1."""
    first = run_dir / "sampler" / "sampler-0.endpoints.json"
    found = sorted((run_dir / "sampler").glob("sampler-*.endpoints.json"))
    if not found:
        raise NoRun(
            f"no sampler of a run in {run_dir}: {first} does not exist (a run's sampler writes it when it "
            "serves). Start the run (make run), name its directory with --run-dir, or give the sampler's "
            "address with --sampler HOST:PORT"
        )
    for path in found:
        ends = read_json(path)
        if alive(ends.get("pid")):
            return f"127.0.0.1:{ends['grpc_port']}"
    pid = read_json(found[0]).get("pid")
    raise NoRun(
        f"the run in {run_dir} is not up: {found[0]} names process {pid}, which is not running. Start the "
        "run (make run), or give the sampler's address with --sampler HOST:PORT"
    )


def run_token_file(run_dir: Path) -> Path:
    """The file holding the run's API token: ``sampler.api_token_file`` of its resolved configuration, else
    the one the sampler creates, ``<run_dir>/api_token``."""
    resolved, sampler = run_sampler_config(run_dir)
    if sampler.get("api_token"):
        raise NoRun(
            f"the run's API token is set in its configuration (sampler.api_token; {resolved} shows it masked), "
            "not in a file: write it to a file and pass --token-file"
        )
    return Path(str(sampler.get("api_token_file") or run_dir / "api_token"))


def check_run_tls(run_dir: Path, args: argparse.Namespace) -> None:
    """Refuse to dial a run whose API uses TLS ([sampler.api_tls]) without the flags that reach it."""
    resolved, sampler = run_sampler_config(run_dir)
    tls = dict(sampler.get("api_tls") or {})
    if tls.get("cert_file") and args.tls_ca is None:
        raise NoRun(
            f"the run's API uses TLS (sampler.api_tls in {resolved}): pass --tls-ca with the CA that signed "
            f"{tls['cert_file']}"
        )
    if tls.get("client_ca_file") and args.tls_cert is None:
        raise NoRun(
            f"the run's API requires a client certificate (sampler.api_tls.client_ca_file in {resolved}): "
            "pass --tls-cert and --tls-key"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=RUN_DIR,
        help="the directory of a run on this machine, where the sampler's address and the API token are "
        "found (default: %(default)s)",
    )
    parser.add_argument("--sampler", help="a sampler replica's gRPC address (default: the run's)")
    parser.add_argument("--token-file", type=Path, help="the API token (default: the run's)")
    parser.add_argument("--env-name", default="calculator")
    parser.add_argument("--env-endpoint", required=True, help="host:port of the environment server")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--watch-s", type=float, default=30, help="how long to follow its status")
    parser.add_argument(
        "--tls-ca",
        type=Path,
        help="the CA of a sampler whose API uses TLS ([sampler.api_tls]); default: plaintext",
    )
    parser.add_argument("--tls-cert", type=Path, help="a client certificate, when the API requires one")
    parser.add_argument("--tls-key", type=Path, help="the key of --tls-cert")
    args = parser.parse_args()
    try:
        if args.sampler is None:
            check_run_tls(args.run_dir, args)
            args.sampler = run_sampler(args.run_dir)
        if args.token_file is None:
            args.token_file = run_token_file(args.run_dir)
    except NoRun as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:
        print(f"cannot read the API token: {exc}", file=sys.stderr)
        return 2
    auth = (("authorization", f"Bearer {token}"),)

    if args.tls_ca is None:
        channel = grpc.insecure_channel(args.sampler)
    else:
        try:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=args.tls_ca.read_bytes(),
                private_key=args.tls_key.read_bytes() if args.tls_key else None,
                certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
            )
        except OSError as exc:
            print(f"cannot read a TLS file: {exc}", file=sys.stderr)
            return 2
        channel = grpc.secure_channel(args.sampler, credentials)
    with channel:
        registry = registry_pb2_grpc.EnvironmentRegistryStub(channel)
        spec = registry_pb2.EnvironmentSpec(
            name=args.env_name,
            endpoint=args.env_endpoint,
            tool_parser="json",
            scorer="math",
            max_turns=4,
            step_timeout_seconds=10,
            weight=1.0,
        )
        try:
            reply = registry.RegisterEnvironment(
                registry_pb2.RegisterEnvironmentRequest(spec=spec), metadata=auth
            )
        except grpc.RpcError as exc:
            print(f"registration refused: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        print(f"environment {reply.name!r} {'registered' if reply.created else 'updated'}")

        def tasks() -> object:
            for i in range(args.tasks):
                prompt, answer = PROBLEMS[i % len(PROBLEMS)]
                task = rollout_pb2.Task(task_id=f"{args.env_name}:{i}", prompt=prompt, reference=answer)
                yield registry_pb2.SubmitTasksRequest(environment=args.env_name, task=task)

        submitted = registry.SubmitTasks(tasks(), metadata=auth)
        print(f"submitted: {submitted.accepted} accepted, {submitted.rejected} rejected")
        for error in submitted.errors:
            print(f"  {error}")

        deadline = time.monotonic() + args.watch_s
        while time.monotonic() < deadline:
            status = registry.EnvironmentStatus(
                registry_pb2.EnvironmentStatusRequest(name=args.env_name), metadata=auth
            )
            print(
                f"healthy={status.healthy} queued={status.tasks_queued} running={status.episodes_running} "
                f"completed={status.episodes_completed} errors={status.errors} {status.last_error}"
            )
            time.sleep(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
