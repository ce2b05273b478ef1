"""Start-up checks that need each node's own view: that ``run.run_dir`` is one directory on every node of a
multi-node run, and that where the samplers stage weight versions (``/dev/shm``) has room for one.

How: one Ray task per node (no resources, pinned to the node by ``NodeAffinitySchedulingStrategy``), started
before any model is downloaded, reads a token file the launcher has just written into ``run_dir`` and measures
the staging directory (``statvfs``). Nothing else runs on the nodes yet, so the answers come in seconds.

- ``run_dir`` must be shared on a run of several nodes (``launcher.ray_address`` with more than one alive
  node): the launcher reads the learner's ``steps.jsonl``, the replicas' ``*.endpoints.json`` and the API token
  from its own node, and a node-local directory gives an empty progress line and a ledger that does not
  balance. A node that cannot read the token refuses the run, naming the path and the node.
- ``/dev/shm``: a sampler whose engine's workers are processes of their own (on GPUs; with tensor
  parallelism) hands every version it takes from the weight broker to them as a safetensors file in
  ``VCPO_WEIGHT_STAGING`` (``/dev/shm`` by default; ``services/sampler/engine.py``, ``_write``). That is the
  first version of every replica and of a dedicated evaluator, whatever ``weight_broker.transport``: the
  weight group only serves members that hold a version already. Docker's default 64 MB ``/dev/shm`` fails
  that first load (``LoadNotStarted``) and the replica never leaves STARTING. Less room than one version is
  refused, naming the figures and ``docker run --shm-size``; room for one but not for every replica the node
  can hold loading at once is a warning (the replicas that do not fit wait for a later version).

The model's size is read from its safetensors headers (a local directory) or, for a hub id, from the hub's
safetensors metadata (the headers alone, kilobytes); a version is that many parameters in the learner's
precision (bf16: 2 bytes, fp32: 4).

This module imports nothing heavy at its top: its :func:`probe` is what each node's task imports.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deploy.config import SystemConfig
    from services.common.lora import LoraConfig

SHM_DIR = "/dev/shm"
# beyond the version's file: vLLM's message queues, NCCL's shared-memory transport and Ray's object store
# live in /dev/shm too
STAGING_MARGIN_BYTES = 256 << 20
PROBE_TIMEOUT_S = 60.0
TOKEN_FILE = ".vcpo-shared-check-{token}"


@dataclass(frozen=True)
class Probe:
    """One node's answer."""

    node: str  # its name as the launcher prints it (IP, with a short id where IPs repeat)
    read: str  # "" when it read the token from run_dir, else why not; "-" when not asked
    staging_dir: str
    staging_free: int  # bytes free there; -1 when not measured
    staging_total: int


def probe(token_file: str, token: str, staging: str) -> dict[str, Any]:
    """Run on a node: whether ``token_file`` holds ``token`` here, and the room in the staging directory
    (``staging``, or this node's ``VCPO_WEIGHT_STAGING``, else /dev/shm)."""
    out: dict[str, Any] = {"read": "-"}
    if token_file:
        try:
            found = Path(token_file).read_text()
            out["read"] = "" if found == token else f"it holds another run's token ({found[:16]!r})"
        except OSError as exc:
            out["read"] = f"{type(exc).__name__}: {exc}"
    directory = staging or os.environ.get("VCPO_WEIGHT_STAGING", SHM_DIR)
    out["staging_dir"] = directory
    try:
        st = os.statvfs(directory)
        out["staging_free"], out["staging_total"] = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        out["staging_free"] = out["staging_total"] = 0  # no such directory: no room at all
    return out


