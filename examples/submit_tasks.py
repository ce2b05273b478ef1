"""A client of a running system: register a custom environment, submit tasks for it, watch its status.

It needs only gRPC and the generated ``vcpo.v1`` messages (``make proto``, or any language's protoc output of
``protos/``), and the run's API token (``<run_dir>/api_token`` for a local run, or the Secret on a cluster):

    python examples/calculator_env.py --port 50070 &
    python examples/submit_tasks.py --sampler 127.0.0.1:50051 --token-file runs/local/api_token \\
        --env-endpoint 127.0.0.1:50070 --tasks 8

Every registry call carries ``authorization: Bearer <token>``; a wrong token is refused (UNAUTHENTICATED).
``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS) reaches a sampler whose API uses TLS.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

from vcpo.v1 import registry_pb2, registry_pb2_grpc, rollout_pb2

PROBLEMS = [
    ("What is 17 * 23?", "391"),
    ("What is 1234 + 4321?", "5555"),
    ("What is 2 ** 10?", "1024"),
    ("What is 99 * 99?", "9801"),
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sampler", default="127.0.0.1:50051", help="a sampler replica's gRPC address")
    parser.add_argument("--token-file", type=Path, required=True, help="the run's API token")
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
        token = args.token_file.read_text().strip()
    except OSError as exc:
        print(f"cannot read the API token: {exc}", file=sys.stderr)
        return 2
    auth = (("authorization", f"Bearer {token}"),)

    if args.tls_ca is None:
        channel = grpc.insecure_channel(args.sampler)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca.read_bytes(),
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
        )
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
