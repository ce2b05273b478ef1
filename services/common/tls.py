"""TLS for the gRPC servers people reach from outside the run, and for the sampler's calls to environments.

Plaintext stays the local default. With a certificate and key (PEM files, e.g. a Kubernetes TLS Secret
mounted as files), a server listens with TLS only; with a client CA as well, it also requires every client to
present a certificate that CA signed (mutual TLS). On the client side, a CA file pins whom the sampler
trusts (empty: the system's roots), and a certificate and key are what it presents to servers that ask.

Configuration (pydantic) is here; grpc is imported inside the functions, so config validation stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import grpc


class ServerTls(BaseModel):
    """A server's TLS: its certificate chain and key, and optionally the CA its clients' certificates need."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str = Field("", description="PEM certificate chain the server presents; empty: plaintext.")
    key_file: str = Field("", description="PEM private key of cert_file.")
    client_ca_file: str = Field(
        "", description="PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."
    )

    @model_validator(mode="after")
    def _complete(self) -> ServerTls:
        _require_pair("TLS", self.cert_file, self.key_file)
        if self.client_ca_file and not self.cert_file:
            raise ValueError("client_ca_file (mutual TLS) needs the server's cert_file and key_file too")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class ClientTls(BaseModel):
    """What a client trusts and presents when it calls a TLS server."""

    model_config = ConfigDict(extra="forbid")

    ca_file: str = Field(
        "", description="PEM CA bundle the servers' certificates must chain to; empty: system roots."
    )
    cert_file: str = Field(
        "", description="PEM certificate to present to servers that require one (mutual TLS)."
    )
    key_file: str = Field("", description="PEM private key of cert_file.")

    @model_validator(mode="after")
    def _complete(self) -> ClientTls:
        _require_pair("a client certificate", self.cert_file, self.key_file)
        return self


def _require_pair(what: str, cert_file: str, key_file: str) -> None:
    """A certificate and its key come together, or neither does."""
    if bool(cert_file) != bool(key_file):
        raise ValueError(
            f"{what} needs both cert_file and key_file (got cert_file={cert_file!r}, key_file={key_file!r})"
        )


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS {what} {path!r} cannot be read: {exc}") from None


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials | None:
    """The server credentials ``tls`` describes; None for plaintext."""
    import grpc

    if not tls.enabled:
        return None
    pair = (_read(tls.key_file, "key_file"), _read(tls.cert_file, "cert_file"))
    client_ca = _read(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    """Channel credentials for a TLS server, trusting ``tls.ca_file`` (else the system's roots)."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file, "ca_file") if tls.ca_file else None,
        private_key=_read(tls.key_file, "key_file") if tls.key_file else None,
        certificate_chain=_read(tls.cert_file, "cert_file") if tls.cert_file else None,
    )