def probe_nodes(
    targets: list[tuple[str, str]],
    token_file: str,
    token: str,
    staging: str = "",
    timeout_s: float = PROBE_TIMEOUT_S,
) -> tuple[list[Probe], list[str]]:
    """:func:`probe` on each of ``targets`` ((Ray node id, name)); returns the answers and, for the nodes that
    gave none in ``timeout_s``, why."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(probe)
    refs = {
        name: task.options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), max_retries=0
        ).remote(token_file, token, staging)
        for node_id, name in targets
    }
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    probes, silent = [], []
    for name, ref in refs.items():
        try:
            got = ray.get(ref, timeout=0)
        except Exception as exc:  # not answered in time, or the task failed there
            ray.cancel(ref, force=True)
            silent.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        probes.append(
            Probe(name, got["read"], got["staging_dir"], int(got["staging_free"]), int(got["staging_total"]))
        )
    return probes, silent


def run_dir_problems(run_dir: Path, token_file: Path, probes: list[Probe]) -> list[str]:
    """Nodes that do not see ``run_dir`` as the launcher does."""
    return [
        f"node {p.node} does not see run.run_dir = {run_dir} as the launcher does: it cannot read the file "
        f"{token_file} the launcher has just written there ({p.read})"
        for p in probes
        if p.read not in ("", "-")
    ]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 2**20:.0f} MiB"


def staging_problems(
    probes: list[Probe], version_bytes: int, at_once: dict[str, int]
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for the staging directories: less room than one version (and the margin) on a
    node is refused; less than ``at_once[node]`` versions (the replicas the node can hold, loading together)
    is warned about."""
    refuse, warn = [], []
    for p in probes:
        if p.staging_free < 0:
            continue
        one = version_bytes + STAGING_MARGIN_BYTES
        where = f"node {p.node}: {p.staging_dir} has {_gb(p.staging_free)} free (of {_gb(p.staging_total)})"
        if p.staging_free < one:
            refuse.append(
                f"{where}, and a sampler hands each weight version ({_gb(version_bytes)}) to its engine's "
                f"workers as a file there: at least {_gb(one)} is needed"
            )
        elif (
            at_once.get(p.node, 1) > 1
            and p.staging_free < at_once[p.node] * version_bytes + STAGING_MARGIN_BYTES
        ):
            n = at_once[p.node]
            warn.append(
                f"{where}: room for {p.staging_free // version_bytes} of the {n} sampler replicas it can hold "
                f"loading a version ({_gb(version_bytes)}) at once; the others' loads wait for a later version"
            )
    return refuse, warn


SHM_ADVICE = (
    "Give it more room: in Docker, `docker run --shm-size=<bytes>` (or `--ipc=host`); on Kubernetes, the Helm "
    "chart's rayCluster.shmSize; or point VCPO_WEIGHT_STAGING at a larger tmpfs on every node"
)


# ---------------------------------------------------------------------------------------------- the model
def model_parameters(model: str) -> int | None:
    """Parameters of ``model`` (a directory, or a hub id) from its safetensors headers, without downloading
    the weights; None where they cannot be read (no safetensors, the hub unreachable)."""
    path = Path(model)
    if path.is_dir():
        from services.common.tiny_model import count_parameters

        return count_parameters(path) or None
    try:
        from huggingface_hub import get_safetensors_metadata

        return int(sum(get_safetensors_metadata(model).parameter_count.values())) or None
    except Exception:  # offline, private, no safetensors: the check runs once the model is local
        return None


def adapter_parameters(model: str, lora: LoraConfig) -> int | None:
    """Parameters of one adapter version of ``model`` (its LoRA adapters alone), from its config on the meta
    device; None where the config cannot be read yet (offline before the download)."""
    from services.learner.checkpoints import model_parameters as checkpoint_parameters

    try:
        return checkpoint_parameters(model, lora) or None
    except Exception:  # no config.json here or on the hub: the check runs once the model is local
        return None


def version_bytes(cfg: SystemConfig, parameters: int) -> int:
    """Bytes of one published version: the learner's parameters in its precision."""
    lr = cfg.learner
    bf16 = lr.precision == "bf16" or (lr.precision == "auto" and lr.gpus_per_rank > 0)
    return parameters * (2 if bf16 else 4)


def stages_through_files(cfg: SystemConfig) -> bool:
    """The samplers' engines load versions from a file in the staging directory: their workers are
    processes of their own (on GPUs, or with tensor parallelism)."""
    s = cfg.sampler
    return s.gpus_per_replica > 0 or s.tensor_parallel_size > 1


def replicas_on_node(cfg: SystemConfig, node_gpus: float) -> int:
    """The most engines (sampler replicas, a dedicated evaluator) one node of ``node_gpus`` GPUs can hold."""
    s, ev = cfg.sampler, cfg.evaluation
    engines = s.replicas + (1 if ev.sets and ev.placement == "dedicated" else 0)
    if s.gpus_per_replica <= 0:
        return engines
    return min(engines, math.floor(node_gpus / s.gpus_per_replica + 1e-6))


def new_token() -> str:
    return secrets.token_hex(8)


# ---------------------------------------------------------------------------------------------- one start
class NodeCheckError(ValueError):
    """A node cannot run its part of the run (run_dir not shared, no room to stage a version)."""


