"""The policy named by a hub id, downloaded once before any service starts, and handed to them as a directory.

Every learner rank (``from_pretrained``) and every sampler replica (``resolve_model_dir``) would otherwise
fetch the model itself: for a 7B model, 16 processes pulling 15 GB at once inside the services' start
windows (``launcher.start_timeout_s``, vLLM's engine-ready timeout). So the launcher fetches it first, with
huggingface_hub's own ``snapshot_download`` (its cache, locks, resumption and Xet transfers), and puts the
snapshot's local directory in ``run.model`` of the config every service is given; a directory passes through
every loader unchanged (``services/common/model_dirs.py``).

The rule for where the files are:

- The cache is the launcher's hub cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``, as the launcher's environment says. The snapshot is
  ``<cache>/models--<org>--<name>/snapshots/<commit>``, and that one path is what every service loads.
- A local Ray (``launcher.ray_address`` empty) is this machine: one download, by the launcher.
- On a Ray cluster, after the launcher's own download, one task on each node a model-loading service can
  be placed on (those with a GPU when the learner ranks, the sampler replicas and a dedicated evaluator all
  take GPUs; else every node) checks that path. Where the cache is shared (the Helm chart's ``HF_HOME`` on its
  ReadWriteMany volume, or any shared mount at the same path), every file is there with its size, and
  nothing more is fetched. Where it is node-local, that node downloads the same commit into the same path
  once, for all the services placed on it. Either way the path is the same on every node.
- Progress: huggingface_hub's bars on a terminal (as ``HF_HUB_DISABLE_PROGRESS_BARS`` allows); in a log that
  is not a terminal (a Ray job's, a pod's), where tqdm's redrawn line never shows, a line every
  ``PROGRESS_EVERY_S``; the nodes' downloads are named every ``PROGRESS_EVERY_S`` while they go on.

Only the files the services load are fetched (``MODEL_FILES``: configs, tokenizer, chat template,
safetensors; no ``.bin``/``.pt`` duplicates); a repository without safetensors is refused here, with the key to
change, rather than by every sampler at its start.
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tqdm

from services.common.model_dirs import MODEL_FILES

if TYPE_CHECKING:  # what each node's task imports stays light
    from deploy.config import SystemConfig

PROGRESS_EVERY_S = 30.0


class _LineProgress(tqdm.tqdm):
    """huggingface_hub's progress bars as whole lines, one every ``PROGRESS_EVERY_S`` (and the last), for a log
    that is not a terminal. A plain tqdm subclass: huggingface_hub gives such a class no ``disable`` of its
    own (its own class turns itself off where stderr is not a terminal)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs["mininterval"] = kwargs["maxinterval"] = PROGRESS_EVERY_S
        kwargs["file"] = io.StringIO()  # what tqdm itself writes (a line end at close): this prints its own
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        # a bar nothing was counted on yet (Xet's transfer bar, over HTTP) says nothing; msg "" clears a bar
        if msg is None and (self.n or self.total):
            print(f"  model download: {self}", flush=True)
        return True


def hub_cache() -> str:
    """The hub cache directory huggingface_hub uses in this process (its environment at import)."""
    from huggingface_hub import constants

    return str(Path(constants.HF_HUB_CACHE).expanduser().resolve())


def manifest(snapshot: str | Path) -> dict[str, int]:
    """Relative path -> size of every file of a snapshot (through the cache's symlinks to its blobs)."""
    root = Path(snapshot)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def complete(snapshot: str | Path, files: dict[str, int]) -> bool:
    """Whether ``snapshot`` holds every file of ``files`` at its size (an interrupted copy does not)."""
    root = Path(snapshot)
    try:
        return all((root / name).stat().st_size == size for name, size in files.items())
    except OSError:
        return False


def download(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """``snapshot_download`` of the files the services load, into ``cache_dir`` (default: this process's hub
    cache), with progress that shows in a log too; returns the snapshot's directory."""
    import huggingface_hub
    from huggingface_hub.utils import are_progress_bars_disabled

    lines = not sys.stderr.isatty() and not are_progress_bars_disabled()
    return str(
        huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir or hub_cache(),
            allow_patterns=list(MODEL_FILES),
            tqdm_class=_LineProgress if lines else None,
        )
    )


