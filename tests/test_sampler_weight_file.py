"""The broker path's staging file, where the engine's workers are other processes (the GPU layout): the
version is written while the engine generates, and the engine is paused only for the reload from it.

The session's vLLM engine keeps its model in this process (no file), and a multi-process engine may not be
started beside it, so vLLM's ``LLM`` is a stand-in here that records what the real ``VllmEngine`` asks of it
(pause, wake, worker calls); the file, the sampler loop and the weight sync are the real ones. The reload
from a real file into real workers is covered by tests/test_sampler_engine.py's multi-process probe.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch

from benchmarks._sampler_admission import stand_in_sampler
from services.sampler.engine import STAGING_DIR, VllmEngine, VllmSettings
from services.sampler.weights import WeightSync
from tests.sampler_helpers import version_weights
from vcpo.v1 import weights_pb2

MAX_NUM_SEQS = 1024  # what vLLM sets on an H100


class Core:
    """vLLM's engine core in another process, as far as the loop sees it: its output queue, and whether it
    is paused (``sleep``) or free to generate."""

    def __init__(self, events: list[Any], staging: Path) -> None:
        self.events, self.staging = events, staging
        self.engine_core = SimpleNamespace(outputs_queue=queue.Queue())  # nothing runs ahead of the loop here
        self.paused = False
        self.requests: dict[str, int] = {}  # request -> tokens produced
        self.finish = False  # the next step ends every request
        self.steps = 0
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS))
        self.fail_reloads = 0

    def file_written(self) -> bool:
        return any(self.staging.glob("*/model.safetensors"))

    # LLMEngine's methods the engine calls
    def sleep(self, level: int, mode: str) -> None:
        self.events.append(("pause", self.file_written()))
        self.paused = True

    def wake_up(self, tags: list[str]) -> None:
        self.events.append(("wake", self.file_written()))
        self.paused = False

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> None:
        self.requests[request_id] = 0

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Any]:
        assert not self.paused, "the loop stepped a paused engine"
        self.steps += 1
        out = []
        for request_id in list(self.requests):
            done = self.finish
            completion = SimpleNamespace(
                token_ids=[5],
                logprobs=[{5: SimpleNamespace(logprob=-0.5)}],
                text="",
                finish_reason="stop" if done else None,
            )
            out.append(SimpleNamespace(request_id=request_id, outputs=[completion], finished=done))
            if done:
                del self.requests[request_id]
        return out

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        call = args[0]
        self.events.append((call, self.paused, self.file_written()))
        if call == "vcpo_reload_weights" and self.fail_reloads:
            self.fail_reloads -= 1
            return ["the worker died half-way"]
        return [None]


def stand_in_llm(core: Core) -> type:
    class StandInLLM:
        def __init__(self, **kwargs: Any) -> None:
            self.llm_engine = core
            self.collective_rpc = core.collective_rpc

        def get_tokenizer(self) -> Any:
            return SimpleNamespace(decode=lambda tokens, skip_special_tokens=True: "text")

    return StandInLLM


class Versions:
    """The broker as the weight sync sees it: the versions it holds."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def latest(self) -> int | None:
        return max(self.held, default=None)

    def fetch(self, sink: Any, version: int | None = None, start_tensor: str = "") -> Any:
        version = self.latest() if version is None else version
        assert version is not None
        for name, tensor in self.held[version].items():
            sink(name, tensor)
        return weights_pb2.VersionManifest(policy_version=version, total_bytes=1)


