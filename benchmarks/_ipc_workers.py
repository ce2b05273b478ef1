"""A reference path for the GPU weight-sync benchmark (benchmarks/weight_sync_gpu.py): the version handed to
receivers on the publisher's own device through a shared staging buffer, as vLLM's IPC weight-transfer engine
does (``vllm/distributed/weight_transfer/ipc_engine.py``: the trainer packs its weights into a GPU buffer and
ships its CUDA IPC handle; each worker rebuilds it and loads from it).

The publisher (this process) packs each version into one flat staging buffer on its device (a device-to-device
copy per tensor: the learner's wait) and, once, hands the buffer to every receiver through a
``torch.multiprocessing`` queue: on CUDA that sends a CUDA IPC handle, which the receiver opens onto the same
memory; on CPU the buffer lives in shared memory and the receiver maps it (so the same processes run in the
CPU tests). For each version the publisher tells each receiver its number, and each copies every tensor out of
the buffer into its own model on the device. The publisher reuses the buffer only once every receiver
reported, so a receiver never reads a half-packed version.

It is not a transport of the project's: no vote, no failure handling, and one more copy of the model on the
publisher's device. It measures what a shared-GPU path that never leaves the device could reach, beside the
project's path through page-locked host memory (``shared_gpu``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.multiprocessing as tmp

from benchmarks._weight_sync_workers import _collect, _reap, digest_of
from services.weight_broker.buckets import WHOLE, bucket_layout
from services.weight_broker.cuda_ipc import export, release_export
from services.weight_broker.tensors import TensorSpec


def layout(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """Each tensor's name, shape, dtype, byte offset and byte length in the staging buffer: the version packed
    as one bucket, as the collective transport stages it (``buckets.bucket_layout``)."""
    specs = [TensorSpec.of(name, tensor) for name, tensor in named]
    [whole] = bucket_layout(specs, WHOLE)
    return [
        (name, tuple(tensor.shape), tensor.dtype, offset, specs[i].nbytes)
        for (i, offset), (name, tensor) in zip(whole.items, named, strict=True)
    ]


def view(staging: torch.Tensor, entry: tuple[str, tuple[int, ...], torch.dtype, int, int]) -> torch.Tensor:
    _, shape, dtype, offset, n = entry
    return staging[offset : offset + n].view(dtype).view(shape)


def _ipc_receiver(rank: int, device: str, staging_queue: Any, go: Any, results: Any) -> None:
    """A worker on ``device``: opens the publisher's staging buffer once, then for each version it is told of
    copies every tensor out of it into its own model there."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        staging, entries = staging_queue.get(timeout=120)  # on CUDA: opened from the IPC handle
        model = [torch.empty(shape, dtype=dtype, device=dev) for _, shape, dtype, _, _ in entries]
        while (version := go.get(timeout=600)) is not None:
            received = time.monotonic()
            for weight, entry in zip(model, entries, strict=True):
                weight.copy_(view(staging, entry), non_blocking=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            done = time.monotonic()
            results.put(
                {
                    "rank": rank,
                    "version": version,
                    "received": received,
                    "done": done,
                    "digest": digest_of([(e[0], w) for e, w in zip(entries, model, strict=True)]),
                    "bytes": sum(t.numel() * t.element_size() for t in model),
                }
            )
        del staging
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_ipc(named: list[tuple[str, torch.Tensor]], devices: list[str], versions: int = 4) -> dict[str, float]:
    """The publisher (this process, its tensors where ``named`` lives) hands ``versions`` versions to one
    receiver process per entry of ``devices`` (each on the publisher's device) through its staging buffer.
    Version 1 is untimed (the receivers open the buffer and allocate their models); the best of the rest
    (each differing from the last in its first element) is reported: ``seconds`` from the start of the
    publish until every model held it, ``blocked_s`` the publisher's pack into the staging buffer,
    ``load_gbps`` the slowest receiver's copy out of it, and ``staging_bytes`` (the extra memory on the
    publisher's device). Every receiver's model must equal each version byte for byte."""
    here = named[0][1].device
    if any(torch.device(d) != here for d in devices):
        raise ValueError(f"the IPC path's receivers share the publisher's device {here}, got {devices}")
    entries = layout(named)
    size = entries[-1][3] + entries[-1][4]
    nbytes = sum(e[4] for e in entries)
    staging = torch.empty(size, dtype=torch.uint8, device=here)
    if here.type == "cpu":
        staging.share_memory_()  # the receivers map it, not a copy made when it is pickled
    else:  # a driver that refuses CUDA IPC raises here, not in a queue's feeder thread; the count goes back
        [probe] = export(staging, [0]).values()
        release_export(probe)
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    staging_queues = [ctx.Queue() for _ in devices]
    go = [ctx.Queue() for _ in devices]
    procs = [
        ctx.Process(target=_ipc_receiver, args=(r + 1, device, staging_queues[r], go[r], results))
        for r, device in enumerate(devices)
    ]
    for p in procs:
        p.start()
    for q in staging_queues:
        q.put((staging, entries))
    best: dict[str, float] = {}
    try:
        for version in range(1, versions + 1):
            named[0][1].view(-1)[0] = float(version)  # every version's bytes differ from the last
            expected = digest_of(named)
            if here.type == "cuda":
                torch.cuda.synchronize(here)
            t0 = time.monotonic()
            for entry, (_, tensor) in zip(entries, named, strict=True):
                view(staging, entry).copy_(tensor)
            if here.type == "cuda":
                torch.cuda.synchronize(here)
            packed = time.monotonic()
            for q in go:
                q.put(version)
            out = _collect(results, len(devices), procs, timeout_s=600)
            errors = [r["error"] for r in out if "error" in r]
            if errors:
                raise RuntimeError(f"IPC receivers failed: {errors}")
            if any(r["digest"] != expected or r["bytes"] != nbytes for r in out):
                raise SystemExit(f"version {version}: an IPC receiver's model differs from the published one")
            seconds = max(r["done"] for r in out) - t0
            if version > 1 and seconds < best.get("seconds", float("inf")):
                best = {
                    "seconds": seconds,
                    "blocked_s": packed - t0,
                    "load_gbps": min(nbytes / (r["done"] - r["received"]) / 1e9 for r in out),
                    "staging_bytes": float(size),
                }
        for q in go:
            q.put(None)
    finally:
        _reap(procs)
    return best