def on_node(repo_id: str, revision: str, snapshot: str, files: dict[str, int]) -> tuple[str, bool, float]:
    """Run on one node: the snapshot there (``snapshot``, under the launcher's cache path), downloaded into that
    path if the node does not see it complete (a node-local cache). Returns (node IP, downloaded, seconds)."""
    import ray

    t0 = time.monotonic()
    fetched = False
    if not complete(snapshot, files):
        # ``snapshot`` is <cache>/models--<org>--<name>/snapshots/<commit>: the same cache gives the same path
        got = download(repo_id, revision, str(Path(snapshot).parents[2]))
        if Path(got) != Path(snapshot) or not complete(snapshot, files):
            raise RuntimeError(
                f"the download of {repo_id}@{revision} on this node gave {got}, not {snapshot}"
            )
        fetched = True
    return ray.util.get_node_ip_address(), fetched, time.monotonic() - t0


def model_nodes(cfg: SystemConfig) -> list[dict[str, Any]]:
    """The alive Ray nodes a service that loads the model can be placed on."""
    import ray

    ev = cfg.evaluation
    evaluator_gpu = not (ev.sets and ev.placement == "dedicated") or ev.gpus > 0
    gpu_only = cfg.learner.gpus_per_rank > 0 and cfg.sampler.gpus_per_replica > 0 and evaluator_gpu
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return [n for n in alive if not gpu_only or n.get("Resources", {}).get("GPU", 0) > 0]


def spread(cfg: SystemConfig, repo_id: str, snapshot: str, files: dict[str, int]) -> str:
    """Make ``snapshot`` complete on every node of :func:`model_nodes` (a task each, side by side); says what
    was done. A node that cannot (its disk, its network) fails the start, named."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(on_node)
    nodes = model_nodes(cfg)
    pending = {
        task.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(repo_id, Path(snapshot).name, snapshot, files): n["NodeManagerAddress"]
        for n in nodes
    }
    t0, fetched = time.monotonic(), []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PROGRESS_EVERY_S)
        for ref in done:
            address = pending.pop(ref)
            try:
                ip, downloaded, seconds = ray.get(ref)
            except Exception as exc:
                raise RuntimeError(
                    f"node {address} could not get {repo_id} into {snapshot} (its hub cache, the launcher's "
                    f"path): {exc}. Give every node a shared hub cache at that path (HF_HOME), or set run.model "
                    "to a directory every node has"
                ) from exc
            if downloaded:
                fetched.append(f"{ip} ({seconds:.0f}s)")
        if pending:
            print(
                f"  model download: still fetching {repo_id} on node(s) {', '.join(sorted(pending.values()))} "
                f"(node-local hub caches), {time.monotonic() - t0:.0f}s",
                flush=True,
            )
    if not fetched:
        return f"seen complete by all {len(nodes)} node(s)"
    return f"downloaded once on node(s) with a node-local hub cache: {', '.join(fetched)}"


def fetch_policy(cfg: SystemConfig, repo_id: str) -> tuple[str, str]:
    """The hub model ``repo_id`` (``run.model``) as a local snapshot directory that every node of the run sees
    (see the module docstring), and a description for the launcher's start-up lines."""
    cache = hub_cache()
    print(f"  model: fetching {repo_id} from the Hugging Face hub into {cache} ...", flush=True)
    t0 = time.monotonic()
    try:
        snapshot = download(repo_id, cache_dir=cache)
    except Exception as exc:
        raise RuntimeError(
            f"run.model = {repo_id!r} is not a directory here and could not be fetched as a hub id into "
            f"{cache} ({type(exc).__name__}: {exc}). Check the id (and HF_TOKEN for a gated model), or set "
            "run.model to a local model directory"
        ) from exc
    files = manifest(snapshot)
    if not any(name.endswith(".safetensors") for name in files):
        raise ValueError(
            f"run.model = {repo_id!r} has no *.safetensors weights on the hub (the services load only those; "
            f"fetched: {sorted(files)}): convert it to safetensors into a directory and set run.model to it"
        )
    size = sum(files.values()) / 1e9
    what = f"{repo_id} -> {snapshot} ({len(files)} files, {size:.2f} GB, {time.monotonic() - t0:.0f}s)"
    if cfg.launcher.ray_address:
        what += "; " + spread(cfg, repo_id, snapshot, files)
    return snapshot, what
