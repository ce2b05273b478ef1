"""Weight sync through the broker: publish, one fetch and concurrent fetches, against a raw loopback socket.

For each model size (float32, a transformer-like list of tensors: embedding, 4 layers of qkv / o / up / down
projections with their norms, final norm, lm_head; the largest tensors are 64 MiB at 1 GiB) one run does:

    socket     a receiver process reads the same number of bytes with recv_into into a preallocated
               buffer; this process sends every tensor's bytes with sendall from a memoryview. The
               ceiling for moving these bytes between two processes on this machine (best of
               --socket-repeats connections, i.e. the most favourable figure for the socket).
    broker     a fresh ``python -m services.weight_broker`` process (memory storage, retain 1) per size,
               so its peak RSS (VmHWM) is the peak of that size; its RSS after start-up is the baseline.
    publish    this process publishes versions 1, 2, 3 (tensors built once, seed 0) through each --transports
               client, a fresh broker per transport: ``tcp`` (TcpTransport: the broker's TCP data plane,
               the default transport) and ``grpc`` (GrpcTransport: gRPC streaming). Version 3 is timed as
               the steady state: with retain 1 it lands in the memory version 1 freed, as every publish of a
               running learner does, while a fresh broker's first publishes also pay the kernel for new
               pages (reported as "first"). The socket's receiver writes into a buffer it touched before, too.
    fetch      one fetcher process runs transport.fetch(sink) of version 3, released by an Event once
               connected and after one untimed fetch (a sampler's buffers are warm after its first version).
    fan-out    --fetchers processes fetch version 1 together, released by one Event; timed from the
               release until the last finishes; aggregate = fetchers x bytes / that time.

Every fetcher's sink hashes each tensor (xxh3_128 over name and bytes, in order) and drops it, so no fetcher
keeps a copy of the model; the hashing is inside the timed path (a sampler copies each tensor into its
model at about the same cost) and its seconds are reported. The digests of all fetchers must equal the
publisher's, or the run exits non-zero. Broker CPU seconds per phase come from /proc/<pid>/stat.

Headline figures (the JSON object on the last line), at the largest size measured:

    broker_over_socket    min(steady publish GB/s, single-fetch GB/s) / socket GB/s over the first
                          --transports (tcp by default; target >= 0.5); <transport>_over_socket for each;
                          first_publish_over_socket: the first publish into a fresh broker
    peak_rss_over_model   (broker VmHWM - broker RSS after start-up) / model bytes, the peak over the
                          broker's whole life: the publishes (a version is retained until the next one
                          commits, so two are held at once), the single fetch and the fan-out (target <= 2.5)

Sizes are MiB (2**20 bytes); throughputs are GB/s (10**9 bytes/s).

    python benchmarks/weight_sync.py [--quick] [--sizes 64 256 1024] [--fetchers 4]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import xxhash

from services.common.memory import ALLOCATOR_ENV
from services.common.redis_server import free_port
from services.common.service_process import ServiceProcess
from services.weight_broker.tensors import TensorSpec, tensor_bytes
from services.weight_broker.transports import GrpcTransport, TcpTransport, WeightTransport

MiB = 1 << 20
TARGET_BROKER_OVER_SOCKET = 0.5
PUBLISHES = 3  # the last one is timed as the steady state
TARGET_PEAK_RSS_OVER_MODEL = 2.5
TARGET_COLLECTIVE_OVER_SOCKET = 0.8
TARGET_COLLECTIVE_N_OVER_1 = 1.3
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


# ----------------------------------------------------------------------------------------------- broker


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_broker(run_dir: Path) -> tuple[ServiceProcess, str, str]:
    """A broker process on free ports (memory storage, retain 1), healthy; its gRPC and data-plane addresses."""
    port, data_port = free_port(), free_port()
    broker = ServiceProcess(
        "broker",
        "services.weight_broker",
        [
            "--set",
            f"weight_broker.grpc_port={port}",
            "--set",
            "weight_broker.metrics_port=0",
            "--set",
            f"weight_broker.data_port={data_port}",
            "--set",
            "weight_broker.storage=memory",
            "--set",
            "weight_broker.retain_versions=1",
            "--set",
            f"run.run_dir={run_dir}",
            "--set",
            "run.redis_url=",
        ],
        run_dir / "broker.log",
        env=dict(os.environ),  # main() decided whether the allocator settings are in it
    )
    address = f"127.0.0.1:{port}"
    try:
        broker.wait_healthy(address, "", timeout_s=60)
    except (RuntimeError, TimeoutError):
        broker.stop()
        raise RuntimeError(f"the broker did not come up:\n{broker.log_path.read_text()[-2000:]}") from None
    return broker, address, f"127.0.0.1:{data_port}"


def client(transport: str, address: str, data_address: str) -> WeightTransport:
    if transport == "tcp":
        return TcpTransport(address, data_address)
    return GrpcTransport(address)


# ---------------------------------------------------------------------------------------------- fetchers


def _fetcher(kind: str, address: str, data: str, index: int, ready: Any, go: Any, results: Any) -> None:
    try:
        transport = client(kind, address, data)
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


def run_fetchers(kind: str, address: str, data: str, n: int) -> tuple[float, list[dict[str, Any]]]:
    """Start ``n`` fetcher processes, release them together; seconds from the release to the last finish."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_fetcher, args=(kind, address, data, i, ready, go, results)) for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        _collect(ready, n, procs, timeout_s=120)
        released = time.monotonic()
        go.set()
        out: list[dict[str, Any]] = _collect(results, n, procs, timeout_s=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:  # only on an error path: this fetcher is ours, stopped by its handle
                p.terminate()
                p.join()
    errors = [r["error"] for r in out if "error" in r]
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"fetchers failed: {errors or [p.exitcode for p in procs]}")
    return max(r["done"] for r in out) - released, sorted(out, key=lambda r: r["index"])


