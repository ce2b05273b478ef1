"""Shared fixtures: one real redis-server per test session, a clean database per test."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from services.common.redis_server import LocalRedis

try:  # GPU tests are marked and skipped where there is no CUDA device
    import torch

    HAS_GPU = torch.cuda.is_available()
except ImportError:
    HAS_GPU = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """A real redis-server on a free port, started once for the whole session."""
    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: LocalRedis) -> Iterator[redis.Redis]:
    """A client on an emptied database (tests in one session share the server)."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_url(redis_server: LocalRedis, redis_client: redis.Redis) -> str:
    """The URL of the emptied test database, for subprocesses."""
    return redis_server.url


@pytest.fixture(autouse=True)
def _no_vcpo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config tests must not see VCPO_* variables of the developer's shell."""
    for name in list(os.environ):
        if name.startswith("VCPO_") and "__" in name:
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The default tiny Qwen2 model (seed 0), built once per session."""
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):  # type: ignore[no-untyped-def]
    """The session's one vLLM engine (CPU build, in this process) over the tiny model, float32.

    Tests that change its weights apply the version they need first; version numbers only grow, so each test
    asks ``next_version(vllm_engine)`` for a fresh one.
    """
    pytest.importorskip("vllm")
    from tests.sampler_helpers import in_process_engine

    engine = in_process_engine(tiny_model_dir, collective_weights=True)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def ray_local():  # type: ignore[no-untyped-def]
    """One local Ray for the test session (4 logical CPUs: the learner's bundles need one each)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def make_stack(
    redis_client: redis.Redis, redis_url: str, tiny_model_dir: Path, tmp_path: Path, vllm_engine: Any
) -> Iterator[Callable[..., Any]]:
    """Sampler stacks (tests/sampler_stack.py) on the session's engine, closed at the end of the test."""
    from tests.sampler_stack import Stack

    stacks: list[Stack] = []

    def make(k: int = 1, groups_per_step: int = 2, engine: Any = None, **sampler: Any) -> Stack:
        """``engine``: a wrapper of the session's engine to use instead of it."""
        stack = Stack(
            redis_client,
            redis_url,
            tiny_model_dir,
            tmp_path,
            engine or vllm_engine,
            k,
            groups_per_step,
            **sampler,
        )
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()
