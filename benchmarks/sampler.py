"""Sampler service throughput against vLLM's own ``LLM.generate``: one engine, the same prompts, one process.

What the service wraps around the engine (task feed, Redis admission, per-step token deltas with their
log-probs, group assembly, protobuf encoding, the `rollouts` stream) must not eat the engine's speed. Both
paths drive ONE ``VllmEngine`` (float32, enforce_eager, ``--kv-cache-mib`` of KV cache, max_model_len 512)
over the tiny model built by code (or ``--model DIR``), on the same G prompts (``builtin:arith`` rows written
to a jsonl, chat-templated by the service's ``PromptEncoder``, so both paths see identical token ids):

  engine    ``llm.generate(G token-id prompts, SamplingParams(n, temperature 1, max_tokens, logprobs=0))``:
            the engine's own batch API, asking for the sampled token's log-prob as the service does. Timed
            around the call; tokens counted from its outputs.
  engine_raw the same call with ``detokenize=False``: vLLM skips its per-token detokenizing, which the
            service also skips (it decodes each finished response once), so this is the engine alone.
  service   a real ``SamplerService`` on the same engine with a real redis-server (started here), a weight
            broker in this process (gRPC and its TCP data plane, announcing on the run's `weights` stream)
            holding version 0 (the model's own weights), the jsonl as its dataset, ``groups_per_step`` 1 and
            ``max_requests_in_flight`` G x n, so all G groups start in the first tick, as in the one generate
            call. ``serve(stop,
            max_groups=G)`` runs in this (the main) thread. Timed from the moment version 0 is loaded into
            the engine (the loop admits its first groups in the same tick) until the G-th group is on the
            `rollouts` stream; the first version's fetch and load before it, and the shutdown after it, are
            not timed. Tokens counted from the stream's ``TrajectoryGroup`` entries.

The lag bound makes the service start exactly G groups: at version 0 with one group per step it admits
k + 1, so k = G - 1 (the run's admission counter is reset before each measurement). Admission never refuses
one of the G; it refuses only the G+1-th, which the generate call would not run either. ``--refill`` sets k
huge instead: the service then refills its in-flight set as the first groups finish, as a running sampler
does, and the groups it started beyond the G are aborted at shutdown, uncounted: the cost of cutting a
continuous service off at G groups, which a running sampler does not pay.

Both paths are warmed up once (2 groups), then measured alternately for ``--repeats`` rounds (the order flips
every round); medians are reported. The 1-minute load average is printed: on a shared machine other
processes make both paths slower by different amounts (vLLM's CPU threads are pinned). The last line is
one JSON object with the headline figure ``service_over_engine`` (median service tokens/s over median
engine tokens/s; target >= 0.8). ``--profile`` runs one more, untimed, pass of each path under cProfile
and prints the top functions to stderr (the service's covers all of ``serve``, the first load included).

How full the loop keeps the engine's batch is measured apart (benchmarks/_sampler_admission.py), since it
is a figure of the admission policy, not of generation: the real ``Sampler`` loop over a stand-in engine that
batches as vLLM does (at most the cap of requests run per step, one token each, the rest wait), with
long-tailed response lengths (5 % at max_tokens). ``active_over_cap`` is the mean number of requests running
per step over the cap (the engine's batch limit, the default of ``sampler.max_requests_in_flight``);
target >= 0.9. Quick: cap 128, n 8, max_tokens 128; otherwise cap 1024 (vLLM's on an H100), n 16,
max_tokens 256. ``--admission-only`` measures only that (no vLLM).

    python benchmarks/sampler.py [--quick] [--groups 32] [--n 8] [--max-tokens 64] [--repeats 3]
                                 [--model DIR] [--refill] [--profile] [--admission-only]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import torch
from safetensors.torch import load_file

from benchmarks._sampler_admission import measure as measure_admission
from services.common.builtin_datasets import arith_rows
from services.common.config import RunConfig, StreamsConfig
from services.common.datasets import load_dataset
from services.common.observability import Metrics, grpc_server
from services.common.prompts import PromptEncoder
from services.common.redis_server import LocalRedis
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from services.common.tiny_model import build_tiny_model, count_parameters
from services.sampler.config import SamplerServiceConfig
from services.sampler.engine import VllmEngine, VllmSettings
from services.sampler.service import SamplerService
from services.weight_broker.dataplane_server import DataPlaneServer
from services.weight_broker.servicer import Announcer, BrokerMetrics, WeightBrokerServicer, add_to_server
from services.weight_transport.store import MemoryStore
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transport import WeightTransport
from vcpo.v1 import rollout_pb2

TARGET_SERVICE_OVER_ENGINE = 0.8
TARGET_ACTIVE_OVER_CAP = 0.9
MAX_MODEL_LEN = 512
RUN_ID = "bench-sampler"
WARMUP_GROUPS = 2
REFILL_K = 1_000_000
MiB = 1 << 20


@dataclass
class Measurement:
    path: str
    groups: int
    responses: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@contextmanager
def mark_after(obj: Any, name: str, marks: dict[str, float], key: str) -> Iterator[None]:
    """While inside, every ``obj.name(...)`` call records ``time.perf_counter()`` in ``marks[key]`` once it
    returns (an instance attribute over the method; removed on exit). The only instrumentation of the service."""
    original = getattr(obj, name)

    def marked(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        marks[key] = time.perf_counter()
        return out

    setattr(obj, name, marked)
    try:
        yield
    finally:
        delattr(obj, name)


class Bench:
    """The engine, Redis, the broker with version 0, and the prompts; runs one measurement of either path."""

    def __init__(
        self, model_dir: Path, work: Path, groups: int, n: int, max_tokens: int, kv_bytes: int, refill: bool
    ) -> None:
        self.n, self.max_tokens, self.refill = n, max_tokens, refill
        # without CUDA, VllmEngine keeps vLLM's engine core in this process: both paths run in one process
        self.engine = VllmEngine(
            VllmSettings(
                model=str(model_dir),
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                kv_cache_memory_bytes=kv_bytes,
                enforce_eager=True,
                seed=0,
            )
        )
        self.redis = LocalRedis()
        self.client: redis.Redis = self.redis.client()
        self.dataset = work / "prompts.jsonl"
        with self.dataset.open("w") as f:
            for i, row in zip(range(groups), arith_rows("train", seed=0), strict=False):
                f.write(
                    json.dumps({"task_id": f"bench:{i}", "prompt": row["prompt"], "answer": row["answer"]})
                    + "\n"
                )
        encoder = PromptEncoder(self.engine.tokenizer, MAX_MODEL_LEN, max_tokens)
        self.prompts = [encoder.encode(task) for task in load_dataset(str(self.dataset))]
        self.run = RunConfig(
            run_id=RUN_ID,
            k=0,
            groups_per_step=1,
            model=str(model_dir),
            redis_url=self.redis.url,
            run_dir=work / "run",
        )
        self.specs = stream_specs(self.run, StreamsConfig())
        # the broker as services/weight_broker/service.py wires it, in this process, announcing each version
        servicer = WeightBrokerServicer(
            MemoryStore(retain=2), BrokerMetrics(Metrics("bench-broker")), run_id=RUN_ID
        )
        self.broker = grpc_server(lambda s: add_to_server(servicer, s), port=0, host="127.0.0.1")
        self.plane = DataPlaneServer(servicer, port=0, host="127.0.0.1")
        address = f"127.0.0.1:{self.broker.port}"
        servicer.announcer = Announcer(StreamProducer(self.client, self.specs["weights"]), address)
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        publisher = WeightTransport(address, f"127.0.0.1:{self.plane.port}", run_id=RUN_ID)
        publisher.publish(0, [TensorSpec.of(k, t) for k, t in weights.items()], lambda: iter(weights.items()))
        publisher.close()

    def service_config(self, groups: int) -> SamplerServiceConfig:
        # version 0, one group per step: the lag bound admits k + 1 groups (the counter is reset per run)
        run = self.run.model_copy(update={"k": REFILL_K if self.refill else groups - 1})
        sampler = {
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "max_model_len": MAX_MODEL_LEN,
            "dtype": "float32",
            "enforce_eager": True,
            "dataset": str(self.dataset),
            "max_requests_in_flight": groups * self.n,
            "grpc_port": 0,
            "metrics_port": 0,
        }
        return SamplerServiceConfig.model_validate(
            {
                "run": run.model_dump(),
                "sampler": sampler,
                "weight_broker": {
                    "transport": "tcp",
                    "advertise_host": "127.0.0.1",
                    "grpc_port": self.broker.port,
                    "data_port": self.plane.port,
                },
            }
        )

    def engine_run(self, groups: int, profile: cProfile.Profile | None = None) -> Measurement:
        return self._generate(groups, profile, detokenize=True)

    def engine_raw_run(self, groups: int, profile: cProfile.Profile | None = None) -> Measurement:
        return self._generate(groups, profile, detokenize=False)

    def _generate(self, groups: int, profile: cProfile.Profile | None, detokenize: bool) -> Measurement:
        from vllm import SamplingParams

        params = SamplingParams(
            n=self.n, temperature=1.0, max_tokens=self.max_tokens, logprobs=0, detokenize=detokenize
        )
        prompts = [{"prompt_token_ids": list(p)} for p in self.prompts[:groups]]
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        outputs = self.engine.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if profile:
            profile.disable()
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        path = "engine" if detokenize else "engine_raw"
        return Measurement(path, len(outputs), sum(len(o.outputs) for o in outputs), tokens, seconds)

    def service_run(self, groups: int, profile: cProfile.Profile | None = None) -> Measurement:
        self.engine.loaded_version = None  # a starting sampler fetches its first version from the broker
        service = SamplerService(self.service_config(groups), 0, self.engine)
        self.client.delete(service.sampler.admission.key)  # each measurement starts a fresh count
        marks: dict[str, float] = {}
        stop = threading.Event()
        try:
            with (
                mark_after(self.engine, "apply", marks, "loaded"),
                mark_after(service.sampler.rollouts, "put", marks, "written"),
            ):
                if profile:
                    profile.enable()
                service.serve(stop, max_groups=groups)
                if profile:
                    profile.disable()
        finally:
            service.close()  # leaves the engine running
        key = self.specs["rollouts"].key
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(key))
        self.client.delete(key)
        written = [rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"]) for _, fields in entries]
        # with k = G - 1 exactly G groups start; with --refill a late one may finish in the G-th's step
        if not groups <= len(written) <= (2 * groups if self.refill else groups):
            raise RuntimeError(f"the service wrote {len(written)} groups, expected {groups}")
        if any(len(g.trajectories) != self.n for g in written):
            raise RuntimeError(f"the service wrote a group of other than {self.n} responses")
        one_epoch = groups == len(self.prompts) and not self.refill  # every prompt of the dataset once
        if one_epoch and sorted(list(g.prompt_tokens) for g in written) != sorted(self.prompts):
            raise RuntimeError("the service's prompt tokens differ from the engine path's")
        tokens = sum(len(t.response_tokens) for g in written for t in g.trajectories)
        responses = sum(len(g.trajectories) for g in written)
        return Measurement("service", len(written), responses, tokens, marks["written"] - marks["loaded"])

    def close(self) -> None:
        self.plane.stop()
        self.broker.stop(0)
        self.client.close()
        self.redis.stop()
        self.engine.close()


def print_profile(name: str, profile: cProfile.Profile, top: int) -> None:
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(top)
        print(f"===== {name}: top {top} by {order} =====\n{out.getvalue()}", file=sys.stderr)


def admission(quick: bool) -> dict[str, Any]:
    """``active_over_cap`` and its setting (module docstring), printed as a line; the figures."""
    cap, n, max_tokens = (128, 8, 128) if quick else (1024, 16, 256)
    server = LocalRedis()
    try:
        figures = measure_admission(server.client(), cap, n, max_tokens)
    finally:
        server.stop()
    print(
        f"admission: {figures['mean_active']:.0f} of {cap} requests running on average "
        f"(active_over_cap {figures['active_over_cap']:.3f}; n={n}, max_tokens={max_tokens}, mean length "
        f"{figures['mean_length_over_max']:.2f} x max_tokens, {figures['share_at_max']:.0%} at max_tokens; "
        "stand-in engine batching as vLLM)"
    )
    return {
        "active_over_cap": figures["active_over_cap"],
        "target_active_over_cap": TARGET_ACTIVE_OVER_CAP,
        "meets_active_over_cap": figures["active_over_cap"] >= TARGET_ACTIVE_OVER_CAP,
        "admission": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 groups of 4, 16 tokens, 1 round (for tests)")
    parser.add_argument("--groups", type=int, default=0, help="prompts G, all in flight at once (default 32)")
    parser.add_argument("--n", type=int, default=0, help="responses per prompt (default 8)")
    parser.add_argument("--max-tokens", type=int, default=0, help="longest response (default 64)")
    parser.add_argument("--repeats", type=int, default=0, help="timed rounds of each path (default 3)")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="vLLM KV-cache size (default 256)")
    parser.add_argument("--model", help="a model directory (default: the tiny model, built into a temp dir)")
    parser.add_argument(
        "--refill", action="store_true", help="k huge: the service keeps starting groups (see above)"
    )
    parser.add_argument("--profile", action="store_true", help="profile one more run of each path (stderr)")
    parser.add_argument(
        "--admission-only", action="store_true", help="only active_over_cap (no vLLM; see above)"
    )
    args = parser.parse_args()
    if args.admission_only:
        print(json.dumps({"quick": args.quick, **admission(args.quick)}))
        return
    groups = args.groups or (8 if args.quick else 32)
    n = args.n or (4 if args.quick else 8)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs to stdout, whose last line is ours

    runs: dict[str, list[Measurement]] = {"engine": [], "engine_raw": [], "service": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as tmp:
        model_dir = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "model")
        params = count_parameters(model_dir)
        bench = Bench(model_dir, Path(tmp), groups, n, max_tokens, args.kv_cache_mib * MiB, args.refill)
        try:
            prompt_lens = [len(p) for p in bench.prompts]
            bench.engine_run(WARMUP_GROUPS)
            bench.engine_raw_run(WARMUP_GROUPS)
            bench.service_run(WARMUP_GROUPS)
            load.append(os.getloadavg()[0])
            for r in range(repeats):
                first_engine = r % 2 == 0
                for run in (bench.engine_run, bench.engine_raw_run, bench.service_run)[
                    :: 1 if first_engine else -1
                ]:
                    m = run(groups)
                    runs[m.path].append(m)
                    print(
                        f"# round {r}: {m.path:<7} {m.tokens} tokens in {m.seconds:.3f}s = "
                        f"{m.tokens_per_s:.0f} tokens/s",
                        file=sys.stderr,
                        flush=True,
                    )
            load.append(os.getloadavg()[0])
            if args.profile:
                for name, fn in (("engine", bench.engine_run), ("service", bench.service_run)):
                    profile = cProfile.Profile()
                    m = fn(groups, profile)
                    print(
                        f"# profiled {name}: {m.tokens} tokens in {m.seconds:.3f}s (timed as above, "
                        "with cProfile's overhead)",
                        file=sys.stderr,
                    )
                    print_profile(name, profile, 40)
        finally:
            bench.close()

    def med(path: str, f: Callable[[Measurement], float]) -> float:
        return statistics.median(f(m) for m in runs[path])

    rate = {path: med(path, lambda m: m.tokens_per_s) for path in runs}
    ratio = rate["service"] / rate["engine"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"model: {model_dir.name if args.model else 'tiny Qwen2'} ({params / 1e6:.2f}M parameters, float32) "
        f"on {device} ({os.cpu_count()} CPUs, 1-min load average {max(load):.1f} at most); {groups} prompts "
        f"of {min(prompt_lens)}-{max(prompt_lens)} tokens, n={n}, max_tokens={max_tokens}, temperature 1, "
        f"logprobs 0; medians of {repeats} rounds"
    )
    print(f"{'path':<9}{'groups':>7}{'n':>4}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    for path in ("engine", "engine_raw", "service"):
        print(
            f"{path:<9}{groups:>7}{n:>4}{med(path, lambda m: m.tokens):>8.0f}"
            f"{med(path, lambda m: m.seconds):>9.3f}{rate[path]:>10.0f}"
        )
    print(
        "engine: the llm.generate call; engine_raw: the same with detokenize=False (vLLM then skips its "
        "incremental detokenizing, as the service does: it decodes each response once); service: from version 0 loaded (its first groups admitted) until the "
        f"last group is on the rollouts stream; k = {'huge (--refill)' if args.refill else 'G - 1'}"
    )
    figures = {
        "service_over_engine": round(ratio, 3),
        "service_over_engine_raw": round(rate["service"] / rate["engine_raw"], 3),
        "engine_tokens_per_s": round(rate["engine"], 1),
        "engine_raw_tokens_per_s": round(rate["engine_raw"], 1),
        "service_tokens_per_s": round(rate["service"], 1),
        "per_round_service_over_engine": [
            round(s.tokens_per_s / e.tokens_per_s, 3)
            for s, e in zip(runs["service"], runs["engine"], strict=True)
        ],
        "per_round_service_over_engine_raw": [
            round(s.tokens_per_s / e.tokens_per_s, 3)
            for s, e in zip(runs["service"], runs["engine_raw"], strict=True)
        ],
        "engine_tokens": med("engine", lambda m: m.tokens),
        "service_tokens": med("service", lambda m: m.tokens),
        "engine_s": round(med("engine", lambda m: m.seconds), 4),
        "service_s": round(med("service", lambda m: m.seconds), 4),
        "groups": groups,
        "n": n,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "refill": args.refill,
        "parameters": params,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_mib": args.kv_cache_mib,
        "device": device,
        "cpus": os.cpu_count(),
        "load_avg_1min": [round(x, 2) for x in load],
        "target_service_over_engine": TARGET_SERVICE_OVER_ENGINE,
        "meets_service_over_engine": ratio >= TARGET_SERVICE_OVER_ENGINE,
        **admission(args.quick),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
