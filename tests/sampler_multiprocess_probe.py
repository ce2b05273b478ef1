"""Run by tests/test_sampler_engine.py in its own process: the vLLM engine core in a separate process (as on
GPU machines), a version applied through the staging file, greedy tokens and log-probs printed as JSON."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, version_seed = sys.argv[1], int(sys.argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from services.sampler.engine import Sampling, VllmEngine, VllmSettings
    from tests.sampler_helpers import load_into, version_weights

    engine = VllmEngine(VllmSettings(model=model_dir, dtype="float32", max_model_len=128,
                                     kv_cache_memory_bytes=16 << 20, enforce_eager=True))  # fmt: skip
    try:
        load_into(engine, version_weights(model_dir, version_seed))
        prompt = engine.tokenizer.encode("12+7=")
        engine.add("r", prompt, Sampling(temperature=0.0, max_tokens=8))
        tokens, logprobs = [], []
        while engine.has_unfinished():
            for delta in engine.step():
                tokens += delta.token_ids
                logprobs += delta.logprobs
        out = {
            "prompt": prompt,
            "tokens": tokens,
            "logprobs": logprobs,
            "exact_in_flight": engine.exact_in_flight,
        }
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
