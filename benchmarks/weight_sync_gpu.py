"""Weight sync on GPUs: the collective transport's device paths, timed until every receiver's model holds the
version, beside what the hardware moves in one process.

The publisher is this process (the learner's rank 0), its model (float32, laid out like a transformer, as in
weight_sync.py) on ``cuda:0``. Each receiver is a process standing for one sampler engine's worker: it joins
the weight group with its device as ``vcpo_collective`` does, receives each version into buffers on the
group's device, and loads it into its own model's parameters on its GPU (``param.data.copy_`` per tensor, as
vLLM's default weight loader does in the engine's ``reload_weights``). Paths, by the GPUs there are:

    shared_gpu     every receiver on cuda:0 beside the publisher, as when a learner and samplers are given
                   fractions of one GPU: NCCL refuses two ranks on one GPU, so the epoch falls back to gloo
                   with buffers in host memory, and each receiver loads host to device (always run)
    gloo_into_gpu  one receiver on cuda:0 in a gloo group given that GPU: gloo moves each bucket through the
                   host into buffers on the receiver's GPU, which it loads device to device (always run: the
                   receive into a GPU where there is only one; no deployment runs it)
    nccl           receivers on cuda:1.. (one each; at most the GPUs there are, less one): NCCL from cuda:0
                   into buffers on each receiver's GPU, loaded device to device (two or more GPUs)

Each path runs with 1, 2 and 4 receivers (fewer where the GPUs run out; ``gloo_into_gpu`` with 1). Version 2 is
timed from the start of the publish until every model holds it; versions 3 and 4 go in the background from the
staging buffer and the publisher's wait for the 4th is reported. Every receiver's model must equal each
version byte for byte, and every version must arrive on the device the path says (the GPU, or host memory for
``shared_gpu``). The hardware's figures, in this process: the model's bytes device to page-locked host and back
(``host_round_trip_gbps``) and device to device in one copy (``device_copy_gbps``).

``--device cpu`` runs the same processes on CPU (``sockets``: gloo over loopback) so this script is tested
where no GPU is; its figures say nothing about GPUs.

Headline figures (the JSON object on the last line), at 1 receiver unless named; GB/s are 10**9 bytes/s:

    receive_into_gpu_gbps  model bytes / seconds from the start of a publish until the receiver held it whole
                           in buffers on its GPU: ``nccl``'s with two GPUs or more, else ``gloo_into_gpu``'s
                           (``receive_into_gpu_path`` names it)
    load_gbps              that path's load: model bytes / seconds the receiver took to copy them from its
                           receive buffers into its model's parameters, device to device;
                           load_over_device_copy: over device_copy_gbps
    <path>_gbps            model bytes / seconds from the start of a publish until the receiver's model holds
                           it; <path>_received_gbps: until it held it in its group's buffers (before its load)
    <path>_load_gbps       the slowest receiver's load into its model
    <path>_N_over_1        N receivers' seconds over one's (target <= 1.3: flat in receivers)
    <path>_blocked_s       the publisher's wait for a background broadcast (the learner's step overlaps the rest)
    shared_gpu_over_round_trip   shared_gpu_gbps / host_round_trip_gbps

    python benchmarks/weight_sync_gpu.py [--quick] [--size-mib 2048] [--device cuda] [--paths PATH ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks._weight_sync_workers import MiB, build_model, run_loading


def hardware(nbytes: int, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` GB/s of copying ``nbytes`` in this process: device to page-locked host, back, and
    device to device (on CPU: host to host)."""

    def best(copy: Any) -> float:
        seconds = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            copy()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        return nbytes / min(seconds) / 1e9

    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(source)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = best(lambda: host.copy_(source, non_blocking=True))
    h2d = best(lambda: source.copy_(host, non_blocking=True))
    d2d = best(lambda: other.copy_(source))
    return {
        "device_to_host_gbps": d2h,
        "host_to_device_gbps": h2d,
        "host_round_trip_gbps": 1 / (1 / d2h + 1 / h2d),
        "device_copy_gbps": d2d,
    }


class Run(NamedTuple):
    """One path: its group's backend (an NCCL epoch whose ranks share a GPU falls back to gloo), the receivers'
    devices for each count, and whether each version must arrive in buffers on the receivers' own devices
    (else in host memory: the fallback's)."""

    backend: str
    devices: list[list[str]]
    into_device: bool


def paths(device: torch.device, receivers: list[int]) -> dict[str, Run]:
    """The paths this machine runs, by name."""
    if device.type == "cpu":
        return {"sockets": Run("gloo", [["cpu"] * n for n in receivers], True)}
    out = {
        "shared_gpu": Run("nccl", [[str(device)] * n for n in receivers], False),
        "gloo_into_gpu": Run("gloo", [[str(device)]], True),
    }
    others = [f"cuda:{i}" for i in range(torch.cuda.device_count()) if i != (device.index or 0)]
    if others:
        out["nccl"] = Run("nccl", [others[:n] for n in receivers if n <= len(others)], True)
    return out


