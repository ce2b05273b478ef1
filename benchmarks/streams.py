"""Throughput and latency of the stream layer: rollout groups through write -> read -> ack on a real Redis.

A producer process writes realistic groups (8 responses x 512 tokens with per-token log-probs, loss mask and
a 128-token prompt: ~40 KB serialized) to a `rollouts` queue; a consumer process reads, decodes and
acknowledges them, as the reward service will. Serialization and decoding are inside the measured path.
Both batching settings run side by side in one run (this machine is shared and noisy: compare ratios).

Latency is per group, from the producer's put call to the consumer's ack (both on one clock). Saturated
runs write as fast as possible, so the queue sits at its cap and latency is mostly time spent queued
(back-pressure working); the paced run writes at half the target rate and shows the latency of the hop.

    python benchmarks/streams.py [--quick] [--groups N]

Prints a table, then as its last line one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from services.common.config import RunConfig, StreamsConfig
from services.common.redis_server import LocalRedis
from services.common.streams.consumer import StreamConsumer
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import StreamSpec, stream_specs
from services.common.synthetic import make_group


def _spec(run_id: str, maxlen: int) -> StreamSpec[Any]:
    return stream_specs(RunConfig(run_id=run_id), StreamsConfig(rollouts_maxlen=maxlen))["rollouts"]


def _produce(url: str, run_id: str, groups: int, batch: int, maxlen: int, rate: float, start: Any) -> None:
    client = redis.Redis.from_url(url)
    producer = StreamProducer(client, _spec(run_id, maxlen))
    templates = [make_group(i, n=8, response_len=512, prompt_len=128) for i in range(16)]
    start.wait()
    t0 = time.perf_counter()
    sent = 0
    while sent < groups:
        if rate:  # paced: hold each write until its slot
            time.sleep(max(0.0, t0 + sent / rate - time.perf_counter()))
        items = []
        for _ in range(min(batch, groups - sent)):
            g = templates[sent % len(templates)]
            g.finished_unix = time.time()  # send timestamp, read back by the consumer
            items.append((g, 3))
            sent += 1
        producer.put_many(items)


def _consume(url: str, run_id: str, groups: int, batch: int, maxlen: int, start: Any, out: Any) -> None:
    client = redis.Redis.from_url(url)
    consumer = StreamConsumer(client, _spec(run_id, maxlen), "bench")
    start.wait()
    t0 = time.perf_counter()
    latencies: list[float] = []
    tokens = 0
    while len(latencies) < groups:
        entries = consumer.read(count=batch, block_ms=1000)
        consumer.ack([e.id for e in entries])
        now = time.time()
        for e in entries:
            latencies.append(now - e.message.finished_unix)
            tokens += sum(len(t.response_tokens) for t in e.message.trajectories)
    out.put((time.perf_counter() - t0, latencies, tokens))


def run_case(url: str, groups: int, batch: int, maxlen: int, rate: float = 0.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    run_id = f"bench-b{batch}-{time.monotonic_ns()}"
    start, out = ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(url, run_id, groups, batch, maxlen, start, out))
    consumer.start()
    time.sleep(0.5)  # the consumer group exists before anything is written
    producer = ctx.Process(target=_produce, args=(url, run_id, groups, batch, maxlen, rate, start))
    producer.start()
    time.sleep(1.0)  # both processes imported and built their messages
    start.set()
    elapsed, latencies, tokens = out.get(timeout=600)
    producer.join()
    consumer.join()
    latencies.sort()
    return {
        "mode": f"paced {rate:.0f}/s" if rate else "saturated",
        "batch": batch,
        "groups": groups,
        "seconds": elapsed,
        "groups_per_s": groups / elapsed,
        "tokens_per_s": tokens / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small run that takes seconds")
    parser.add_argument("--groups", type=int, default=0, help="groups per case (default 20000; quick: 1000)")
    parser.add_argument("--maxlen", type=int, default=1024, help="stream cap (back-pressure bound)")
    args = parser.parse_args()
    groups = args.groups or (1000 if args.quick else 20_000)
    size = len(make_group(0, n=8, response_len=512, prompt_len=128).SerializeToString())

    with LocalRedis() as server:
        rows = [run_case(server.url, groups, batch, args.maxlen) for batch in (1, 32)]
        paced = run_case(server.url, max(groups // 10, 200), 1, args.maxlen, rate=1000.0)
        peak_mb = int(server.client().info("memory")["used_memory_peak"]) / 2**20

    print(
        f"rollout group: 8 x 512 tokens + 128 prompt tokens, {size / 1024:.1f} KiB serialized; cap {args.maxlen}"
    )
    print(
        f"{'mode':>12} {'batch':>5} {'groups':>7} {'seconds':>8} {'groups/s':>9} {'Mtok/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
    )
    for r in [*rows, paced]:
        print(
            f"{r['mode']:>12} {r['batch']:>5} {r['groups']:>7} {r['seconds']:>8.2f} {r['groups_per_s']:>9.0f} "
            f"{r['tokens_per_s'] / 1e6:>7.2f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}"
        )
    print(
        f"redis peak memory {peak_mb:.1f} MiB (bound: cap x group size = {args.maxlen * size / 2**20:.1f} MiB + overhead)"
    )
    best = rows[-1]
    headline = {
        "groups_per_s": round(best["groups_per_s"], 1),
        "saturated_p50_ms": round(best["p50_ms"], 3),
        "saturated_p99_ms": round(best["p99_ms"], 3),
        "paced_1000_per_s_p50_ms": round(paced["p50_ms"], 3),
        "paced_1000_per_s_p99_ms": round(paced["p99_ms"], 3),
        "batch": best["batch"],
        "unbatched_groups_per_s": round(rows[0]["groups_per_s"], 1),
        "batched_over_unbatched": round(best["groups_per_s"] / rows[0]["groups_per_s"], 2),
        "group_bytes": size,
        "redis_peak_mib": round(peak_mb, 1),
        "target_groups_per_s": 2000,
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