# -------------------------------------------------------------------------------------------- collective


def _collective_receiver(spec: dict[str, Any], rank: int, versions: int, results: Any) -> None:
    """A sampler engine's worker: joins the weight group, then takes each version as it is broadcast (the
    control plane would call ``receive`` on the announcement; here the receiver waits in it)."""
    from services.weight_broker.collective import CollectiveReceiver
    from services.weight_broker.weight_group import GroupSpec, WeightGroup

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
    named: list[tuple[str, torch.Tensor]], receivers: int, bucket_mib: int
) -> dict[str, float]:
    """Seconds from the start of a publish until all ``receivers`` processes hold the version (the second
    version: the first is untimed), how long the publisher was blocked in it, and how long it was blocked by a
    background broadcast from its staging buffer (the fourth version; the third allocated the buffer)."""
    from services.weight_broker.collective import CollectivePublisher
    from services.weight_broker.weight_group import GroupSpec, WeightGroup

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
        t0 = time.monotonic()
        stats = publisher.send(2, specs, iter(named))
        blocked = time.monotonic() - t0
        out = _collect(results, receivers, procs, timeout_s=600)
        # in the background from a staging buffer (versions 3 and 4: the first allocates the buffer)
        staged_blocked = []
        for version in (3, 4):
            staged_blocked.append(publisher.send_background(version, specs, iter(named)))
            publisher.wait()
            _collect(results, receivers, procs, timeout_s=600)
        publisher.close()
        group.close()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.terminate()
                p.join()
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError(f"collective receivers failed: {errors}")
    expected = digest_of(named)
    if any(r["digest"] != expected or r["bytes"] != stats.bytes for r in out):
        raise SystemExit(f"{receivers} collective receivers: bytes differ from the published ones")
    return {
        "seconds": max(r["done"] for r in out) - t0,
        "blocked_s": blocked,
        "staged_blocked_s": staged_blocked[-1],
    }


# ------------------------------------------------------------------------------------------------- cases


