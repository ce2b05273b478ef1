"""Agents through the OpenAI-compatible API against the sampler's own agent loop: same engine, same episodes.

Both paths run a real ``SamplerService`` on ONE ``VllmEngine`` (the tiny model, float32, in this process), with a
real redis-server and a weight broker holding version 0 (benchmarks/sampler.py's ``Bench``), ``--groups`` G
groups of ``--n`` episodes, ``--concurrency`` episodes in flight at once (``sampler.max_requests_in_flight``),
``--turns`` T model turns per episode of at most ``--max-tokens`` tokens each:

  inprocess  the sampler's agent loop (services/sampler/agent.py) against the built-in ``python`` environment with
             the ``turn`` parser: every turn is an action, answered at once with a fixed observation (no code
             runs), and the episode ends after T turns.
  endpoint   the agent API (``[agents] enabled = true``), driven from another process by ``--concurrency``
             agents (coroutines sharing one httpx connection pool; tests/test_agent_api.py drives the API with
             the official ``openai`` client): each claims an episode, makes T chat completions (after each
             answer a user message with the same text the environment answers with), finishes the episode and
             claims the next, until the sampler has written its G groups.

Each path is timed from the moment version 0 is loaded into the engine until the G-th group is on the rollouts
stream; tokens are the groups' sampled (trained) tokens. The headline ``endpoint_over_inprocess`` is the
endpoint's generated tokens/s over the in-process loop's (medians over ``--repeats`` rounds, the order flipping
every round; target >= 0.8). The endpoint's added latency per turn is the client's time for a chat completion
minus the engine's time for that turn (the API's ``x-vcpo-engine-ms`` header): p50 and p99 over every turn of
every round. The agents' process shares this machine's cores with the engine: on 2 cores that costs the
endpoint path throughput a deployment (agents on other machines) does not pay.

    python benchmarks/agents.py [--quick] [--groups 16] [--n 8] [--concurrency 64] [--turns 3]
                                [--max-tokens 32] [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sampler import Bench, Measurement, mark_after
from services.common.tiny_model import build_tiny_model
from services.sampler.config import SamplerServiceConfig
from services.sampler.service import SamplerService
from vcpo.v1 import rollout_pb2

TARGET_ENDPOINT_OVER_INPROCESS = 0.8
OBSERVATION = 'call the "python" tool with arguments {"code": "<program>"}; got tool \'\' with arguments \'\''


def agents(base_url: str, token: str, concurrency: int, turns: int, out: Any, cores: set[int]) -> None:
    """The agents' process: ``concurrency`` agents (coroutines over one HTTP connection pool: the lightest
    client, so the machine's cores go to the engine) playing episodes until no episode is left; sends back
    each turn's (client seconds, engine seconds)."""
    import asyncio

    import httpx

    if cores:
        os.sched_setaffinity(0, cores)
    latencies: list[tuple[float, float, float]] = []
    out.send("ready")  # imported: the timed run may start
    cpu0 = time.process_time()

    async def agent(http: httpx.AsyncClient) -> None:
        try:
            await episodes(http)
        except httpx.HTTPError:  # the sampler closed its server under this agent: the run is over
            return

    async def episodes(http: httpx.AsyncClient) -> None:
        while True:
            claimed = await http.post("/v1/episodes")
            if claimed.status_code != 200:  # the sampler has its groups (or stopped)
                if claimed.json()["error"]["code"] not in ("no_episode", "sampler_stopping"):
                    print(f"agent: claim: {claimed.text}", file=sys.stderr, flush=True)
                return
            episode = claimed.json()
            url = f"{episode['base_url']}/chat/completions"
            messages: list[Any] = list(episode["messages"])
            for turn in range(turns):
                t0 = time.perf_counter()
                reply = await http.post(url, json={"model": "policy", "messages": messages})
                seconds = time.perf_counter() - t0
                if reply.status_code != 200:
                    if reply.json()["error"]["code"] != "sampler_stopping":
                        print(f"agent: {episode['id']}: {reply.text}", file=sys.stderr, flush=True)
                    return
                server, engine = (float(reply.headers[f"x-vcpo-{h}-ms"]) / 1000 for h in ("server", "engine"))
                latencies.append((seconds, server, engine))
                messages.append(reply.json()["choices"][0]["message"])
                if turn + 1 < turns:
                    messages.append({"role": "user", "content": OBSERVATION})
            await http.post(f"/v1/episodes/{episode['id']}/finish", json={})

    async def play() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300, limits=limits) as http:
            await asyncio.gather(*(agent(http) for _ in range(concurrency)))

    asyncio.run(play())
    out.send((latencies, time.process_time() - cpu0))


