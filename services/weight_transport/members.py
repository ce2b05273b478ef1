"""Who the weight group's members are: the GPU each rank set at ``gpu/<rank>`` of the epoch's store before it
arrived (under NCCL), which every rank reads alike; and the address receivers reach the publisher at."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

import torch


def device_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES
    numbers it as)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def ranks_by(store: Any, kind: str, world_size: int) -> dict[str, list[int]]:
    """The ranks grouped by the identity each set at ``<kind>/<rank>`` of an epoch's ``store`` before it
    arrived."""
    by_identity: dict[str, list[int]] = {}
    for r in range(world_size):
        by_identity.setdefault(store.get(f"{kind}/{r}").decode(), []).append(r)
    return by_identity


def shared_gpus(store: Any, world_size: int) -> list[list[int]]:
    """The ranks that share one GPU (empty: none do), from the identities every rank set at ``gpu/<rank>``
    (:func:`device_identity`)."""
    return [ranks for ranks in ranks_by(store, "gpu", world_size).values() if len(ranks) > 1]


def reachable_host(redis_url: str) -> str:
    """This machine's address as seen from the run's Redis host: 127.0.0.1 when Redis is local, else the
    address of the interface that routes there (what receivers on other nodes reach the publisher at), IPv4 or
    IPv6 as the Redis host resolves (first what resolves first)."""
    host = urlparse(redis_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    advice = "set weight_broker.group_host to the address the samplers reach this learner at"
    try:
        found = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ValueError(
            f"cannot resolve the Redis host {host!r} of {redis_url} to find this machine's address for the "
            f"weight group ({exc}): {advice}"
        ) from exc
    tried = []
    for family, kind, proto, _, address in found:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(address)  # UDP: no packet is sent, the route is looked up
                return str(s.getsockname()[0])
        except OSError as exc:
            tried.append(f"{address[0]}: {exc}")
    raise ValueError(f"no route from this machine to the Redis host {host!r} ({'; '.join(tried)}): {advice}")