@pytest.fixture
def gpu_layout(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[VllmEngine, Core, list[Any]]:
    """A VllmEngine laid out as on a GPU with one worker: engine core and model in another process, versions
    through the staging file in ``tmp_path``; every pause, wake and worker call, and every file write, in
    the order they happen (with whether the engine was paused, and whether the file was there)."""
    import safetensors.torch
    import vllm

    events: list[Any] = []
    core = Core(events, tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(vllm, "LLM", stand_in_llm(core))
    monkeypatch.setenv("VCPO_WEIGHT_STAGING", str(tmp_path))
    real_save = safetensors.torch.save_file

    def recorded_save(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        events.append(("write", core.paused, len(tensors)))
        real_save(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", recorded_save)
    engine = VllmEngine(VllmSettings(model=str(tiny_model_dir)))
    assert (engine._in_process, engine._model_here, engine.exact_in_flight) == (False, False, True)
    yield engine, core, events
    engine.close()


def test_a_broker_version_is_written_before_the_engine_pauses_and_only_reloaded_while_paused(
    gpu_layout: tuple[VllmEngine, Core, list[Any]],
    redis_client: redis.Redis,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """The real loop (pause mode) loads version 0 into an idle engine, then version 1 arrives while groups
    are generating: the file is written at once, the engine still generating (the loop steps it while the
    groups drain); only once they are done is it paused, for the reload alone, and woken."""
    engine, core, events = gpu_layout
    versions = Versions()
    sync = WeightSync(engine, versions, None)  # type: ignore[arg-type]
    sampler = stand_in_sampler(engine, redis_client, n=2, max_tokens=8, k=4, groups_per_step=2, sync=sync)
    assert sampler.max_requests_in_flight == MAX_NUM_SEQS  # the default: vLLM's max_num_seqs
    files = len(version_weights(tiny_model_dir, 0))

    versions.held[0] = version_weights(tiny_model_dir, 0)
    assert sync.poll()
    sampler.tick()
    assert engine.loaded_version == 0
    assert events == [
        ("write", False, files),  # the engine is not paused while the version is written
        ("pause", True),
        ("vcpo_reload_weights", True, True),  # paused, from the file
        ("wake", False),  # the file went once the workers had loaded it
    ]
    assert list(tmp_path.iterdir()) == []

    events.clear()
    assert core.requests  # the loop admitted groups after the load
    versions.held[1] = version_weights(tiny_model_dir, 1)
    assert sync.poll()
    steps = core.steps
    sampler.tick()  # version 1 is ready: written now, applied once the groups in flight are done
    assert events == [("write", False, files)] and sampler._draining
    for _ in range(3):
        sampler.tick()
    assert core.steps > steps and core.file_written()  # generating with the next version's file written
    assert events == [("write", False, files)] and engine.loaded_version == 0  # written once, not loaded
    core.finish = True
    while engine.loaded_version != 1:
        sampler.tick()
    assert events == [
        ("write", False, files),
        ("pause", True),
        ("vcpo_reload_weights", True, True),
        ("wake", False),
    ]
    assert sampler.emitted >= 1 and list(tmp_path.iterdir()) == []
    sampler.shutdown()


def test_a_version_that_cannot_be_written_never_pauses_the_engine(
    gpu_layout: tuple[VllmEngine, Core, list[Any]],
    redis_client: redis.Redis,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full /dev/shm: the write fails before any pause; the version is dropped (not tried every tick),
    the error is counted and named, the engine serves on and nothing is left in the staging directory."""
    from safetensors import SafetensorError

    engine, core, events = gpu_layout
    versions = Versions()
    sync = WeightSync(engine, versions, None)  # type: ignore[arg-type]
    sampler = stand_in_sampler(engine, redis_client, n=2, max_tokens=8, sync=sync)
    versions.held[0] = version_weights(tiny_model_dir, 0)
    sync.poll()
    sampler.tick()
    assert engine.loaded_version == 0
    events.clear()

    def full(tensors: Any, filename: str, metadata: Any = None) -> None:
        events.append(("write", core.paused, len(tensors)))
        Path(filename).write_bytes(b"part of it")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    versions.held[1] = version_weights(tiny_model_dir, 1)
    sync.poll()
    for _ in range(3):
        sampler.tick()
    assert [e[0] for e in events] == ["write"]  # once: no pause, no reload, no second try
    assert engine.loaded_version == 0 and sync.ready() is None and engine.staged_version() is None
    assert sampler.metrics.weight_errors.labels("sampler-0")._value.get() == 1
    assert "LoadNotStarted" in sync.error and "No space left on device" in sync.error
    assert list(tmp_path.iterdir()) == []
    sampler.shutdown()


def test_a_prepared_version_whose_reload_fails_is_undone_and_its_file_removed(
    gpu_layout: tuple[VllmEngine, Core, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The reload from a prepared file fails in a worker: the previous version is written and loaded back
    (inside the same pause), the engine serves it, and no file stays behind."""
    from services.sampler.engine import WorkerCallFailed
    from tests.sampler_helpers import load_into

    engine, core, events = gpu_layout
    serving = load_into(engine, version_weights(tiny_model_dir, 0))
    version = serving + 1
    sink = engine.stage(version)
    for name, tensor in version_weights(tiny_model_dir, 1).items():
        sink(name, tensor)
    engine.prepare(version)
    engine.prepare(version)  # a second call (the next tick) writes nothing again
    staging = tmp_path / STAGING_DIR.format(pid=os.getpid())
    assert (staging / "model.safetensors").exists()
    events.clear()
    core.fail_reloads = 1
    engine.quiesce()
    with pytest.raises(WorkerCallFailed, match="the worker died half-way"):
        engine.apply(version)
    engine.resume()
    calls = [e[0] for e in events]
    assert calls == [
        "pause",
        "vcpo_reload_weights",  # from the prepared file: fails (the worker finishes vLLM's reload state)
        "write",  # the previous version, for the restore
        "vcpo_reload_weights",
        "wake",
    ]
    assert engine.loaded_version == serving and list(tmp_path.iterdir()) == []


def test_a_version_replaced_while_its_file_is_written_gives_way_to_the_newer_one(
    gpu_layout: tuple[VllmEngine, Core, list[Any]],
    redis_client: redis.Redis,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weight-sync thread starts staging a newer version while the loop writes the file of the one it
    had: that one is not loaded (the loop takes the newer one once it is staged, no error), and its tensors
    are not kept alive by the file's record of them."""
    import safetensors.torch

    engine, _, events = gpu_layout
    versions = Versions()
    sync = WeightSync(engine, versions, None)  # type: ignore[arg-type]
    sampler = stand_in_sampler(engine, redis_client, n=2, max_tokens=8, sync=sync)
    versions.held[0] = version_weights(tiny_model_dir, 0)
    sync.poll()
    recorded_save = safetensors.torch.save_file

    def newer_arrives(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        recorded_save(tensors, filename, metadata)
        if engine.staged_version() == 0:
            engine.stage(1)  # the fetch thread begins version 1 (its tensors still on the way)

    monkeypatch.setattr(safetensors.torch, "save_file", newer_arrives)
    sampler.tick()
    assert [e[0] for e in events] == ["write"] and engine.loaded_version is None  # no pause, no load
    assert engine._file is not None and engine._file() is None  # version 0's tensors were let go
    assert sampler.metrics.weight_errors.labels("sampler-0")._value.get() == 0
    versions.held[1] = version_weights(tiny_model_dir, 1)
    sync.poll()
    sampler.tick()
    assert engine.loaded_version == 1
    assert [e[0] for e in events] == ["write", "write", "pause", "vcpo_reload_weights", "wake"]
    assert list(tmp_path.iterdir()) == []
    sampler.shutdown()


def test_a_worker_without_room_for_a_version_is_told_apart_from_the_failures_it_causes(
    gpu_layout: tuple[VllmEngine, Core, list[Any]],
) -> None:
    """A receive that failed because one worker's GPU had no room for the version raises ``NoRoom`` (the sampler
    then leaves the weight group for good), with that worker's own error first, whichever rank it is: the
    other workers' errors only echo the mark it left. Any other failure stays a ``WorkerCallFailed``."""
    from services.sampler.engine import WorkerCallFailed
    from services.weight_transport.receiver import NoRoom

    engine, _, _ = gpu_layout
    echo = (
        "TransferFailed: version 4: receiving failed: rank 2's part failed: version 4 (1.00 GiB) does not fit"
    )
    own = "NoRoom: rank 2's part failed: version 4: receiving failed: version 4 (1.00 GiB) does not fit on cuda:0"
    for states, error, first in (
        ([echo, own], NoRoom, own),
        ([echo, "TransferFailed: no version arrived"], WorkerCallFailed, echo),
    ):
        engine.llm.collective_rpc = lambda method, *a, states=states, **k: (
            states if method == "vcpo_weight_work" else [None] * len(states)
        )
        engine._weight_work = ("receive", 4)
        with pytest.raises(error) as info:
            engine.weight_work_done()
        assert str(info.value) == f"receiving version 4 failed in worker(s) 0, 1 of 2: {first}"
        assert engine.collective_staged is None and engine._weight_work is None