class NodeChecks:
    """The per-node checks of one start: :meth:`run` probes the nodes before any model is downloaded (and
    refuses a run_dir a node does not share); :meth:`check_staging` compares their staging room with a version
    once the model's size can be read (before the download where its headers can be, else after it)."""

    def __init__(self, cfg: SystemConfig, staging: str = "", timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.cfg = cfg
        self.staging = staging  # a staging directory to measure instead of each node's own (tests)
        self.timeout_s = timeout_s
        self.probes: list[Probe] = []
        self.node_gpus: dict[str, float] = {}
        self.staging_checked = not stages_through_files(cfg)

    def targets(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """(the nodes whose view of run_dir is checked, the nodes whose staging room is), as (id, name)."""
        import ray

        from deploy.preflight import Node, _named, demands, fits_alone

        alive = [n for n in ray.nodes() if n.get("Alive")]
        named = _named([(n["NodeManagerAddress"], n["NodeID"], n.get("Resources", {})) for n in alive])
        here = ray.get_runtime_context().get_node_id()
        shared: list[tuple[str, str]] = []
        if self.cfg.launcher.ray_address and len(alive) > 1:
            shared = [(n["NodeID"], m.name) for n, m in zip(alive, named, strict=True) if n["NodeID"] != here]
        engines = [d.resources for d in demands(self.cfg) if d.kind in ("sampler replica", "evaluator")]
        staging: list[tuple[str, str]] = []
        if not self.staging_checked:
            for n, m in zip(alive, named, strict=True):
                if any(fits_alone(r, Node(m.name, m.resources)) for r in engines):
                    staging.append((n["NodeID"], m.name))
                    self.node_gpus[m.name] = float(m.resources.get("GPU", 0.0))
        return shared, staging

    def run(self) -> str:
        """Probe the nodes that need it; NodeCheckError if one does not share run_dir. Returns what was
        checked ('' for nothing: a local Ray on CPU)."""
        shared, staging = self.targets()
        if not shared and not staging:
            return ""
        run_dir = self.cfg.run.run_dir
        token, token_file = new_token(), None
        if shared:
            token_file = run_dir / TOKEN_FILE.format(token=token)
            token_file.write_text(token)
        try:
            targets = list(dict.fromkeys(shared + staging))
            self.probes, silent = probe_nodes(
                targets, str(token_file or ""), token, self.staging, self.timeout_s
            )
        finally:
            if token_file is not None:
                token_file.unlink(missing_ok=True)
        for line in silent:
            print(f"  [!!] nodes          no answer to the start-up check from {line}: unchecked", flush=True)
        problems = run_dir_problems(run_dir, token_file, self.probes) if token_file else []
        if problems:
            raise NodeCheckError(
                "run.run_dir is not shared by every node of the Ray cluster:\n  "
                + "\n  ".join(problems)
                + "\nA run on several nodes needs run.run_dir on a filesystem every node mounts at the same "
                "path (NFS, a shared volume): the launcher reads the learner's steps, the replicas' endpoints "
                "and the API token there, and every service writes its logs there. Set run.run_dir to such a "
                "path."
            )
        said = []
        if shared:
            said.append(f"run_dir {run_dir} shared by all {len(shared) + 1} nodes")
        if staging:
            said.append(
                "staging room: "
                + ", ".join(f"{p.node} {_gb(p.staging_free)} free in {p.staging_dir}" for p in self.probes)
            )
        return "; ".join(said)

    def check_staging(self, model: str) -> str:
        """Compare the probed staging room with one version of ``model``; NodeCheckError where a node has
        less. Returns what was compared ('' when not yet: the model's size cannot be read before its
        download, or nothing stages through files)."""
        if self.staging_checked or not model:
            return ""
        lora = self.cfg.learner.lora
        parameters = adapter_parameters(model, lora) if lora.adapter_versions else model_parameters(model)
        if parameters is None:
            return ""
        self.staging_checked = True
        size = version_bytes(self.cfg, parameters)
        at_once = {name: replicas_on_node(self.cfg, gpus) for name, gpus in self.node_gpus.items()}
        refuse, warn = staging_problems(self.probes, size, at_once)
        if refuse:
            raise NodeCheckError(
                "no room to hand a weight version to the samplers' engines:\n  "
                + "\n  ".join(refuse)
                + f"\n{SHM_ADVICE}."
            )
        for line in warn:
            print(f"  [!!] staging        {line}", flush=True)
        what = "LoRA adapter " if lora.adapter_versions else ""
        return f"one {what}version is {_gb(size)} ({parameters:,} parameters); every sampler node has room for it"
