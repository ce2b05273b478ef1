"""A run file's environment with `tls` and a token it names (auth_token_file, auth_token_env): the keys are
checked, and the sampler's registration (services/sampler/build.py ``environment_registry``, what every sampler
replica and evaluator runs at start) calls a real gRPC environment server over TLS, which sees
`authorization: Bearer <token>` on its calls. Certificates from tests/test_tls.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from pydantic import ValidationError

from services.common.auth import TokenAuthInterceptor
from services.common.config import load_config
from services.common.observability import GrpcServer, grpc_server
from services.common.tls import ServerTls, server_credentials
from services.sampler.build import environment_registry, environment_spec
from services.sampler.config import EnvironmentConfig, SamplerServiceConfig
from services.sampler.environments.base import EnvironmentFailure
from services.sampler.environments.builtin import BUILTINS
from services.sampler.environments.registry import public
from services.sampler.environments.server import EnvironmentServicer
from tests.test_tls import _certificates
from vcpo.v1 import environment_pb2, environment_pb2_grpc, registry_pb2, rollout_pb2

TOKEN = "env-secret-123"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _certificates(tmp_path_factory.mktemp("pki"))


class _Recording(EnvironmentServicer):
    """The built-in Python environment, noting the `authorization` metadata of each Reset it answers."""

    def __init__(self) -> None:
        super().__init__(BUILTINS["python"]("python"))
        self.seen: list[str] = []

    def Reset(self, request: Any, context: grpc.ServicerContext) -> environment_pb2.ResetResponse:
        self.seen.append(str(dict(context.invocation_metadata()).get("authorization", "")))
        return super().Reset(request, context)


@pytest.fixture
def server(pki: dict[str, str]) -> Any:
    """A TLS environment server that refuses Environment calls without the token (as an author's would)."""
    servicer = _Recording()

    def add(s: grpc.Server) -> list[str]:
        environment_pb2_grpc.add_EnvironmentServicer_to_server(servicer, s)
        return ["vcpo.v1.Environment"]

    tls = ServerTls(cert_file=pki["server"] + ".pem", key_file=pki["server"] + ".key")
    running: GrpcServer = grpc_server(
        add,
        port=0,
        host="127.0.0.1",
        interceptors=[TokenAuthInterceptor(TOKEN, {"vcpo.v1.Environment"})],
        credentials=server_credentials(tls),
    )
    yield running, servicer
    running.stop(0)
    servicer.env.shutdown()


def run_file(tmp_path: Path, pki: dict[str, str], port: int, token_keys: str) -> SamplerServiceConfig:
    path = tmp_path / "run.toml"
    path.write_text(f"""
[run]
run_id = "tokens"
[sampler]
n = 2
[sampler.env_tls]
ca_file = "{pki["ca"]}.pem"
[[sampler.environments]]
name = "secured"
endpoint = "127.0.0.1:{port}"
tls = true
{token_keys}
""")
    return load_config(SamplerServiceConfig, [path], env={})


def test_the_token_keys_are_checked_and_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="auth_token_file and auth_token_env both set"):
        EnvironmentConfig(name="e", endpoint="h:1", auth_token_file="/t", auth_token_env="T")
    with pytest.raises(ValidationError, match="tls, auth_token_file and auth_token_env are for an endpoint"):
        EnvironmentConfig(name="e", builtin="python", tls=True)
    with pytest.raises(ValidationError, match="auth_token_env"):
        EnvironmentConfig(name="e", endpoint="h:1", auth_token_env="NOT A NAME")
    with pytest.raises(ValidationError, match="auth_token"):  # a literal token is no key of the run file
        EnvironmentConfig.model_validate({"name": "e", "endpoint": "h:1", "auth_token": TOKEN})

    missing = EnvironmentConfig(name="e", endpoint="h:1", auth_token_file=str(tmp_path / "nope"))
    with pytest.raises(
        ValueError, match=r"\[\[sampler.environments\]\] 'e': auth_token_file = '.*nope' cannot be read"
    ):
        missing.auth_token()
    (tmp_path / "blank").write_text("\n")
    with pytest.raises(ValueError, match=r"auth_token_file = '.*blank' is empty"):
        EnvironmentConfig(name="e", endpoint="h:1", auth_token_file=str(tmp_path / "blank")).auth_token()
    from_env = EnvironmentConfig(name="e", endpoint="h:1", auth_token_env="E_TOKEN")
    with pytest.raises(ValueError, match="auth_token_env = 'E_TOKEN', but the sampler's environment has no"):
        from_env.auth_token({})
    assert from_env.auth_token({"E_TOKEN": f" {TOKEN}\n"}) == TOKEN
    (tmp_path / "token").write_text(f"{TOKEN}\n")  # as `kubectl create secret --from-file` keeps it
    spec = environment_spec(
        EnvironmentConfig(name="e", endpoint="h:1", tls=True, auth_token_file=str(tmp_path / "token"))
    )
    assert spec == registry_pb2.EnvironmentSpec(name="e", endpoint="h:1", tls=True, auth_token=TOKEN)
    assert environment_spec(EnvironmentConfig(name="p", builtin="python")) == registry_pb2.EnvironmentSpec(
        name="p", builtin="python"
    )


