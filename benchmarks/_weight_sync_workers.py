"""The processes the weight-sync benchmark (benchmarks/weight_sync.py) starts and times, and the model it
moves.

A module of its own so that the benchmark script reads as what it measures and reports: everything here
runs in, or starts, another process (``spawn`` context: a child finds its target function in this module).
What it decides:

- the model: float32 tensors laid out like a transformer of about the asked size (seed 0), and its digest
  (xxh3_128 over each name and its bytes, in order), which every receiver must reproduce;
- the socket ceiling: the best of ``repeats`` loopback copies, timed until the receiver's one-byte ack;
- fetchers: each warms up with one untimed fetch, then waits on one Event released for all of them; it hashes
  every tensor in its sink (inside the timed path) and drops it, and reports its CPU seconds and peak RSS;
  a fetcher that dies without reporting fails the run at once;
- the collective: receivers join a gloo weight group; version 1 is untimed, version 2 is timed from the
  publisher's call until the last receiver holds it, versions 3 and 4 go in the background from a staging
  buffer (the 4th is the one reported; the 3rd allocates the buffer); each timed one after a pause, as a
  learner's step;
- the collective on devices (weight_sync_gpu.py): the same, each receiver taking each version into buffers on
  its group's device (its GPU, or host memory where the epoch runs on gloo with CPU buffers), then timed until
  it has loaded the version into its model's parameters there; every version differs from the last, and every
  model must equal it byte for byte.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import resource
import socket
import time
from queue import Empty
from typing import Any

import torch
import xxhash

from services.common.ports import free_port
from services.weight_transport.tensors import TensorSpec, tensor_bytes
from services.weight_transport.transport import WeightTransport

MiB = 1 << 20
PUBLISHES = 3  # the last one is timed as the steady state
LAYERS = 4


# ------------------------------------------------------------------------------------------------ model


def model_layout(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a float32 model of about ``total_bytes``: 3/4 in the layers, the rest in the
    embedding and lm_head."""
    hidden = max(64, int(math.sqrt(0.75 * total_bytes / (LAYERS * 48))) // 64 * 64)
    layout: list[tuple[str, tuple[int, ...]]] = []
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        layout += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.qkv_proj.weight", (3 * hidden, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.up_proj.weight", (4 * hidden, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, 4 * hidden)),
        ]
    layout.append(("model.norm.weight", (hidden,)))
    used = 4 * sum(math.prod(shape) for _, shape in layout)
    vocab = max(1, (total_bytes - used) // (2 * 4 * hidden))
    return [("model.embed_tokens.weight", (vocab, hidden)), *layout, ("lm_head.weight", (vocab, hidden))]


def build_model(total_bytes: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=g)) for name, shape in model_layout(total_bytes)]


def digest_of(named: list[tuple[str, torch.Tensor]]) -> str:
    h = xxhash.xxh3_128()
    for name, tensor in named:
        h.update(name.encode())
        h.update(tensor_bytes(tensor))
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- socket


def _socket_receiver(nbytes: int, connections: int, port_queue: Any) -> None:
    buffer = bytearray(nbytes)  # preallocated (and zeroed, so its pages exist) before any timing
    view = memoryview(buffer)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_queue.put(server.getsockname()[1])
        for _ in range(connections):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                    got += n
                conn.sendall(b"k")  # everything is in the buffer


