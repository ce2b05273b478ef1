"""How long a sampler's engine stands still while a version arrives through the weight group.

A vLLM engine (the CPU build, in its own process, the tiny model, kept busy with requests) is rank 1 of a
gloo weight group; this process is rank 0 and broadcasts versions of ``size_mib`` (random tensors: they are
received, never loaded). The engine's process runs the sampler loop's part: step the engine, look for an
announcement between steps, and receive it

    thread   as the sampler does: ``begin_receive`` (the worker receives on a thread of its own), then
             ``weight_work_done`` asked between steps until the version is whole
    inline   the receive inside the loop's turn (``begin_receive``, then waiting for ``weight_work_done``):
             what every engine did before the receive had a thread of its own, for comparison

Each step's end and token count are logged. Over a receive's window (the announcement seen → the version
whole), the stall is the sum of the gaps between token-producing steps (the window's ends included) longer
than ``max(0.1 s, 5 x the median step before it)``; ``stall_over_transfer`` = stall / window. The first
version is a warm-up and not reported.

The engine's OpenMP threads are all cores but one, unbound (``OMP_NUM_THREADS``,
``VLLM_CPU_OMP_THREADS_BIND=nobind``): a GPU engine's forward leaves the host's cores to the transfer, and
here the transfer's copying needs one. With the pool on every core of a 2-core machine each step waits at
its barriers for a thread the copies preempted (steps of ~0.27 s against ~5 ms), which is the machine's
stall, not the loop's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from itertools import pairwise
from typing import Any
from unittest import mock

REQUESTS = 16  # kept in the engine at all times
MODES = ("warm-up", "inline", "thread")


def _stall(steps: list[tuple[float, int]], t0: float, t1: float, before: list[float]) -> dict[str, float]:
    """The stall over the window ``[t0, t1]`` given the steps' ``(end, tokens)`` and earlier step lengths."""
    threshold = max(0.1, 5 * statistics.median(before)) if before else 0.1
    points = [t0] + [t for t, n in steps if t0 < t < t1 and n > 0] + [t1]
    gaps = [b - a for a, b in pairwise(points)]
    stalled = sum(g for g in gaps if g > threshold)
    tokens = sum(n for t, n in steps if t0 < t <= t1)
    start = t0 - sum(before)
    tokens_before = sum(n for t, n in steps if start < t <= t0)
    return {
        "window_s": t1 - t0,
        "stall_s": stalled,
        "stall_over_transfer": stalled / (t1 - t0),
        "tokens_per_s": tokens / (t1 - t0),
        "tokens_per_s_before": tokens_before / sum(before) if before else 0.0,
        "threshold_s": threshold,
        "longest_step_s": max((b - a for (a, _), (b, _) in pairwise(steps) if t0 < b <= t1), default=0.0),
    }


def _engine(spec: dict[str, Any], model_dir: str, out: Any) -> None:
    """The sampler's side, in its own process: the engine, its loop, and the receives (see the module)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from services.sampler.engine import Sampling, VllmEngine, VllmSettings
        from services.weight_transport.weight_group import AnnouncementWatch, GroupSpec

        engine = VllmEngine(
            VllmSettings(
                model=model_dir,
                dtype="float32",
                max_model_len=256,
                kv_cache_memory_bytes=64 << 20,
                enforce_eager=True,
                collective_weights=True,
            )
        )
        sampling = Sampling(temperature=1.0, max_tokens=200, seed=0)
        prompt = engine.tokenizer.encode("Count from one to one hundred: one, two,")
        out.put(("built", None))
        engine.begin_join({**spec, "rank_offset": 1})
        while not engine.weight_work_done():
            time.sleep(0.005)
        watch = AnnouncementWatch.of(GroupSpec(**spec))
        running, added = 0, 0
        steps: list[tuple[float, int]] = []
        results: dict[str, dict[str, float]] = {}
        receiving: tuple[str, int, float] | None = None  # (mode, version, window start)
        while len(results) < len(MODES):
            while running < REQUESTS:
                engine.add(f"r{added}", prompt, sampling)
                running, added = running + 1, added + 1
            deltas = engine.step()
            steps.append((time.monotonic(), sum(len(d.token_ids) for d in deltas)))
            running -= sum(1 for d in deltas if d.finish_reason)
            if receiving is None:
                version = watch.next(0)
                if version is None:
                    continue
                mode, t0 = MODES[len(results)], time.monotonic()
                engine.begin_receive(version)
                if mode != "inline":
                    receiving = (mode, version, t0)
                    continue
                while not engine.weight_work_done():  # the loop's turn holds the whole receive
                    time.sleep(0.005)
            elif engine.weight_work_done():
                mode, version, t0 = receiving
                receiving = None
            else:
                continue
            t1 = time.monotonic()
            before = [b - a for (a, _), (b, _) in pairwise(steps) if b <= t0][-200:]
            results[mode] = {**_stall(steps, t0, t1, before), "steps_before": len(before)}
            out.put(("received", version))
        engine.close()
        out.put(("done", results))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def run_stall(named: list[tuple[str, Any]], step_s: float = 2.0) -> dict[str, dict[str, float]]:
    """Broadcast ``named`` (one version per mode) to an engine in its own process; per mode: the window, the
    stall and the tokens per second while receiving. ``step_s``: the engine's steps between versions."""
    from services.common.ports import free_port
    from services.common.tiny_model import build_tiny_model
    from services.weight_transport.collective import CollectivePublisher
    from services.weight_transport.tensors import TensorSpec
    from services.weight_transport.weight_group import GroupSpec, WeightGroup

    spec: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 300.0,
        "form_timeout_s": 120.0,
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        model_dir = str(build_tiny_model(os.path.join(tmp, "model")))
        proc = ctx.Process(target=_engine, args=(spec, model_dir, out))
        threads = {
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1)),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }
        with mock.patch.dict(os.environ, threads):  # the spawned process starts with them
            proc.start()
        try:

            def expect(what: str) -> Any:
                kind, value = out.get(timeout=600)
                if kind != what:
                    raise RuntimeError(f"the engine's process: {value}" if kind == "error" else kind)
                return value

            expect("built")
            group = WeightGroup(GroupSpec(**spec), 0)
            publisher = CollectivePublisher(group)
            specs = [TensorSpec.of(name, t) for name, t in named]
            for version in range(1, len(MODES) + 1):
                time.sleep(step_s)
                publisher.send(version, specs, iter(named))
                if expect("received") != version:
                    raise RuntimeError(f"the engine received another version than {version}")
            results: dict[str, dict[str, float]] = expect("done")
            publisher.close()
            group.close()
        finally:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    del results["warm-up"]
    return results
