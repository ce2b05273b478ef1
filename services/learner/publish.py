"""Publish the learner's weights from ZeRO-3 shards, bucket by bucket, in Hugging Face naming.

Every rank gathers one bucket at a time while rank 0 sends or stages it, so no rank holds more than one bucket
of gathered parameters beyond its shards. Every rank must call :func:`publish_version` or
:func:`publish_collective` (the gathers are collectives) and drains the gathers even when rank 0's send fails
part-way, then all agree on rank 0's outcome, so no rank is left waiting. Names are ``named_parameters()``'s,
which for a Hugging Face model are the checkpoint names vLLM loads (tied output embeddings appear once, as in
``save_pretrained``); a LoRA model publishes its merged weights under the base's names (``lora.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.learner.lora import PublishedUnit, published_units
from services.learner.norm_rules import full_shape, gathered
from services.weight_transport import (
    CollectivePublisher,
    PublishResult,
    StalePublish,
    TensorSpec,
    TransferFailed,
    TransferStats,
    VersionExists,
    WeightTransport,
    dtype_name,
)

log = logging.getLogger(__name__)


def collective_device(group: Any = None) -> torch.device:
    """The device a tensor must be on to travel through ``group`` (default: the default process group): the
    current CUDA device under NCCL (it communicates CUDA tensors only), the CPU under gloo."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tensor_specs(module: nn.Module) -> list[TensorSpec]:
    """The manifest of a (possibly ZeRO-3 partitioned) module: names, dtypes and full shapes, no gathering
    (a LoRA model's: its merged weights, ``lora.published_units``)."""
    return [TensorSpec(u.name, dtype_name(u.like.dtype), full_shape(u.like)) for u in published_units(module)]


class VersionNotSent(TransferFailed):
    """Rank 0 could not stage or send a version before announcing it (no host memory for its staging, a source
    that did not match its specs): nothing reached the weight group, which stays as it is."""


@dataclass
class GatherStats:
    """What the gathers held at once, to check the bucket bound."""

    buckets: int = 0
    max_bucket_bytes: int = 0


def gathered_tensors(
    module: nn.Module, bucket_bytes: int = 256 << 20, stats: GatherStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every published tensor (:func:`tensor_specs`), its parameters gathered in buckets of ``bucket_bytes``
    (a larger tensor alone); valid until the next item is requested. All ranks of a ZeRO-3 group must iterate
    it to the end together."""
    units = published_units(module)
    bucket: list[PublishedUnit] = []
    size = 0
    # the gathers run on whichever thread pulls this (the broker path's gRPC thread, whose current CUDA
    # device was never chosen: DeepSpeed would gather onto cuda:0 there, whatever this rank's device)
    device = next((u.like.device for u in units if u.like.device.type == "cuda"), None)

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        if device is not None:
            torch.cuda.set_device(device)
        if stats is not None:
            stats.buckets += 1
            stats.max_bucket_bytes = max(stats.max_bucket_bytes, size)
        with gathered([p for u in bucket for p in u.params]):
            for u in bucket:
                yield u.name, u.value()

    for unit in units:
        nbytes = sum(p.element_size() * int(torch.Size(full_shape(p)).numel()) for p in unit.params)
        if bucket and size + nbytes > bucket_bytes:
            yield from flush()
            bucket, size = [], 0
        bucket.append(unit)
        size += nbytes
    if bucket:
        yield from flush()


def rank0_code(code: int) -> int:
    """Rank 0's outcome code on every rank (a broadcast of the learner's process group; ``code`` itself when
    not distributed), so all ranks of a publish raise, retry or return together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return code
    flag = torch.tensor([code], dtype=torch.int64, device=collective_device())
    dist.broadcast(flag, src=0)
    return int(flag.item())