@pytest.mark.parametrize("source", ["file", "env"])
def test_a_run_files_environment_is_called_over_tls_with_the_token_it_names(
    source: str,
    server: Any,
    pki: dict[str, str],
    redis_client: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The registration a sampler makes from the run file: over TLS (trusting sampler.env_tls.ca_file), the
    server's calls carry the token read from the file or variable the entry names; the stored registration
    keeps it for the other replicas and listings mask it; the run file itself holds no token."""
    running, servicer = server
    if source == "file":
        (tmp_path / "token").write_text(f"{TOKEN}\n")
        keys = f'auth_token_file = "{tmp_path / "token"}"'
    else:
        monkeypatch.setenv("SECURED_ENV_TOKEN", TOKEN)
        keys = 'auth_token_env = "SECURED_ENV_TOKEN"'
    cfg = run_file(tmp_path, pki, running.port, keys)
    assert TOKEN not in (tmp_path / "run.toml").read_text()
    registry = environment_registry(cfg, redis_client, "sampler-0")
    try:
        handle = registry.get("secured")
        assert handle is not None and handle.spec.tls and handle.spec.auth_token == TOKEN
        reply = handle.env.reset("s1", rollout_pb2.Task(task_id="t", prompt="hi"), 10)
        assert [t.name for t in reply.tools] == ["python"]
        handle.env.close("s1", 10)
        assert servicer.seen == [f"Bearer {TOKEN}"]
        (listed,) = registry.specs()
        assert public(listed).auth_token == "***"
    finally:
        registry.close()


def test_a_token_that_cannot_be_read_stops_the_registration_naming_the_key(
    server: Any, pki: dict[str, str], redis_client: redis.Redis, tmp_path: Path
) -> None:
    running, servicer = server
    cfg = run_file(tmp_path, pki, running.port, f'auth_token_file = "{tmp_path / "not-mounted"}"')
    with pytest.raises(ValueError, match=r"'secured': auth_token_file = '.*not-mounted' cannot be read"):
        environment_registry(cfg, redis_client, "sampler-0")
    assert servicer.seen == []
    # a wrong token in the file is sent as it is, and the server refuses it
    (tmp_path / "token").write_text("guess")
    registry = environment_registry(
        run_file(tmp_path, pki, running.port, f'auth_token_file = "{tmp_path / "token"}"'),
        redis_client,
        "sampler-0",
    )
    try:
        handle = registry.get("secured")
        assert handle is not None
        with pytest.raises(EnvironmentFailure, match="UNAUTHENTICATED"):
            handle.env.reset("s2", rollout_pb2.Task(task_id="t", prompt="hi"), 10)
        assert servicer.seen == []  # refused before it reached the environment
    finally:
        registry.close()
