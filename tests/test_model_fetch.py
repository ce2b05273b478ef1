"""The policy named by a hub id is fetched once, by the launcher, and every service gets its local directory.

Nothing can be downloaded here, so the hub is a hub cache laid out as a download leaves it (blobs, the
snapshot's symlinks, ``refs/main``) with huggingface_hub in offline mode: the real ``snapshot_download``
resolves the id from it, the way it resolves an id it has fetched before. A spy around it counts the calls;
only where a node must download (a node-local cache) does a stand-in do the download's part, copying the files
into that node's cache."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from deploy import model_fetch
from deploy.config import SystemConfig, section
from deploy.launcher_setup import prepare_model
from services.common.model_dirs import checkpoint_shapes, resolve_model_dir
from services.common.tiny_model import run_model
from services.learner.config import LearnerServiceConfig
from services.sampler.config import SamplerServiceConfig

REPO = "vcpo-test/tiny"
SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    cache: Path
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def snapshot(self) -> Path:
        return self.cache / "models--vcpo-test--tiny" / "snapshots" / SHA


def _cache_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """``files`` (name -> source) as ``snapshot_download`` leaves them in ``cache``: content-addressed blobs,
    the snapshot's relative symlinks to them, and the ref naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / SHA
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        blob = hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, repo / "blobs" / blob)
        (snapshot / name).symlink_to(Path("../../blobs") / blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Hub:
    """REPO in this process's hub cache (the tiny model's files), offline, every snapshot_download counted."""
    cache = tmp_path / "hub"
    _cache_repo(cache, REPO, {p.name: p for p in tiny_model_dir.iterdir() if p.is_file()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    h = Hub(cache.resolve())
    real = huggingface_hub.snapshot_download

    def spy(repo_id: str, **kwargs: Any) -> Any:
        h.calls.append({"repo_id": repo_id, **kwargs})
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    return h


def _no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> str:
        raise AssertionError(f"a service called snapshot_download{args}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


def test_the_launcher_fetches_a_hub_id_once_and_every_service_loads_its_local_directory(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = SystemConfig.model_validate({"run": {"model": REPO, "run_dir": str(tmp_path / "run")}})
    resolved, what = prepare_model(cfg)

    assert [c["repo_id"] for c in hub.calls] == [REPO]  # once, by the launcher
    assert Path(resolved.run.model) == hub.snapshot and hub.snapshot.is_dir()
    assert str(hub.snapshot) in what and REPO in what
    # what is fetched: what the services load, not the .bin/.pt/.h5 copies of the weights hub repos also carry
    repo_files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "pytorch_model.bin",
        "model.pt",
        "tf_model.h5",
        "flax_model.msgpack",
    ]
    fetched = set(filter_repo_objects(repo_files, allow_patterns=hub.calls[0]["allow_patterns"]))
    assert fetched == set(repo_files[:10])

    # the services: each one's section of the config names the directory, and loading it asks the hub nothing
    _no_download(monkeypatch)
    sampler_cfg = section(resolved, SamplerServiceConfig)  # the sampler replicas' and the evaluator's
    sampler_dir = resolve_model_dir(run_model(sampler_cfg.run))
    assert sampler_dir == hub.snapshot
    assert checkpoint_shapes(sampler_dir)  # what the sampler's engine reads first
    learner_model = run_model(section(resolved, LearnerServiceConfig).run)  # every learner rank's
    assert Path(learner_model) == hub.snapshot
    model = AutoModelForCausalLM.from_pretrained(learner_model, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert AutoTokenizer.from_pretrained(learner_model).eos_token == "<|im_end|>"


def test_a_local_directory_and_the_tiny_model_are_never_looked_up_on_the_hub(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_download(monkeypatch)
    cfg = SystemConfig.model_validate({"run": {"model": str(tiny_model_dir), "run_dir": str(tmp_path)}})
    assert prepare_model(cfg)[0].run.model == str(tiny_model_dir)


def test_a_hub_id_that_cannot_be_fetched_or_has_no_safetensors_is_refused_naming_run_model(
    hub: Hub, tmp_path: Path
) -> None:
    cfg = SystemConfig.model_validate({"run": {"model": "vcpo-test/absent", "run_dir": str(tmp_path)}})
    with pytest.raises(RuntimeError, match=r"run\.model = 'vcpo-test/absent' is not a directory here"):
        prepare_model(cfg)

    legacy = tmp_path / "pytorch_model.bin"
    legacy.write_bytes(b"\0" * 64)
    config = hub.snapshot / "config.json"
    _cache_repo(hub.cache, "vcpo-test/legacy", {"config.json": config, "pytorch_model.bin": legacy})
    cfg = SystemConfig.model_validate({"run": {"model": "vcpo-test/legacy", "run_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match=r"run\.model = 'vcpo-test/legacy' has no \*\.safetensors"):
        prepare_model(cfg)


def _copying_hub(source: Path, calls: list[dict[str, Any]]) -> Callable[..., str]:
    """A download into a node's own cache: the files of ``source`` laid out there as the real one lays them."""

    def download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        cache = Path(kwargs["cache_dir"])
        snapshot = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / kwargs["revision"]
        if not snapshot.exists():
            _cache_repo(cache, repo_id, {p.name: p for p in source.iterdir()})
        return str(snapshot)

    return download


def test_a_node_that_sees_the_snapshot_fetches_nothing_and_one_with_its_own_cache_fetches_it_once(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runs on each node (``on_node``): a shared cache is complete there already; a node-local one gets the
    launcher's commit into the launcher's path, once for the node, whatever number of services it runs."""
    snapshot = model_fetch.download(REPO)
    files = model_fetch.manifest(snapshot)
    assert "model.safetensors" in files and all(size > 0 for size in files.values())

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _copying_hub(hub.snapshot, calls))
    assert model_fetch.on_node(REPO, SHA, snapshot, files)[1] is False  # shared: there, complete
    assert calls == []

    # another node: the same path, on a disk of its own, where nothing is yet
    other = tmp_path / "node-b" / "hub"
    there = str(other / "models--vcpo-test--tiny" / "snapshots" / SHA)
    assert not model_fetch.complete(there, files)
    assert model_fetch.on_node(REPO, SHA, there, files)[1] is True
    assert [(c["repo_id"], c["revision"], Path(c["cache_dir"])) for c in calls] == [(REPO, SHA, other)]
    assert model_fetch.complete(there, files)
    assert model_fetch.on_node(REPO, SHA, there, files)[1] is False  # the node's other services: nothing
    assert len(calls) == 1

    # a copy cut short (a node stopped mid-download) is not complete: that node fetches again
    truncated = Path(there) / "model.safetensors"
    data = truncated.read_bytes()
    truncated.unlink()
    truncated.write_bytes(data[: len(data) // 2])
    assert not model_fetch.complete(there, files)


@pytest.mark.slow
def test_on_a_ray_cluster_every_node_checks_the_launchers_snapshot_and_a_shared_one_is_fetched_once(
    hub: Hub, tmp_path: Path, ray_local: Any
) -> None:
    """With ``launcher.ray_address`` set, a real Ray task on each node (here the one local node) checks the
    launcher's snapshot path; it sees the files complete (one filesystem), so nothing is fetched twice."""
    cfg = SystemConfig.model_validate(
        {"run": {"model": REPO, "run_dir": str(tmp_path / "run")}, "launcher": {"ray_address": "auto"}}
    )
    resolved, what = prepare_model(cfg)
    assert len(hub.calls) == 1
    assert Path(resolved.run.model) == hub.snapshot
    assert "seen complete by all 1 node(s)" in what, what