def publish_version(
    module: nn.Module,
    transport: WeightTransport | None,
    version: int,
    rank: int,
    bucket_bytes: int = 256 << 20,
    attempts: int = 3,
    backoff_s: float = 1.0,
    stats: GatherStats | None = None,
    retry_s: float = 0.0,
    max_backoff_s: float = 10.0,
) -> PublishResult | None:
    """Publish ``module``'s weights as ``version``: a collective every rank calls; rank 0 passes the transport.

    Returns the result on rank 0 (None elsewhere). A version the broker already has, or one older than its
    latest, counts as published: a learner restarted from its checkpoint redoes the steps since, and the
    broker keeps the versions those published (the sampled log-probs travel with every group, so importance
    weights stay exact even where a redone step's weights differ in the last bits).

    A transient failure (the broker unreachable, or restarting on the same ports) is retried by all ranks
    together, with doubling backoff, at least ``attempts`` times and for ``retry_s`` seconds since the first
    failure. Raises on every rank if it fails for good.
    """
    specs = tensor_specs(module)
    first_failure: float | None = None
    attempt = 0
    while True:
        attempt += 1
        source = gathered_tensors(module, bucket_bytes, stats)
        result: PublishResult | None = None
        error: BaseException | None = None
        if rank == 0:
            if transport is None:
                raise ValueError("rank 0 needs a transport to publish with")
            try:
                result = transport.publish_once(version, specs, source)
            except (VersionExists, StalePublish) as exc:  # a restarted learner redoing its steps
                log.info("version %d: %s; the broker keeps its copy", version, exc)
                result = PublishResult(version, sum(s.nbytes for s in specs), 0.0)
            except Exception as exc:
                error = exc
        # finish the gathers the other ranks are waiting in (all of them, on ranks != 0)
        deque(source, maxlen=0)
        outcome = rank0_code(
            0 if error is None else (1 if transport is not None and transport.is_transient(error) else 2)
        )
        if outcome == 0:
            if first_failure is not None:
                log.info(
                    "version %d published after %d attempts (%.1fs)",
                    version,
                    attempt,
                    time.monotonic() - first_failure,
                )
            return result
        first_failure = first_failure if first_failure is not None else time.monotonic()
        spent = rank0_code(int(attempt >= attempts and time.monotonic() - first_failure >= retry_s))
        if outcome == 2 or spent:  # rank 0's clock decides, so every rank stops retrying together
            if error is not None:
                raise error
            raise RuntimeError(f"rank 0 failed to publish version {version}; see its log")
        delay = min(backoff_s * 2 ** (attempt - 1), max_backoff_s)
        log.warning(
            "publish of version %d failed (attempt %d): %s; retrying in %.1fs", version, attempt, error, delay
        )
        time.sleep(delay)


def publish_collective(
    module: nn.Module,
    publisher: CollectivePublisher | None,
    version: int,
    rank: int,
    bucket_bytes: int = 256 << 20,
    stats: GatherStats | None = None,
    background: bool = False,
) -> TransferStats | None:
    """Broadcast ``module``'s weights as ``version`` into the weight group: a collective every learner rank
    calls; rank 0 passes its publisher. Returns rank 0's stats (None elsewhere, and with ``background``).

    Raises :class:`TransferFailed` on every rank if the version did not reach every receiver
    (:class:`VersionNotSent` where rank 0's own error stopped it before anything was announced). Nothing is
    retried: a failed collective broke the group; the caller forms a new one or uses the broker path.
    ``background``: rank 0 broadcasts from a thread, overlapping the next step; its failure is raised, on every
    rank, by the next call.
    """
    specs = tensor_specs(module)
    source = gathered_tensors(module, bucket_bytes, stats)
    result: TransferStats | None = None
    error: Exception | None = None
    if rank == 0:
        if publisher is None:
            raise ValueError("rank 0 needs the weight group's publisher to broadcast with")
        try:
            if background:
                publisher.send_background(version, specs, source)
            else:
                result = publisher.send(version, specs, source)
        except Exception as exc:  # agreed on below: every rank raises
            error = exc
    deque(source, maxlen=0)  # finish the gathers the other ranks are waiting in
    if rank0_code(int(error is not None)):
        if isinstance(error, TransferFailed):
            raise error
        if error is not None:  # rank 0's own, before anything was announced
            raise VersionNotSent(f"version {version}: {error}") from error
        raise TransferFailed(f"version {version}: rank 0's broadcast failed; see its log")
    return result