def receive_into_gpu(figures: dict[str, Any]) -> dict[str, Any]:
    """The headline receive into a GPU and load, from the paths ``figures`` holds: NCCL's where it ran (two
    GPUs or more), else gloo's into the one GPU; nothing where neither ran (CPU, or ``--paths``)."""
    path = next((p for p in ("nccl", "gloo_into_gpu") if f"{p}_received_gbps" in figures), None)
    if path is None:
        return {}
    load = figures[f"{path}_load_gbps"]
    return {
        "receive_into_gpu_path": path,
        "receive_into_gpu_gbps": figures[f"{path}_received_gbps"],
        "load_gbps": load,
        "load_over_device_copy": load / figures["device_copy_gbps"],
    }


def report(
    figures: dict[str, Any], path: str, n: int, row: dict[str, float], seconds: dict[int, float]
) -> None:
    """Print ``path``'s row for ``n`` receivers and keep its figures: at 1 receiver its GB/s (and until it was
    received), its load and blocked time; beyond, its seconds over 1 receiver's (``seconds``, by receivers,
    is filled in as the rows come)."""
    nbytes = figures["model_bytes"]
    seconds[n] = row["seconds"]
    print(
        f"{path:<13} {n:>9} {row['received_s']:>8.3f} {row['seconds']:>9.3f} "
        f"{nbytes / row['seconds'] / 1e9:>7.2f} {row['load_gbps']:>10.2f} {row['blocked_s']:>10.3f}",
        flush=True,
    )
    if n > 1:
        figures[f"{path}_{n}_over_1"] = seconds[n] / seconds[1]
        return
    figures[f"{path}_gbps"] = nbytes / row["seconds"] / 1e9
    figures[f"{path}_received_gbps"] = nbytes / row["received_s"] / 1e9
    figures[f"{path}_load_gbps"] = row["load_gbps"]
    figures[f"{path}_blocked_s"] = row["blocked_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 and 2 receivers (seconds)")
    parser.add_argument("--size-mib", type=int, default=2048, help="model size in MiB (default 2048)")
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4], help="receivers per run")
    parser.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size")
    parser.add_argument("--device", default="cuda", help="the publisher's device: cuda (cuda:0) or cpu")
    parser.add_argument("--paths", nargs="+", help="only these paths (default: every one this machine runs)")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.receivers = 16, [1, 2]
    if sorted(set(args.receivers)) != args.receivers or args.receivers[0] != 1:
        raise SystemExit(f"--receivers must rise from 1 without repeats, got {args.receivers}")
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU here (--device cpu runs the same processes on CPU)")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise SystemExit(f"--device must be cuda or cpu, got {args.device!r}")

    named = [(name, t.to(device)) for name, t in build_model(args.size_mib * MiB)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    figures: dict[str, Any] = {"device": device.type, "model_bytes": nbytes}
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(device)
        figures["gpus"] = torch.cuda.device_count()
    figures.update(hardware(nbytes, device))
    print(
        f"{args.size_mib} MiB model ({len(named)} tensors) on {device}: device to host "
        f"{figures['device_to_host_gbps']:.1f} GB/s, host to device {figures['host_to_device_gbps']:.1f}, "
        f"round trip {figures['host_round_trip_gbps']:.1f}, device copy {figures['device_copy_gbps']:.1f}"
    )
    print(
        f"{'path':<13} {'receivers':>9} {'held s':>8} {'loaded s':>9} {'GB/s':>7} {'load GB/s':>10} {'blocked s':>10}"
    )
    runs = paths(device, args.receivers)
    unknown = sorted(set(args.paths or []) - set(runs))
    if unknown:
        raise SystemExit(f"--paths: {unknown} not among {sorted(runs)} on this machine")
    for path, run in runs.items():
        if args.paths and path not in args.paths:
            continue
        seconds: dict[int, float] = {}
        for devices in run.devices:
            n = len(devices)
            row = run_loading(named, devices, run.backend, args.bucket_mib)
            if row["on_device"] != float(run.into_device):
                where = "host memory" if run.into_device else "their own devices"
                raise SystemExit(f"{path}: {n} receiver(s) received versions in {where}")
            report(figures, path, n, row, seconds)
    if "shared_gpu_gbps" in figures:
        figures["shared_gpu_over_round_trip"] = figures["shared_gpu_gbps"] / figures["host_round_trip_gbps"]
    figures.update(receive_into_gpu(figures))
    if "receive_into_gpu_gbps" in figures:
        print(
            f"into a GPU ({figures['receive_into_gpu_path']}): received {figures['receive_into_gpu_gbps']:.2f} "
            f"GB/s, loaded {figures['load_gbps']:.2f} GB/s ({figures['load_over_device_copy']:.3f} of a device "
            "copy)"
        )
    print("every receiver's model equals every version it was sent")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
