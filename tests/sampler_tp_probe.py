"""Run by tests/test_sampler_engine.py in its own process: an engine with tensor parallelism 2, so its two
workers run under vLLM's multi-process executor, as every GPU engine with more than one GPU does, and its
engine core in a process of its own. That executor reads the workers' replies one by one and stops at the
first failure; a worker's failure must not leave a reply behind for the next call. Prints one JSON line:

- a join that fails in both workers (a group that never forms) raises its own error, and the calls after it
  (a pause and resume as for a swap, a generation) get their own replies;
- a version broadcast through the weight group into both workers (ranks 1 and 2, each into buffers on its
  own device, as a GPU host's workers do), served;
- a broadcast version that loads in one worker and fails in the other (one row-parallel weight a column
  short: worker 0's half fits, worker 1's does not) raises that error; the next version is received,
  loaded and served."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any


def main() -> None:
    model_dir, seed_a, seed_b, seed_c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # vLLM-CPU binds each worker's threads to a NUMA node of its own by default; this machine may have one
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    from services.common.ports import free_port
    from tests.sampler_helpers import broadcasting, version_weights
    from tests.sampler_multiprocess_probe import descendants_env, greedy, join_group, probe_engine, receive

    engine = probe_engine(model_dir, tensor_parallel_size=2)
    out: dict[str, Any] = {"nccl_dump_env": descendants_env("TORCH_NCCL_DUMP_ON_TIMEOUT")}
    try:
        prompt = engine.tokenizer.encode("12+7=")
        nobody = {"host": "127.0.0.1", "port": free_port(), "world_size": 3, "rank_offset": 1}
        try:
            join_group(engine, {**nobody, "timeout_s": 5.0, "form_timeout_s": 2.0})
            out["join_error"] = ""
        except Exception as exc:
            out["join_error"] = f"{type(exc).__name__}: {exc}"
        try:  # a swap's pause: vLLM's own calls into the workers
            engine.quiesce()
            engine.resume()
            out["pause_error"] = ""
        except Exception as exc:
            out["pause_error"] = f"{type(exc).__name__}: {exc}"
        out["after_failed_join"] = greedy(engine, prompt)

        a, b, c = (version_weights(model_dir, seed) for seed in (seed_a, seed_b, seed_c))
        bad_name = next(n for n in sorted(b) if ".layers.1." in n and n.endswith("down_proj.weight"))
        broken = dict(b, **{bad_name: b[bad_name][:, :-1].contiguous()})
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "versions.pt")
            torch.save({seed_a: a, seed_b: broken, seed_c: c}, path)
            plan = [(seed_a, "whole"), (seed_b, "whole"), (seed_c, "whole")]
            with broadcasting(path, plan, epoch=0, timeout_s=120.0, receivers=2) as (spec, sent):
                join_group(engine, {**spec, "rank_offset": 1})
                receive(engine, seed_a)
                engine.apply_collective(seed_a)
                out["first"] = {"sent": list(sent.get(timeout=120)), **greedy(engine, prompt)}
                receive(engine, seed_b)
                out["broken_sent"] = list(sent.get(timeout=120))
                try:
                    engine.apply_collective(seed_b)
                    out["load_error"] = ""
                except Exception as exc:
                    out["load_error"] = f"{type(exc).__name__}: {exc}"
                out["loaded_after_failure"] = engine.loaded_version
                receive(engine, seed_c)
                engine.apply_collective(seed_c)
                out["second"] = {
                    "sent": list(sent.get(timeout=120)),
                    "serving": engine.loaded_version == seed_c,
                    **greedy(engine, prompt),
                }
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
