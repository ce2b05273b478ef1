"""Seconds from a learner's publish until a sampler's engine serves the version: an adapter version against a full
one, on the same model (``benchmarks/lora.py`` calls :func:`run_publish_to_serve`).

A broker process (benchmarks/weight_sync.py's ``start_broker``) and, in this process, the sampler's vLLM engine
(the CPU build, the engine core in this process) built two ways: with adapter versions (``[learner.lora]``) and
without. For each, ``VERSIONS`` versions in turn, each timed from the start of ``WeightTransport.publish``
through the sampler's path (``transport.fetch`` into ``engine.stage``, then ``prepare`` and ``apply``) to the end
of ``apply``; then a greedy request checks the engine serves the version (its tokens differ from the previous
version's). The first version of each is a warm-up and not reported; the figure is the median of the others.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

VERSIONS = 4  # the first is a warm-up


def _engine(model_dir: Path, adapter: Any) -> Any:
    from services.sampler.engine import VllmEngine, VllmSettings

    return VllmEngine(
        VllmSettings(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            adapter=adapter,
        )
    )


def _versions(
    model_dir: Path, shapes: dict[str, tuple[int, ...]], adapter: bool
) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    if adapter:
        return [{n: 0.05 * torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(VERSIONS)]
    base = load_file(str(model_dir / "model.safetensors"))
    return [
        {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()} for _ in range(VERSIONS)
    ]


def _serve_times(model_dir: Path, lora: Any, address: str, data: str, adapter: bool) -> dict[str, Any]:
    from services.sampler.engine import Sampling
    from services.weight_transport.tensors import TensorSpec
    from services.weight_transport.transport import WeightTransport

    with mock.patch.dict(os.environ, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        engine = _engine(model_dir, lora if adapter else None)
    transport = WeightTransport(address, data)
    prompt = engine.tokenizer.encode("12+7=")
    seconds, served, nbytes = [], [], 0
    offset = (
        VERSIONS if adapter else 0
    )  # the full versions are published first; the broker takes newer ones only
    try:
        for i, weights in enumerate(_versions(model_dir, engine.expected, adapter)):
            version = offset + i + 1
            specs = [TensorSpec.of(n, t) for n, t in weights.items()]
            nbytes = sum(s.nbytes for s in specs)
            t0 = time.perf_counter()
            transport.publish(version, specs, weights.items)
            transport.fetch(engine.stage(version), version)
            engine.prepare(version)
            engine.apply(version)
            seconds.append(time.perf_counter() - t0)
            engine.add(f"r{version}", prompt, Sampling(temperature=0.0, max_tokens=8))
            tokens: list[int] = []
            while engine.has_unfinished():
                for delta in engine.step():
                    tokens += delta.token_ids
            served.append(tokens)
    finally:
        transport.close()
        engine.close()
    if len({tuple(t) for t in served}) < 2:
        raise SystemExit(f"every {'adapter' if adapter else 'full'} version generated the same tokens")
    return {"bytes": nbytes, "seconds": seconds[1:], "median_s": statistics.median(seconds[1:])}


def run_publish_to_serve(model_dir: Path, lora: Any) -> dict[str, Any]:
    """``adapter`` and ``full`` rows (version bytes, each timed version's seconds, their median) and
    ``serve_time_over_full``: the adapter's median over the full version's."""
    from benchmarks.weight_sync import start_broker

    with tempfile.TemporaryDirectory(prefix="publish-to-serve-") as tmp:
        broker, address, data = start_broker(Path(tmp))
        try:
            rows = {
                name: _serve_times(model_dir, lora, address, data, name == "adapter")
                for name in ("full", "adapter")
            }
        finally:
            broker.stop()
    rows["serve_time_over_full"] = rows["adapter"]["median_s"] / rows["full"]["median_s"]
    return rows
