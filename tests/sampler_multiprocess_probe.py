"""Run by tests/test_sampler_engine.py in its own process: the vLLM engine core in a separate process (as on
GPU machines). Prints one JSON line: a version applied through the staging file (greedy tokens and
log-probs; the staging directories of dead engines swept at start-up, none left by its own loads), an
in-flight swap (which tokens ``quiesce`` handed back before it, which came after) and a load
that fails inside the workers (the error raised, the version served afterwards and its tokens), a version
broadcast through the weight group into the workers, and then a version whose file for the workers cannot be
written."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def greedy(engine: Any, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    from services.sampler.engine import Sampling

    engine.add(f"g{time.monotonic_ns()}", prompt, Sampling(temperature=0.0, max_tokens=max_tokens))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.token_ids
            logprobs += delta.logprobs
    return {"prompt": prompt, "tokens": tokens, "logprobs": logprobs}


def join_group(engine: Any, init: dict[str, Any]) -> None:
    """The sampler's join (``begin_join``, then ``weight_work_done`` asked until it has ended), waited for."""
    engine.begin_join(init)
    while not engine.weight_work_done():
        time.sleep(0.005)


def receive(engine: Any, version: int) -> float:
    """The sampler's receive (``begin_receive``, then ``weight_work_done``), waited for; its seconds."""
    t0 = time.monotonic()
    engine.begin_receive(version)
    while not engine.weight_work_done():
        time.sleep(0.005)
    return time.monotonic() - t0


def in_flight_swap(
    engine: Any, prompts: list[list[int]], new: dict[str, Any], max_tokens: int = 300
) -> list[dict[str, Any]]:
    """Requests generate under the loaded version; the core runs ahead of this process for a moment; then a
    swap the way the sampler does it (quiesce, apply, resume). Each request's tokens before and after."""
    from services.sampler.engine import Sampling
    from tests.sampler_helpers import versions

    out = {
        f"f{i}": {"prompt": p, "tokens": [], "logprobs": [], "swapped_at": None}
        for i, p in enumerate(prompts)
    }
    for rid, r in out.items():
        engine.add(rid, r["prompt"], Sampling(temperature=1.0, max_tokens=max_tokens, seed=7))

    def absorb(deltas: list[Any]) -> None:
        for d in deltas:
            out[d.request_id]["tokens"] += d.token_ids
            out[d.request_id]["logprobs"] += d.logprobs

    absorb(engine.step())
    time.sleep(0.2)  # the engine core keeps stepping: its outputs queue up on this side
    before = engine.quiesce()
    absorb(before)
    version = next(versions)
    sink = engine.stage(version)
    for name, tensor in new.items():
        sink(name, tensor)
    try:
        engine.apply(version)
    finally:
        engine.resume()
    for r in out.values():
        r["swapped_at"] = len(r["tokens"])
    result = list(out.values())
    result[0]["drained"] = sum(len(d.token_ids) for d in before)
    while engine.has_unfinished():
        absorb(engine.step())
    return result


def failed_load(engine: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """A version that passes the host-side checks but fails inside the workers part-way (one mid-model
    tensor of the wrong shape): the error raised, and what the engine serves afterwards."""
    from tests.sampler_helpers import versions

    serving = engine.loaded_version
    names = sorted(weights)
    bad = next(n for n in names if ".layers.2." in n and n.endswith("down_proj.weight"))
    broken = dict(weights, **{bad: weights[bad][:, :-1].contiguous()})
    engine._check_complete = lambda staged: None  # let it reach the workers, as a load that fails there does
    version = next(versions)
    sink = engine.stage(version)
    for name, tensor in broken.items():
        sink(name, tensor)
    error = ""
    try:
        engine.apply(version)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "serving_before": serving, "serving_after": engine.loaded_version}


