"""Weight sync through the broker: publish, one fetch and concurrent fetches, against a raw loopback socket.

For each model size (float32, a transformer-like list of tensors: embedding, 4 layers of qkv / o / up / down
projections with their norms, final norm, lm_head; the largest tensors are 64 MiB at 1 GiB) one run does:

    socket     a receiver process reads the same number of bytes with recv_into into a preallocated
               buffer; this process sends every tensor's bytes with sendall from a memoryview. The
               ceiling for moving these bytes between two processes on this machine (best of
               --socket-repeats connections, i.e. the most favourable figure for the socket).
    broker     a fresh ``python -m services.weight_broker`` process (memory storage, retain 1) per size,
               so its peak RSS (VmHWM) is the peak of that size; its RSS after start-up is the baseline.
    publish    this process publishes versions 1, 2, 3 (tensors built once, seed 0) through WeightTransport (the
               broker's TCP data plane). Version 3 is timed as
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

    broker_over_socket    min(steady publish GB/s, single-fetch GB/s) / socket GB/s (target >= 0.5);
                          first_publish_over_socket: the first publish into a fresh broker
    peak_rss_over_model   (broker VmHWM - broker RSS after start-up) / model bytes, the peak over the
                          broker's whole life: the publishes (a version is retained until the next one
                          commits, so two are held at once), the single fetch and the fan-out (target <= 2.5)

    collective_over_socket   the collective transport (gloo) to one receiver process, from the start of a
                          publish until it holds the version, against the socket (target >= 0.7);
                          collective_staged_over_socket: as the learner publishes, copied into the staging
                          buffer (the learner's wait) and broadcast from it in the background
    collective_N_over_1   N receivers' seconds over one's (no target: on one host every receiver's loopback
                          bytes cost the same cores; flatness in receivers is NCCL's across nodes)

    generation_stall_over_transfer   the seconds a vLLM engine (the tiny model, kept busy) produced no tokens
                          while it received a --stall-mib version through the weight group, over the receive's
                          seconds (target <= 0.2); generation_stall_inline_over_transfer: the same with the
                          receive inside the sampler loop's turn, side by side (benchmarks/_generation_stall.py)

Sizes are MiB (2**20 bytes); throughputs are GB/s (10**9 bytes/s).

    python benchmarks/weight_sync.py [--quick] [--sizes 64 256 1024] [--fetchers 4] [--repeats 1]
                                     [--stall-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

# the model, the socket receiver, the fetchers and the collective receivers: the processes this script times
from benchmarks._generation_stall import run_stall
from benchmarks._weight_sync_workers import (
    PUBLISHES,
    MiB,
    build_model,
    digest_of,
    run_collective,
    run_fetchers,
    socket_gbps,
)
from services.common.memory import ALLOCATOR_ENV
from services.common.ports import free_port
from services.common.service_process import ServiceProcess
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transport import WeightTransport

TARGET_BROKER_OVER_SOCKET = 0.5
TARGET_PEAK_RSS_OVER_MODEL = 2.5
TARGET_COLLECTIVE_OVER_SOCKET = 0.7
TARGET_GENERATION_STALL_OVER_TRANSFER = 0.2


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


# ------------------------------------------------------------------------------------------------- cases


def run_size(
    size_mib: int, fetchers: int, named: list[tuple[str, torch.Tensor]], socket: float
) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    expected = digest_of(named)
    row: dict[str, Any] = {
        "size_mib": size_mib,
        "bytes": nbytes,
        "tensors": len(named),
        "largest_tensor_mib": max(t.numel() * 4 for _, t in named) / MiB,
    }
    row["socket_gbps"] = socket

    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        broker, address, data = start_broker(Path(tmp))
        try:
            time.sleep(0.5)  # let start-up settle before the baseline
            row["rss_base"] = proc_status(broker.pid)["VmRSS"]
            publisher = WeightTransport(address, data)
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
                seconds, out = run_fetchers(address, data, n)
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


def timed(named: list[tuple[str, torch.Tensor]], n: int, args: Any) -> dict[str, float]:
    """:func:`run_collective` to ``n`` receivers, ``args.repeats`` times: the median of each figure."""
    runs = [run_collective(named, n, args.bucket_mib, step_s=args.step_s) for _ in range(args.repeats)]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 and 32 MiB with 2 fetchers (seconds)")
    parser.add_argument("--sizes", type=int, nargs="+", help="model sizes in MiB (default 64 256 1024)")
    parser.add_argument("--fetchers", type=int, default=0, help="concurrent fetchers (default 4; quick: 2)")
    parser.add_argument("--socket-repeats", type=int, default=3, help="socket copies per size (best is kept)")
    parser.add_argument(
        "--receivers",
        type=int,
        nargs="+",
        help="collective receiver processes per run, the first being the 1 of collective_N_over_1 "
        "(default 1 2 4; quick: 1 2, at the largest size only)",
    )
    parser.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="collective: runs of each case, its figures the medians (this machine is shared and noisy)",
    )
    parser.add_argument(
        "--step-s",
        type=float,
        help="collective: the pause before each timed version (a learner's step between versions; default 1, "
        "quick: 0.1)",
    )
    parser.add_argument(
        "--stall-mib",
        type=int,
        help="the version an engine receives while generating (default 1024; quick: 128; 0: not measured)",
    )
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
    args.step_s = args.step_s if args.step_s is not None else (0.1 if args.quick else 1.0)

    rows = []
    collective: dict[int, dict[int, dict[str, float]]] = {}
    for size in sizes:
        named = build_model(size * MiB)
        socket = socket_gbps(named, args.socket_repeats)
        rows.append(run_size(size, fetchers, named, socket))
        print(f"# {size} MiB through the broker done", file=sys.stderr, flush=True)
        if size == sizes[-1] or not args.quick:
            collective[size] = {n: timed(named, n, args) for n in args.receivers}
            print(f"# {size} MiB collective done", file=sys.stderr, flush=True)
        del named
    stall_mib = args.stall_mib if args.stall_mib is not None else (128 if args.quick else 1024)
    stall = run_stall(build_model(stall_mib * MiB), step_s=args.step_s * 2) if stall_mib else {}
    print(f"# {stall_mib} MiB received while generating done", file=sys.stderr, flush=True)

    n = fetchers
    allocator = "default glibc allocator" if args.default_allocator else "service allocator settings"
    print(
        f"float32 model, broker in memory storage; {n} concurrent fetchers; GB/s = 1e9 bytes/s; "
        f"{os.cpu_count()} CPUs; {allocator}"
    )
    print(
        f"{'MiB':>5} {'tensors':>7} {'socket':>7} {'1st pub':>7} {'publish':>7} {'fetch':>7} {f'{n}x agg':>7} "
        f"{'base':>6} {'+pub':>6} {'peak':>6} {'peak-base':>9}"
    )
    print(
        f"{'':>5} {'':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'GB/s':>7} {'MiB':>6} {'MiB':>6} "
        f"{'MiB':>6} {'/ model':>9}"
    )
    for r in rows:
        print(
            f"{r['size_mib']:>5} {r['tensors']:>7} {r['socket_gbps']:>7.2f} "
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
        f"{'MiB':>5} {'pub s':>6} {'pubCPU':>6} {'brkCPU':>6} | {'fetch s':>7} {'brkCPU':>6} {'fchCPU':>6} "
        f"{'sink':>5} | {f'{n}x s':>6} {'brkCPU':>6} {'fchCPU':>6} | {'HWM pub':>7} {'fetch':>6} {f'{n}x':>6}"
    )
    for r in rows:
        print(
            f"{r['size_mib']:>5} {r['publish_s']:>6.2f} {r['publisher_cpu_s']:>6.2f} "
            f"{r['broker_cpu_publish_s']:>6.2f} | {r['fetch_s']:>7.2f} {r['broker_cpu_fetch_s']:>6.2f} "
            f"{r['fetch_fetcher_cpu_s']:>6.2f} {r['fetch_sink_s']:>5.2f} | {r['fanout_s']:>6.2f} "
            f"{r['broker_cpu_fanout_s']:>6.2f} {r['fanout_fetcher_cpu_s']:>6.2f} | "
            f"{r['hwm_after_publish'] / MiB:>7.0f} {r['hwm_after_fetch'] / MiB:>6.0f} {r['hwm_after_fanout'] / MiB:>6.0f}"
        )
    print("all fetchers' digests equal the publisher's")
    print(
        f"collective (gloo, {args.bucket_mib} MiB buckets): seconds from the start of a publish until every "
        "receiver holds the version; blocked: the publisher's wait in it; staged: its wait when it copies into a "
        "staging buffer and broadcasts in the background (as the learner publishes), and until one receiver "
        "held that version; the broker path: publish + fetch (1) or publish + fan-out"
    )
    print(
        f"{'MiB':>5} " + " ".join(f"{f'{n} recv s':>9}" for n in args.receivers) + f" {'1 GB/s':>7} "
        f"{'blocked s':>9} {'staged s':>8} {'1 recv, staged s':>16} {'broker 1':>8} {f'broker {n}':>9}"
    )
    for size in collective:
        c = collective[size]
        r = next(r for r in rows if r["size_mib"] == size)
        first = c[args.receivers[0]]
        print(
            f"{size:>5} "
            + " ".join(f"{c[n]['seconds']:>9.2f}" for n in args.receivers)
            + f" {r['bytes'] / first['seconds'] / 1e9:>7.2f} {first['blocked_s']:>9.2f} {first['staged_blocked_s']:>8.2f} "
            f"{first['staged_seconds']:>16.2f} {r['publish_s'] + r['fetch_s']:>8.2f} {r['publish_s'] + r['fanout_s']:>9.2f}"
        )
    print("all collective receivers' digests equal the publisher's")

    if stall:
        print(
            f"a vLLM engine generating while it receives a {stall_mib} MiB version (gloo): the receive's seconds, "
            "the seconds it produced no tokens in them, and its tokens/s then"
        )
        for mode, r in stall.items():
            print(
                f"  {mode:<6} receive {r['window_s']:.2f} s, stalled {r['stall_s']:.2f} s "
                f"({r['stall_over_transfer']:.2f}), {r['tokens_per_s']:.0f} tokens/s "
                f"({r['tokens_per_s_before']:.0f} before it)"
            )

    largest = max(r["size_mib"] for r in rows)
    big = next(r for r in rows if r["size_mib"] == largest)

    def over_socket(r: dict[str, Any]) -> float:
        return min(r["publish_gbps"], r["fetch_gbps"]) / r["socket_gbps"]

    ratio = over_socket(big)
    peak = big["peak_over_model"]
    coll = collective[largest]
    one, many = args.receivers[0], args.receivers[-1]
    collective_gbps = big["bytes"] / coll[one]["seconds"] / 1e9
    headline = {
        "collective_over_socket": round(collective_gbps / big["socket_gbps"], 3),
        # the learner's publish: staged (the caller blocked), then broadcast from the staging buffer
        "collective_staged_over_socket": round(
            big["bytes"] / coll[one]["staged_seconds"] / 1e9 / big["socket_gbps"], 3
        ),
        f"collective_{many}_over_{one}": round(coll[many]["seconds"] / coll[one]["seconds"], 3),
        f"broker_{many}_over_{one}": round(
            (big["publish_s"] + big["fanout_s"]) / (big["publish_s"] + big["fetch_s"]), 3
        ),
        "collective_seconds": {str(n): round(c["seconds"], 3) for n, c in coll.items()},
        "learner_blocked_s_per_version": round(coll[one]["staged_blocked_s"], 3),
        "learner_blocked_s_without_staging": round(coll[one]["blocked_s"], 3),
        "broker_learner_blocked_s_per_version": round(big["publish_s"], 3),
        "target_collective_over_socket": TARGET_COLLECTIVE_OVER_SOCKET,
        **(
            {
                "generation_stall_over_transfer": round(stall["thread"]["stall_over_transfer"], 3),
                "generation_stall_inline_over_transfer": round(stall["inline"]["stall_over_transfer"], 3),
                "generation_stall_receive_s": round(stall["thread"]["window_s"], 3),
                "generation_stall_inline_receive_s": round(stall["inline"]["window_s"], 3),
                "generation_stall_mib": stall_mib,
                "meets_generation_stall_over_transfer": stall["thread"]["stall_over_transfer"]
                <= TARGET_GENERATION_STALL_OVER_TRANSFER,
            }
            if stall
            else {}
        ),
        "target_generation_stall_over_transfer": TARGET_GENERATION_STALL_OVER_TRANSFER,
        "broker_over_socket": round(ratio, 3),
        "broker_over_socket_basis": "min(steady publish, single fetch) / socket, largest size",
        "publish_over_socket": round(big["publish_gbps"] / big["socket_gbps"], 3),
        "first_publish_over_socket": round(big["first_publish_gbps"] / big["socket_gbps"], 3),
        "fetch_over_socket": round(big["fetch_gbps"] / big["socket_gbps"], 3),
        "fanout_over_socket": round(big["fanout_gbps"] / big["socket_gbps"], 3),
        "peak_rss_over_model": round(peak, 3),
        "peak_rss_basis": "largest size",
        "largest_mib": largest,
        "fetchers": n,
        "target_broker_over_socket": TARGET_BROKER_OVER_SOCKET,
        "target_peak_rss_over_model": TARGET_PEAK_RSS_OVER_MODEL,
        "meets_broker_over_socket": ratio >= TARGET_BROKER_OVER_SOCKET,
        "meets_peak_rss_over_model": peak <= TARGET_PEAK_RSS_OVER_MODEL,
        "per_size": {
            str(r["size_mib"]): {
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