def run_size(
    size_mib: int, fetchers: int, named: list[tuple[str, torch.Tensor]], socket: float, kind: str
) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    expected = digest_of(named)
    row: dict[str, Any] = {
        "size_mib": size_mib,
        "bytes": nbytes,
        "tensors": len(named),
        "transport": kind,
        "largest_tensor_mib": max(t.numel() * 4 for _, t in named) / MiB,
    }
    row["socket_gbps"] = socket

    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        broker, address, data = start_broker(Path(tmp))
        try:
            time.sleep(0.5)  # let start-up settle before the baseline
            row["rss_base"] = proc_status(broker.pid)["VmRSS"]
            publisher = client(kind, address, data)
            publisher.latest()  # connected before timing
            specs = [TensorSpec.of(name, t) for name, t in named]
            # versions 1 and 2 are the first publishes into a fresh broker (new memory: page faults); version
            # 3 reuses the memory version 1 freed (retain 1), as every publish of a running learner does
            for version in range(1, PUBLISHES + 1):
                cpu_b, cpu_p = cpu_seconds(broker.pid), resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                result = publisher.publish(version, specs, lambda: iter(named))
                seconds = time.perf_counter() - t0
                cpu_p1 = resource.getrusage(resource.RUSAGE_SELF)
                if version == 1:
                    row["first_publish_gbps"] = nbytes / seconds / 1e9
            publisher.close()
            if result.total_bytes != nbytes:
                raise RuntimeError(f"the broker stored {result.total_bytes} bytes, published {nbytes}")
            row["publish_gbps"] = nbytes / seconds / 1e9
            row["broker_cpu_publish_s"] = cpu_seconds(broker.pid) - cpu_b
            row["publisher_cpu_s"] = (cpu_p1.ru_utime - cpu_p.ru_utime) + (cpu_p1.ru_stime - cpu_p.ru_stime)
            row["publish_s"] = seconds
            status = proc_status(broker.pid)
            row["rss_after_publish"], row["hwm_after_publish"] = status["VmRSS"], status["VmHWM"]

            fetches: list[dict[str, Any]] = []
            for n, key in ((1, "fetch"), (fetchers, "fanout")):
                cpu_b = cpu_seconds(broker.pid)
                seconds, out = run_fetchers(kind, address, data, n)
                row[f"broker_cpu_{key}_s"] = cpu_seconds(broker.pid) - cpu_b
                row[f"{key}_s"] = seconds
                row[f"{key}_gbps"] = n * nbytes / seconds / 1e9
                row[f"{key}_sink_s"] = max(r["sink_s"] for r in out)
                row[f"{key}_fetcher_cpu_s"] = max(r["cpu_s"] for r in out)
                row[f"{key}_fetcher_maxrss"] = max(r["maxrss"] for r in out)
                status = proc_status(broker.pid)
                row[f"hwm_after_{key}"] = status["VmHWM"]
                fetches += [{**r, "phase": key} for r in out]
            row["rss_end"] = status["VmRSS"]
            row["rss_peak"] = status["VmHWM"]
        finally:
            broker.stop()
    bad = [f"{r['phase']}#{r['index']}" for r in fetches if r["digest"] != expected or r["bytes"] != nbytes]
    row["digests_match"] = not bad
    if bad:
        raise SystemExit(f"{size_mib} MiB: fetchers {bad} received bytes that differ from the published ones")
    row["peak_over_model"] = (row["rss_peak"] - row["rss_base"]) / nbytes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 and 32 MiB with 2 fetchers (seconds)")
    parser.add_argument("--sizes", type=int, nargs="+", help="model sizes in MiB (default 64 256 1024)")
    parser.add_argument("--fetchers", type=int, default=0, help="concurrent fetchers (default 4; quick: 2)")
    parser.add_argument("--socket-repeats", type=int, default=3, help="socket copies per size (best is kept)")
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=["tcp", "grpc"],
        default=["tcp", "grpc"],
        help="client transports to measure: the data plane (tcp, the default transport) and gRPC streaming",
    )
    parser.add_argument(
        "--receivers",
        type=int,
        nargs="+",
        help="collective receiver processes per run, the first being the 1 of collective_N_over_1 "
        "(default 1 2 4; quick: 1 2, at the largest size only)",
    )
    parser.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="run the broker and fetchers without the allocator settings services get (services/common/memory.py)",
    )
    args = parser.parse_args()
    if (
        not args.default_allocator
    ):  # the broker and the spawned fetchers start with what a deployment gives them
        os.environ.update(ALLOCATOR_ENV)
    sizes = args.sizes or ([16, 32] if args.quick else [64, 256, 1024])
    fetchers = args.fetchers or (2 if args.quick else 4)
    args.receivers = args.receivers or ([1, 2] if args.quick else [1, 2, 4])

    rows = []
    collective: dict[int, dict[int, dict[str, float]]] = {}
    for size in sizes:
        named = build_model(size * MiB)
        socket = socket_gbps(named, args.socket_repeats)
        for kind in args.transports:
            rows.append(run_size(size, fetchers, named, socket, kind))
            print(f"# {size} MiB over {kind} done", file=sys.stderr, flush=True)
        if size == sizes[-1] or not args.quick:
            collective[size] = {n: run_collective(named, n, args.bucket_mib) for n in args.receivers}
            print(f"# {size} MiB collective done", file=sys.stderr, flush=True)
        del named

    n = fetchers
    allocator = "default glibc allocator" if args.default_allocator else "service allocator settings"
    print(
        f"float32 model, broker in memory storage; {n} concurrent fetchers; GB/s = 1e9 bytes/s; "
        f"{os.cpu_count()} CPUs; {allocator}"
    )
    print(
        f"{'MiB':>5} {'via':>4} {'tensors':>7} {'socket':>7} {'1st pub':>7} {'publish':>7} {'fetch':>7} {f'{n}x agg':>7} "
        f"{'base':>6} {'+pub':>6} {'peak':>6} {'peak-base':>9}"
    )
    print(
        f"{'':>5} {'':>4} {'':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'MiB':>6} {'MiB':>6} "
        f"{'MiB':>6} {'/ model':>9}"
    )
    for r in rows:
        print(
            f"{r['size_mib']:>5} {r['transport']:>4} {r['tensors']:>7} {r['socket_gbps']:>7.2f} "
            f"{r['first_publish_gbps']:>7.2f} {r['publish_gbps']:>7.2f} "
            f"{r['fetch_gbps']:>7.2f} {r['fanout_gbps']:>7.2f} {r['rss_base'] / MiB:>6.0f} "
            f"{(r['rss_after_publish'] - r['rss_base']) / MiB:>6.0f} {r['rss_peak'] / MiB:>6.0f} "
            f"{r['peak_over_model']:>9.2f}"
        )
    print(
        "1st pub: the first publish into a fresh broker; publish: the third (steady state); base: broker RSS "
        "after start-up; +pub: its RSS growth by the publishes; peak: its VmHWM over the publishes, the single "
        "fetch and the fan-out"
    )
    print("where the time goes (CPU seconds; fetcher figures are the slowest fetcher's):")
    print(
        f"{'MiB':>5} {'via':>4} {'pub s':>6} {'pubCPU':>6} {'brkCPU':>6} | {'fetch s':>7} {'brkCPU':>6} {'fchCPU':>6} "
        f"{'sink':>5} | {f'{n}x s':>6} {'brkCPU':>6} {'fchCPU':>6} | {'HWM pub':>7} {'fetch':>6} {f'{n}x':>6}"
    )
    for r in rows:
        print(
            f"{r['size_mib']:>5} {r['transport']:>4} {r['publish_s']:>6.2f} {r['publisher_cpu_s']:>6.2f} "
            f"{r['broker_cpu_publish_s']:>6.2f} | {r['fetch_s']:>7.2f} {r['broker_cpu_fetch_s']:>6.2f} "
            f"{r['fetch_fetcher_cpu_s']:>6.2f} {r['fetch_sink_s']:>5.2f} | {r['fanout_s']:>6.2f} "
            f"{r['broker_cpu_fanout_s']:>6.2f} {r['fanout_fetcher_cpu_s']:>6.2f} | "
            f"{r['hwm_after_publish'] / MiB:>7.0f} {r['hwm_after_fetch'] / MiB:>6.0f} {r['hwm_after_fanout'] / MiB:>6.0f}"
        )
    print("all fetchers' digests equal the publisher's")
    print(
        f"collective (gloo, {args.bucket_mib} MiB buckets): seconds from the start of a publish until every "
        "receiver holds the version; blocked: the publisher's wait in it; staged: its wait when it copies into a "
        "staging buffer and broadcasts in the background; the broker path: publish + fetch (1) or publish + "
        "fan-out"
    )
    print(
        f"{'MiB':>5} " + " ".join(f"{f'{n} recv s':>9}" for n in args.receivers) + f" {'1 GB/s':>7} "
        f"{'blocked s':>9} {'staged s':>8} {'broker 1':>8} {f'broker {n}':>9}"
    )
    for size in collective:
        c = collective[size]
        r = next(r for r in rows if r["size_mib"] == size and r["transport"] == args.transports[0])
        first = c[args.receivers[0]]
        print(
            f"{size:>5} "
            + " ".join(f"{c[n]['seconds']:>9.2f}" for n in args.receivers)
            + f" {r['bytes'] / first['seconds'] / 1e9:>7.2f} {first['blocked_s']:>9.2f} {first['staged_blocked_s']:>8.2f} "
            f"{r['publish_s'] + r['fetch_s']:>8.2f} {r['publish_s'] + r['fanout_s']:>9.2f}"
        )
    print("all collective receivers' digests equal the publisher's")

    largest = max(r["size_mib"] for r in rows)
    at_largest = {r["transport"]: r for r in rows if r["size_mib"] == largest}
    main_kind = args.transports[0]
    big = at_largest[main_kind]

    def over_socket(r: dict[str, Any]) -> float:
        return min(r["publish_gbps"], r["fetch_gbps"]) / r["socket_gbps"]

    ratio = over_socket(big)
    peak = big["peak_over_model"]
    coll = collective[largest]
    one, many = args.receivers[0], args.receivers[-1]
    collective_gbps = big["bytes"] / coll[one]["seconds"] / 1e9
    headline = {
        "collective_over_socket": round(collective_gbps / big["socket_gbps"], 3),
        f"collective_{many}_over_{one}": round(coll[many]["seconds"] / coll[one]["seconds"], 3),
        f"broker_{many}_over_{one}": round(
            (big["publish_s"] + big["fanout_s"]) / (big["publish_s"] + big["fetch_s"]), 3
        ),
        "collective_seconds": {str(n): round(c["seconds"], 3) for n, c in coll.items()},
        "learner_blocked_s_per_version": round(coll[one]["staged_blocked_s"], 3),
        "learner_blocked_s_without_staging": round(coll[one]["blocked_s"], 3),
        "broker_learner_blocked_s_per_version": round(big["publish_s"], 3),
        "target_collective_over_socket": TARGET_COLLECTIVE_OVER_SOCKET,
        "target_collective_n_over_1": TARGET_COLLECTIVE_N_OVER_1,
        "broker_over_socket": round(ratio, 3),
        "broker_over_socket_basis": f"min(steady publish, single fetch) / socket, largest size, {main_kind} transport",
        "transport": main_kind,
        **{f"{k}_over_socket": round(over_socket(r), 3) for k, r in at_largest.items()},
        "publish_over_socket": round(big["publish_gbps"] / big["socket_gbps"], 3),
        "first_publish_over_socket": round(big["first_publish_gbps"] / big["socket_gbps"], 3),
        "fetch_over_socket": round(big["fetch_gbps"] / big["socket_gbps"], 3),
        "fanout_over_socket": round(big["fanout_gbps"] / big["socket_gbps"], 3),
        "peak_rss_over_model": round(peak, 3),
        "peak_rss_basis": f"largest size, {main_kind} transport",
        **{f"{k}_peak_rss_over_model": round(r["peak_over_model"], 3) for k, r in at_largest.items()},
        "largest_mib": largest,
        "fetchers": n,
        "target_broker_over_socket": TARGET_BROKER_OVER_SOCKET,
        "target_peak_rss_over_model": TARGET_PEAK_RSS_OVER_MODEL,
        "meets_broker_over_socket": ratio >= TARGET_BROKER_OVER_SOCKET,
        "meets_peak_rss_over_model": peak <= TARGET_PEAK_RSS_OVER_MODEL,
        "per_size": {
            f"{r['size_mib']}/{r['transport']}": {
                "socket_gbps": round(r["socket_gbps"], 3),
                "publish_gbps": round(r["publish_gbps"], 3),
                "first_publish_gbps": round(r["first_publish_gbps"], 3),
                "fetch_gbps": round(r["fetch_gbps"], 3),
                "fanout_gbps": round(r["fanout_gbps"], 3),
                "broker_peak_rss_mib": round(r["rss_peak"] / MiB, 1),
                "broker_base_rss_mib": round(r["rss_base"] / MiB, 1),
                "peak_rss_over_model": round(r["peak_over_model"], 3),
            }
            for r in rows
        },
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
