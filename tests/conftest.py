"""Shared fixtures: one real redis-server per test session, a clean database per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