def socket_gbps(named: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    """Best throughput of ``repeats`` loopback copies of the model's bytes (send until the receiver's ack)."""
    views = [tensor_bytes(t) for _, t in named]
    nbytes = sum(len(v) for v in views)
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    receiver = ctx.Process(target=_socket_receiver, args=(nbytes, repeats, ports))
    receiver.start()
    port = ports.get(timeout=120)
    best = 0.0
    for _ in range(repeats):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            t0 = time.perf_counter()
            for v in views:
                conn.sendall(v)
            if conn.recv(1) != b"k":
                raise ConnectionError("the socket receiver did not acknowledge")
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    receiver.join(timeout=60)
    if receiver.exitcode != 0:
        raise RuntimeError(f"socket receiver exited with {receiver.exitcode}")
    return best


# ---------------------------------------------------------------------------------------------- fetchers


def _fetcher(address: str, data: str, index: int, ready: Any, go: Any, results: Any) -> None:
    try:
        transport = WeightTransport(address, data)
        transport.fetch(lambda name, t: None)  # a sampler has fetched versions before: warm buffers, untimed
        hasher = xxhash.xxh3_128()
        counts = {"bytes": 0, "tensors": 0}
        sink_seconds = 0.0

        def sink(name: str, tensor: torch.Tensor) -> None:
            nonlocal sink_seconds
            t = time.perf_counter()
            data = tensor_bytes(tensor)
            hasher.update(name.encode())
            hasher.update(data)
            counts["bytes"] += len(data)
            counts["tensors"] += 1
            sink_seconds += time.perf_counter() - t  # the tensor is dropped on return

        ready.put(index)
        go.wait()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        transport.fetch(sink, version=PUBLISHES)
        done = time.monotonic()  # CLOCK_MONOTONIC: one clock across processes
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        transport.close()
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        results.put(
            {
                "index": index,
                "done": done,
                "digest": hasher.hexdigest(),
                **counts,
                "sink_s": sink_seconds,
                "cpu_s": cpu,
                "maxrss": cpu1.ru_maxrss * 1024,
            }
        )
    except BaseException as exc:
        results.put({"index": index, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _collect(queue: Any, n: int, procs: list[Any], timeout_s: float) -> list[Any]:
    """``n`` items from ``queue``; fails fast when a fetcher died without reporting."""
    items: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(items) < n:
        try:
            items.append(queue.get(timeout=1.0))
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"fetchers: {len(items)} of {n} reported; exit codes {dead}") from None
    return items


def _reap(procs: list[Any]) -> None:
    """Join the benchmark's processes, terminating (only on an error path) any still running after a minute."""
    for p in procs:
        p.join(timeout=60)
        if p.exitcode is None:
            p.terminate()
            p.join()


def run_fetchers(address: str, data: str, n: int) -> tuple[float, list[dict[str, Any]]]:
    """Start ``n`` fetcher processes, release them together; seconds from the release to the last finish."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_fetcher, args=(address, data, i, ready, go, results)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        _collect(ready, n, procs, timeout_s=120)
        released = time.monotonic()
        go.set()
        out: list[dict[str, Any]] = _collect(results, n, procs, timeout_s=900)
    finally:
        _reap(procs)
    errors = [r["error"] for r in out if "error" in r]
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"fetchers failed: {errors or [p.exitcode for p in procs]}")
    return max(r["done"] for r in out) - released, sorted(out, key=lambda r: r["index"])


# -------------------------------------------------------------------------------------------- collective


def _collective_receiver(spec: dict[str, Any], rank: int, versions: int, results: Any) -> None:
    """A sampler engine's worker: joins the weight group, then takes each version as it is broadcast (the
    control plane would call ``receive`` on the announcement; here the receiver waits in it)."""
    from services.weight_transport.receiver import CollectiveReceiver
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    try:
        group = WeightGroup(GroupSpec(**spec), rank)
        receiver = CollectiveReceiver(group)
        for _ in range(versions):
            version, tensors, _ = receiver.receive()
            done = time.monotonic()  # it holds the whole version, committed by every member
            results.put(
                {
                    "rank": rank,
                    "version": version,
                    "done": done,
                    "digest": digest_of(tensors),
                    "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
                }
            )
            del tensors
        group.close()
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_collective(
    named: list[tuple[str, torch.Tensor]],
    receivers: int,
    bucket_mib: int,
    step_s: float = 1.0,
) -> dict[str, float]:
    """Seconds from the start of a publish until all ``receivers`` processes hold the version (the second
    version: the first is untimed), how long the publisher was blocked in it, and how long it was blocked by a
    background broadcast from its staging buffer (the fourth version; the third allocated the buffer), and the
    seconds from the start of that one until they held it (``staged_seconds``: the learner's publish).
    ``step_s``: the pause before each timed version, as a learner's step between versions."""
    from services.weight_transport.collective import CollectivePublisher
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    spec: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": receivers + 1,
        "backend": "gloo",
        "timeout_s": 300.0,
    }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_collective_receiver, args=(spec, r + 1, 4, results)) for r in range(receivers)
    ]
    for p in procs:
        p.start()
    try:
        group = WeightGroup(GroupSpec(**spec), 0)
        publisher = CollectivePublisher(group, bucket_bytes=bucket_mib * MiB)
        specs = [TensorSpec.of(name, t) for name, t in named]
        publisher.send(1, specs, iter(named))
        _collect(results, receivers, procs, timeout_s=600)
        time.sleep(step_s)
        t0 = time.monotonic()
        stats = publisher.send(2, specs, iter(named))
        blocked = time.monotonic() - t0
        out = _collect(results, receivers, procs, timeout_s=600)
        # in the background from a staging buffer (versions 3 and 4: the first allocates the buffer)
        staged_blocked, staged_out, staged_t0 = [], [], 0.0
        for version in (3, 4):
            time.sleep(step_s)
            staged_t0 = time.monotonic()
            staged_blocked.append(publisher.send_background(version, specs, iter(named)))
            publisher.wait()
            staged_out = _collect(results, receivers, procs, timeout_s=600)
        publisher.close()
        group.close()
    finally:
        _reap(procs)
    errors = [r["error"] for r in out + staged_out if "error" in r]
    if errors:
        raise RuntimeError(f"collective receivers failed: {errors}")
    expected = digest_of(named)
    if any(r["digest"] != expected or r["bytes"] != stats.bytes for r in out + staged_out):
        raise SystemExit(f"{receivers} collective receivers: bytes differ from the published ones")
    return {
        "seconds": max(r["done"] for r in out) - t0,
        "blocked_s": blocked,
        "staged_blocked_s": staged_blocked[-1],
        "staged_seconds": max(r["done"] for r in staged_out) - staged_t0,
    }


