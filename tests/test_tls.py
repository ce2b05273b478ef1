"""TLS and tokens on the client-facing gRPC servers and on the sampler's calls to environments, with
certificates this test makes: a CA, a server certificate for 127.0.0.1, and a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from services.common.observability import grpc_server
from services.common.tls import ClientTls, ServerTls, channel_credentials, server_credentials
from services.sampler.environments.base import EnvironmentFailure
from services.sampler.environments.builtin import BUILTINS
from services.sampler.environments.registry import make_environment, public
from services.sampler.environments.server import serve_environment
from vcpo.v1 import common_pb2, common_pb2_grpc, registry_pb2, rollout_pb2


def _certificates(out: Path) -> dict[str, str]:
    """PEM files: ca.pem, server.pem/server.key (127.0.0.1), client.pem/client.key, and other-ca.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def write(stem: str, cert: x509.Certificate, private: ec.EllipticCurvePrivateKey | None = None) -> None:
        (out / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if private is not None:
            (out / f"{stem}.key").write_bytes(
                private.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )

    def ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        private = key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(private.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(private, hashes.SHA256())
        )
        return cert, private

    def leaf(common: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], server: bool) -> None:
        private = key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(issuer[0].subject)
            .public_key(private.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        write(common, builder.sign(issuer[1], hashes.SHA256()), private)

    root = ca("test-ca")
    write("ca", root[0])
    write("other-ca", ca("other-ca")[0])
    leaf("server", root, server=True)
    leaf("client", root, server=False)
    return {stem: str(out / stem) for stem in ("ca", "other-ca", "server", "client")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _certificates(tmp_path_factory.mktemp("pki"))


class _Status(common_pb2_grpc.StatusServicer):
    def GetStatus(
        self, request: common_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> common_pb2.ServiceStatus:
        return common_pb2.ServiceStatus(service="tls-test")


def _status_server(tls: ServerTls):  # type: ignore[no-untyped-def]
    def add(server: grpc.Server) -> list[str]:
        common_pb2_grpc.add_StatusServicer_to_server(_Status(), server)
        return ["vcpo.v1.Status"]

    return grpc_server(add, port=0, host="127.0.0.1", credentials=server_credentials(tls))


def _status(channel: grpc.Channel) -> str:
    return str(common_pb2_grpc.StatusStub(channel).GetStatus(common_pb2.StatusRequest(), timeout=5).service)


def test_a_tls_server_answers_clients_that_trust_its_ca_and_refuses_plaintext(pki: dict[str, str]) -> None:
    server = _status_server(ServerTls(cert_file=pki["server"] + ".pem", key_file=pki["server"] + ".key"))
    target = f"127.0.0.1:{server.port}"
    try:
        trusting = channel_credentials(ClientTls(ca_file=pki["ca"] + ".pem"))
        with grpc.secure_channel(target, trusting) as channel:
            assert _status(channel) == "tls-test"
        for credentials in (None, channel_credentials(ClientTls(ca_file=pki["other-ca"] + ".pem"))):
            channel = (
                grpc.insecure_channel(target)
                if credentials is None
                else grpc.secure_channel(target, credentials)
            )
            with channel, pytest.raises(grpc.RpcError) as info:
                _status(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mutual_tls_requires_a_client_certificate_its_ca_signed(pki: dict[str, str]) -> None:
    tls = ServerTls(
        cert_file=pki["server"] + ".pem", key_file=pki["server"] + ".key", client_ca_file=pki["ca"] + ".pem"
    )
    server = _status_server(tls)
    target = f"127.0.0.1:{server.port}"
    try:
        anonymous = channel_credentials(ClientTls(ca_file=pki["ca"] + ".pem"))
        with grpc.secure_channel(target, anonymous) as channel, pytest.raises(grpc.RpcError) as info:
            _status(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        known = ClientTls(
            ca_file=pki["ca"] + ".pem", cert_file=pki["client"] + ".pem", key_file=pki["client"] + ".key"
        )
        with grpc.secure_channel(target, channel_credentials(known)) as channel:
            assert _status(channel) == "tls-test"
    finally:
        server.stop(0)


def test_tls_settings_are_checked_and_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="TLS needs both cert_file and key_file"):
        ServerTls(cert_file="a.pem")
    with pytest.raises(ValidationError, match=r"client_ca_file \(mutual TLS\) needs the server's cert_file"):
        ServerTls(client_ca_file="ca.pem")
    with pytest.raises(ValidationError, match="a client certificate needs both cert_file and key_file"):
        ClientTls(cert_file="c.pem")
    assert server_credentials(ServerTls()) is None  # plaintext: the default
    (tmp_path / "k").write_text("a key")
    with pytest.raises(ValueError, match=r"TLS cert_file '.*missing.pem' cannot be read"):
        server_credentials(ServerTls(cert_file=str(tmp_path / "missing.pem"), key_file=str(tmp_path / "k")))


def test_the_sampler_calls_a_tls_environment_with_its_token(pki: dict[str, str]) -> None:
    """An environment served over TLS that wants a token: the sampler's client (made from the registration, as
    the registry makes it) trusts the CA in sampler.env_tls and sends the registration's auth_token; a wrong
    token is refused, and the token never leaves the registry in a listing."""
    server = serve_environment(
        BUILTINS["python"]("python"),
        tls=ServerTls(cert_file=pki["server"] + ".pem", key_file=pki["server"] + ".key"),
        token="env-secret",
    )
    endpoint = f"127.0.0.1:{server.port}"
    trust = ClientTls(ca_file=pki["ca"] + ".pem")
    spec = registry_pb2.EnvironmentSpec(name="py", endpoint=endpoint, tls=True, auth_token="env-secret")
    env = make_environment(spec, 4 << 20, tls=trust)
    wrong = make_environment(
        registry_pb2.EnvironmentSpec(name="py", endpoint=endpoint, tls=True, auth_token="guess"),
        4 << 20,
        tls=trust,
    )
    plain = make_environment(registry_pb2.EnvironmentSpec(name="py", endpoint=endpoint), 4 << 20)
    try:
        assert env.health_problem(5) is None
        reply = env.reset("s1", rollout_pb2.Task(task_id="t", prompt="hi"), 10)
        assert [t.name for t in reply.tools] == ["python"]
        env.close("s1", 10)
        with pytest.raises(EnvironmentFailure, match="UNAUTHENTICATED") as info:
            wrong.reset("s2", rollout_pb2.Task(task_id="t", prompt="hi"), 10)
        assert "a wrong token" in str(info.value)
        assert plain.health_problem(2) is not None  # plaintext to a TLS server gets nothing back
        assert public(spec).auth_token == "***" and spec.auth_token == "env-secret"
    finally:
        for client in (env, wrong, plain):
            client.shutdown()
        server.stop(0)


@pytest.mark.slow
def test_the_example_client_reaches_a_sampler_whose_api_uses_tls(
    make_stack: Any, pki: dict[str, str], tmp_path: Path
) -> None:
    """[sampler.api_tls] on a real sampler: the example client with --tls-ca registers and submits; without it
    the plaintext call gets nothing back."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    tls = {"cert_file": pki["server"] + ".pem", "key_file": pki["server"] + ".key"}
    stack = make_stack(k=4, groups_per_step=2, dataset="", n=2, max_tokens=8, api_tls=tls)
    server = serve_environment(BUILTINS["python"]("python"))

    def client(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable,
            "examples/submit_tasks.py",
            "--sampler",
            f"127.0.0.1:{stack.service.server.port}",
        ]
        command += ["--token-file", str(tmp_path / "api_token"), "--env-endpoint", f"127.0.0.1:{server.port}"]
        command += ["--tasks", "2", "--watch-s", "0", *extra]
        return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)

    try:
        secured = client("--tls-ca", pki["ca"] + ".pem")
        assert secured.returncode == 0, secured.stderr
        assert "submitted: 2 accepted, 0 rejected" in secured.stdout
        plain = client()
        assert plain.returncode == 1 and "registration refused: UNAVAILABLE" in plain.stderr
    finally:
        server.stop(0)