def collective(engine: Any, weights: dict[str, Any], prompt: list[int], tmp: str) -> dict[str, Any]:
    """A version broadcast by a learner process through the weight group into the workers' registered
    ``vcpo_collective`` engine (each in its own process here, as on GPU machines), over gloo's sockets: what
    a learner and a sampler sharing a GPU use."""
    import torch

    from tests.sampler_helpers import broadcasting, versions

    version = next(versions)
    path = os.path.join(tmp, "collective.pt")
    torch.save({version: weights}, path)
    plan = [(version, "whole")]
    with broadcasting(path, plan, epoch=0, timeout_s=120.0) as (spec, out):
        join_group(engine, {**spec, "rank_offset": 1})
        seconds = receive(engine, version) + engine.apply_collective(version)
        sent = out.get(timeout=120)
    return {
        "sent": list(sent),
        "seconds": seconds,
        "serving": engine.loaded_version == version,
        "version": version,
        **greedy(engine, prompt),
    }


def unwritable_staging(engine: Any, weights: dict[str, Any], prompt: list[int], tmp: str) -> dict[str, Any]:
    """A broker-path version whose file for the workers cannot be written (as in a full /dev/shm), after a
    version from the weight group: the error, and what the engine serves afterwards."""
    from pathlib import Path

    from tests.sampler_helpers import load_into

    serving, root = engine.loaded_version, engine._staging_root
    blocker = Path(tmp) / "not-a-directory"
    blocker.write_bytes(b"")
    engine._staging_root = blocker / "staging"
    error = ""
    try:
        load_into(engine, weights)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        engine._staging_root = root
    return {
        "error": error,
        "serving_before": serving,
        "serving_after": engine.loaded_version,
        **greedy(engine, prompt),
    }


def descendants_env(name: str) -> dict[str, str | None]:
    """``name`` in the environment each process below this one started with (the engine core and vLLM's
    workers: what torch's NCCL groups there read), by each process's command line."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found: dict[str, str | None] = {}
    todo = list(parents.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        value = env.get(name.encode())
        found[f"{pid} {cmd[:120]}"] = value.decode() if value is not None else None
    return found


def probe_engine(model_dir: str, **settings: Any) -> Any:
    """The probes' engine: the tiny model in float32, a small KV cache, able to join a weight group unless
    ``settings`` say ``collective_weights=False``."""
    from services.sampler.engine import VllmEngine, VllmSettings

    return VllmEngine(
        VllmSettings(
            model=model_dir,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=32 << 20,
            enforce_eager=True,
            **{"collective_weights": True, **settings},
        )
    )


def main() -> None:
    model_dir, seed_a, seed_b, seed_c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import subprocess
    import tempfile
    from pathlib import Path

    from tests.sampler_helpers import load_into, version_weights

    staging = Path(tempfile.mkdtemp())
    os.environ["VCPO_WEIGHT_STAGING"] = str(staging)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # staging left by a dead engine, by this process's previous life (a container restarts under its PID)
    # and by an engine that still runs (the test's process stands in for it)
    for pid in (dead.pid, os.getpid(), os.getppid()):
        (staging / f"vcpo-weights-{pid}").mkdir()
        (staging / f"vcpo-weights-{pid}" / "model.safetensors").write_bytes(b"stale")
    engine = probe_engine(model_dir)
    try:
        a, b = version_weights(model_dir, seed_a), version_weights(model_dir, seed_b)
        out: dict[str, Any] = {"staging_at_start": sorted(os.listdir(staging)), "live": os.getppid()}
        out["nccl_dump_env"] = descendants_env("TORCH_NCCL_DUMP_ON_TIMEOUT")
        load_into(engine, a)
        out["exact_in_flight"] = engine.exact_in_flight
        prompt = engine.tokenizer.encode("12+7=")
        out["staged"] = greedy(engine, prompt)
        prompts = [engine.tokenizer.encode(q) for q in ("12+7=", "The cat", "3+4=")]
        out["in_flight"] = in_flight_swap(engine, prompts, b)
        out["failed_load"] = failed_load(engine, b)
        out["after_failed_load"] = greedy(engine, prompt)
        with tempfile.TemporaryDirectory() as tmp:
            out["collective"] = collective(engine, version_weights(model_dir, seed_c), prompt, tmp)
            out["unwritable_staging"] = unwritable_staging(engine, a, prompt, tmp)
        out["staging_after_loads"] = sorted(os.listdir(staging))
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