# ------------------------------------------------------------------------------------ collective, on devices


def _loading_receiver(spec: dict[str, Any], rank: int, device: str, versions: int, results: Any) -> None:
    """A sampler engine's worker on ``device``, as ``vcpo_collective`` runs it: joins the weight group with its
    device (its GPU under NCCL, into whose buffers each version arrives; ranks sharing a GPU fall back to gloo
    with buffers in host memory; a gloo group given a GPU moves each bucket through the host into buffers on
    it), takes each version as it is broadcast, then loads it into its own model's parameters on ``device``
    (allocated at the first, untimed version): ``param.data.copy_(tensor)`` for each tensor, as vLLM's
    default weight loader does. Reports when it held the version (its device synchronized) and when its model
    did, and whether the version arrived on ``device``."""
    from services.weight_transport.receiver import CollectiveReceiver
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)

        def synchronize() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        group = WeightGroup(GroupSpec(**spec), rank, dev)
        receiver = CollectiveReceiver(group)
        model: list[torch.nn.Parameter] = []
        for _ in range(versions):
            version, tensors, _ = receiver.receive()
            synchronize()
            received = time.monotonic()  # committed by every member, whole in the group's buffers
            on_device = all(t.device == dev for _, t in tensors)
            model = model or [
                torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=dev), requires_grad=False)
                for _, t in tensors
            ]
            for param, (_, tensor) in zip(model, tensors, strict=True):
                param.data.copy_(tensor)
            synchronize()
            done = time.monotonic()
            names = [name for name, _ in tensors]
            del tensors
            results.put(
                {
                    "rank": rank,
                    "version": version,
                    "received": received,
                    "done": done,
                    "digest": digest_of([(n, p.data) for n, p in zip(names, model, strict=True)]),
                    "bytes": sum(p.numel() * p.element_size() for p in model),
                    "on_device": on_device,
                }
            )
        group.close()
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_loading(
    named: list[tuple[str, torch.Tensor]], devices: list[str], backend: str, bucket_mib: int
) -> dict[str, float]:
    """The publisher (this process, its tensors where ``named`` lives; its group's buffers there under NCCL,
    in host memory under gloo) broadcasts 4 versions to one receiver process per entry of ``devices``, each
    loading into its model there. Version 2 (``send``) is timed from the start of the publish until every
    receiver held it (``received_s``) and until every model did (``seconds``); ``load_gbps`` is the slowest
    receiver's load. Versions 3 and 4 go in the background from the staging buffer; ``blocked_s`` is the 4th's
    wait (the 3rd allocates the buffer). Each version differs in its first element, and every receiver's model
    must equal it byte for byte. ``on_device``: 1.0 if every receiver received every version into buffers on
    its own device, 0.0 if any did elsewhere (host memory, where ranks sharing a GPU fell back to gloo)."""
    from services.weight_transport.collective import CollectivePublisher
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    spec: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": len(devices) + 1,
        "backend": backend,
        "timeout_s": 300.0,
    }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_loading_receiver, args=(spec, r + 1, device, 4, results))
        for r, device in enumerate(devices)
    ]
    for p in procs:
        p.start()
    figures: dict[str, float] = {}
    on_device = True
    try:
        here = named[0][1].device
        group = WeightGroup(GroupSpec(**spec), 0, here if backend == "nccl" else None)
        publisher = CollectivePublisher(group, bucket_bytes=bucket_mib * MiB)
        specs = [TensorSpec.of(name, t) for name, t in named]
        for version in range(1, 5):
            named[0][1].view(-1)[0] = float(version)  # every version's bytes differ from the last
            expected = digest_of(named)
            t0 = time.monotonic()
            if version <= 2:
                stats = publisher.send(version, specs, iter(named))
            else:
                figures["blocked_s"] = publisher.send_background(version, specs, iter(named))
                stats = publisher.wait()  # type: ignore[assignment]
            out = _collect(results, len(devices), procs, timeout_s=600)
            errors = [r["error"] for r in out if "error" in r]
            if errors:
                raise RuntimeError(f"receivers failed: {errors}")
            if any(r["digest"] != expected or r["bytes"] != stats.bytes for r in out):
                raise SystemExit(f"version {version}: a receiver's model differs from the published one")
            on_device = on_device and all(r["on_device"] for r in out)
            if version == 2:
                figures["seconds"] = max(r["done"] for r in out) - t0
                figures["received_s"] = max(r["received"] for r in out) - t0
                figures["load_gbps"] = min(stats.bytes / (r["done"] - r["received"]) / 1e9 for r in out)
                figures["bytes"] = float(stats.bytes)
        publisher.close()
        group.close()
    finally:
        _reap(procs)
    figures["on_device"] = float(on_device)
    return figures