def burn(duty: float, cores: set[int], stop: Any) -> None:
    """Keep ``duty`` of a core on ``cores`` busy (the agents' CPU, without the agents) until ``stop``."""
    os.sched_setaffinity(0, cores)
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.005 * duty:
            pass
        time.sleep(0.005 * (1 - duty))


class AgentBench(Bench):
    def __init__(self, model_dir: Path, work: Path, args: argparse.Namespace) -> None:
        super().__init__(model_dir, work, args.groups, args.n, args.max_tokens, args.kv_cache_mib << 20, True)
        self.args = args
        self.agents_duty = 0.0  # the share of a core the agents' process used in the last endpoint run

    def config(self, endpoint: bool) -> SamplerServiceConfig:
        a = self.args
        data = self.service_config(a.groups).model_dump(mode="json")
        data["sampler"].update(max_requests_in_flight=a.concurrency)
        if endpoint:
            data["agents"] = {"enabled": True, "port": 0, "claim_timeout_s": 30.0}
        else:
            env = {"name": "py", "builtin": "python", "tool_parser": "turn", "max_turns": a.turns}
            data["sampler"].update(environments=[env], dataset_environment="py")
        return SamplerServiceConfig.model_validate(data)

    def run_path(
        self, endpoint: bool, burn_duty: float = 0.0
    ) -> tuple[Measurement, list[tuple[float, float, float]]]:
        """One measurement; ``burn_duty``: the in-process path runs beside a process keeping that share of a
        core busy where the agents' process would run."""
        self.engine.loaded_version = None
        service = SamplerService(self.config(endpoint), 0, self.engine)
        self.client.delete(service.sampler.admission.key)
        marks: dict[str, float] = {}
        latencies: list[tuple[float, float, float]] = []
        process = burner = None
        receive, send = mp.get_context("spawn").Pipe(duplex=False)
        stop = mp.get_context("spawn").Event()
        try:
            if burn_duty > 0:
                burner = mp.get_context("spawn").Process(
                    target=burn, args=(burn_duty, agent_cores(self.args.engine_cores), stop), daemon=True
                )
                burner.start()
            if endpoint:
                assert service.agents is not None
                token = (self.run.run_dir / "api_token").read_text().strip()
                cores = agent_cores(self.args.engine_cores)
                args = (service.agents.url, token, self.args.concurrency, self.args.turns, send, cores)
                process = mp.get_context("spawn").Process(target=agents, args=args, daemon=True)
                process.start()
                if not receive.poll(120) or receive.recv() != "ready":
                    raise RuntimeError("the agents' process did not start")
            with (
                mark_after(self.engine, "apply", marks, "loaded"),
                mark_after(service.sampler.rollouts, "put", marks, "written"),
            ):
                service.serve(threading.Event(), max_groups=self.args.groups)
        finally:
            service.close()
            stop.set()
            if burner is not None:
                burner.join(10)
            if process is not None:
                latencies, cpu = receive.recv() if receive.poll(60) else ([], 0.0)
                process.join(10)
                self.agents_duty = min(1.0, cpu / (marks["written"] - marks["loaded"]))
        key = self.specs["rollouts"].key
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(key))
        self.client.delete(key)
        written = [rollout_pb2.TrajectoryGroup.FromString(fields[b"payload"]) for _, fields in entries]
        tokens = sum(sum(t.loss_mask) for g in written for t in g.trajectories)
        turns = sum(t.num_turns for g in written for t in g.trajectories)
        path = "endpoint" if endpoint else "inprocess_loaded" if burn_duty else "inprocess"
        print(
            f"{path}: {len(written)} groups, {turns} turns, {tokens} tokens in "
            f"{marks['written'] - marks['loaded']:.2f}s = {tokens / (marks['written'] - marks['loaded']):.0f} "
            "tokens/s",
            flush=True,
        )
        responses = sum(len(g.trajectories) for g in written)
        return Measurement(
            path, len(written), responses, tokens, marks["written"] - marks["loaded"]
        ), latencies


