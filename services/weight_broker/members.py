"""Who the weight group's members are, from what each rank set in the epoch's store before it arrived:
``host/<rank>`` (the /dev/shm it sees), ``gpu/<rank>`` (its GPU, under NCCL) and ``host_copies/<rank>``
(whether it keeps versions in host memory). Every rank reads the same keys, so every rank decides alike."""

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


def host_peers(store: Any, rank: int, world_size: int) -> list[int]:
    """The receivers on ``rank``'s host that keep host copies (``host_copies/<rank>``), ``rank`` among them;
    empty unless there are two or more of them."""
    if store.get(f"host_copies/{rank}") != b"1":
        return []
    on_host = ranks_by(store, "host", world_size)[store.get(f"host/{rank}").decode()]
    peers = [r for r in on_host if r > 0 and store.get(f"host_copies/{r}") == b"1"]
    return peers if len(peers) > 1 else []


def same_host(store: Any, world_size: int) -> bool:
    """Whether every rank set the same :func:`host_identity` at ``host/<rank>`` (a rank that set none, which is
    not a WeightGroup, shares nothing)."""
    try:
        if not store.check([f"host/{r}" for r in range(world_size)]):
            return False
        return len(ranks_by(store, "host", world_size)) == 1
    except Exception:  # the store is failing: the group's forming fails on its own
        return False


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
