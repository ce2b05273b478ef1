"""Run by tests/test_sampler_lora.py in its own process: an engine with adapter versions whose engine core runs
in another process (as on GPU machines). Prints one JSON line: a version loaded (greedy tokens and log-probs),
an in-flight swap to another (which tokens ``quiesce`` handed back before it, which came after), and an adapter
the workers refuse (the error, the version served afterwards and its tokens)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    model_dir, seed_a, seed_b, seed_c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import tempfile
    from pathlib import Path

    import services.sampler.engine_lora as engine_lora
    from tests.sampler_helpers import load_into
    from tests.sampler_multiprocess_probe import greedy, in_flight_swap, probe_engine
    from tests.test_sampler_lora import LORA, adapter_version

    staging = Path(tempfile.mkdtemp())
    os.environ["VCPO_WEIGHT_STAGING"] = str(staging)
    engine = probe_engine(model_dir, collective_weights=False, adapter=LORA)
    try:
        (_, a), (_, b), (_, c) = (adapter_version(Path(model_dir), s) for s in (seed_a, seed_b, seed_c))
        load_into(engine, a)
        out: dict[str, Any] = {"exact_in_flight": engine.exact_in_flight}
        prompt = engine.tokenizer.encode("12+7=")
        out["staged"] = greedy(engine, prompt)
        prompts = [engine.tokenizer.encode(q) for q in ("12+7=", "The cat", "3+4=")]
        out["in_flight"] = in_flight_swap(engine, prompts, b, max_tokens=120)
        serving = engine.loaded_version
        real = engine_lora.adapter_config
        engine_lora.adapter_config = lambda cfg: {**real(cfg), "r": 999}  # type: ignore[assignment]
        error = ""
        try:
            load_into(engine, c)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        engine_lora.adapter_config = real  # type: ignore[assignment]
        out["refused"] = {"error": error, "serving_before": serving, "serving_after": engine.loaded_version}
        out["after_refused"] = greedy(engine, prompt)
        out["adapter_dirs"] = sorted(p.name for p in staging.glob("vcpo-adapters-*/*"))
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