def agent_cores(engine_cores: int) -> set[int]:
    """The cores the agents' process runs on: those the engine does not (all, when it has them all)."""
    rest = set(sorted(os.sched_getaffinity(0))[engine_cores:]) if engine_cores else set()
    return rest or set(os.sched_getaffinity(0))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 groups of 4, 16 in flight, 2 turns, 1 round")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight at once")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--model", help="a model directory (default: the tiny model, built into a temp dir)")
    parser.add_argument(
        "--engine-cores",
        type=int,
        default=1,
        help="cores vLLM's CPU threads are bound to (the first ones); the agents' process runs on the others "
        "(0: no binding, everything shares every core)",
    )
    args = parser.parse_args()
    if args.engine_cores:
        first = sorted(os.sched_getaffinity(0))[: args.engine_cores]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, first))
    if args.quick:
        args.groups, args.n, args.concurrency, args.turns, args.repeats = 4, 4, 16, 2, 1
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = Path(args.model) if args.model else build_tiny_model(work / "model")
        bench = AgentBench(model_dir, work, args)
        try:
            bench.run_path(False)  # warm-up: the engine's first batches, the environment's first calls
            bench.run_path(True)
            rounds: dict[str, list[Measurement]] = {"inprocess": [], "endpoint": [], "inprocess_loaded": []}
            added: list[float] = []  # the client's time for a turn, less the engine's
            server: list[
                float
            ] = []  # the server's time for a turn (request in to answer out), less the engine's
            duties: list[float] = []
            for i in range(args.repeats):
                for endpoint in (i % 2 == 1, i % 2 == 0):
                    measurement, latencies = bench.run_path(endpoint)
                    rounds[measurement.path].append(measurement)
                    added += [client - engine for client, _, engine in latencies]
                    server += [handler - engine for _, handler, engine in latencies]
                    if endpoint:
                        duties.append(bench.agents_duty)
                        rounds["inprocess_loaded"].append(bench.run_path(False, bench.agents_duty)[0])
        finally:
            bench.close()
    rates = {p: statistics.median(m.tokens_per_s for m in ms) for p, ms in rounds.items()}
    ratio = rates["endpoint"] / rates["inprocess"]
    loaded = rates["endpoint"] / rates["inprocess_loaded"]
    duty = statistics.median(duties)
    load = os.getloadavg()[0]
    print(
        f"endpoint_over_inprocess {ratio:.3f} (endpoint {rates['endpoint']:.0f} tokens/s, in-process "
        f"{rates['inprocess']:.0f}; medians of {args.repeats}); the agents' process used {duty:.2f} of a core: "
        f"the in-process loop beside that much load {rates['inprocess_loaded']:.0f} tokens/s, "
        f"endpoint_over_inprocess_same_load {loaded:.3f}; the server's added latency per turn p50 "
        f"{percentile(server, 0.5) * 1000:.1f} ms, p99 {percentile(server, 0.99) * 1000:.1f} ms (the client's: "
        f"p50 {percentile(added, 0.5) * 1000:.1f} ms, p99 {percentile(added, 0.99) * 1000:.1f} ms) over "
        f"{len(added)} turns; load average {load:.1f}"
    )
    print(
        json.dumps(
            {
                "endpoint_over_inprocess": ratio,
                "target_endpoint_over_inprocess": TARGET_ENDPOINT_OVER_INPROCESS,
                "meets_endpoint_over_inprocess": ratio >= TARGET_ENDPOINT_OVER_INPROCESS,
                "endpoint_over_inprocess_same_load": loaded,
                "agents_process_core_share": duty,
                "tokens_per_s": rates,
                "added_latency_ms": {
                    "p50": percentile(server, 0.5) * 1000,
                    "p99": percentile(server, 0.99) * 1000,
                },
                "client_added_latency_ms": {
                    "p50": percentile(added, 0.5) * 1000,
                    "p99": percentile(added, 0.99) * 1000,
                },
                "turns_timed": len(added),
                "settings": {
                    k: getattr(args, k) for k in ("groups", "n", "concurrency", "turns", "max_tokens")
                },
                "load_average": load,
            }
        )
    )


if __name__ == "__main__":
    main()
