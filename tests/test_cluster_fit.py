"""A run that cannot fit the Ray cluster is refused before any model is downloaded or loaded (deploy/preflight.py),
what Ray leaves unplaced is named (deploy/launcher_waits.py), and the per-node checks of a start
(deploy/preflight_nodes.py): run_dir shared by every node, room in /dev/shm for a weight version.

The Ray here is real: two nodes of 4 logical GPUs and 8 CPUs each on this machine (8 GPUs in all), started once
for this module. Not the session's ``ray_local`` (tests/conftest.py): that one has no GPUs and one node, and must
keep none (on a GPU machine logical GPUs would hide the real one from the tests that use it); the per-node
cases need two nodes. The checks' arithmetic is also tested on its own, on nodes described by hand.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.config import SystemConfig
from deploy.launcher_services import Services
from deploy.launcher_stopping import Stopping
from deploy.preflight import (
    ClusterFitError,
    Demand,
    Node,
    check_cluster_fit,
    demands,
    fit,
    preflight_cluster,
    totals,
)
from deploy.preflight_nodes import (
    SHM_DIR,
    NodeCheckError,
    NodeChecks,
    Probe,
    probe,
    staging_problems,
    version_bytes,
)
from services.common.config import load_config

ROOT = Path(__file__).parent.parent
PRESET_7B = ROOT / "deploy" / "presets" / "qwen2.5-7b-math.toml"
GPUS_PER_NODE, CPUS_PER_NODE = 4, 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine, 4 logical GPUs and 8 CPUs each; the test process is a driver on the
    first. A Ray the session started before (``ray_local``) is shut down meanwhile and started again after."""
    import ray
    from ray.cluster_utils import Cluster

    before = ray.cluster_resources() if ray.is_initialized() else None
    if before is not None:
        ray.shutdown()
    node = {"num_cpus": CPUS_PER_NODE, "num_gpus": GPUS_PER_NODE}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    c.add_node(**node)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()
    if before is not None:
        ray.init(
            num_cpus=int(before.get("CPU", 1)),
            num_gpus=int(before.get("GPU", 0)),
            include_dashboard=False,
            log_to_driver=False,
        )


def _cfg(tmp_path: Path, **sections: dict[str, Any]) -> SystemConfig:
    data: dict[str, Any] = {"run": {"run_dir": str(tmp_path / "run"), "model": str(tmp_path / "model")}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return SystemConfig.model_validate(data)


def _gpu_run(
    tmp_path: Path, ranks: int, replicas: int, gpus_per_replica: int = 1, **more: dict[str, Any]
) -> SystemConfig:
    sections: dict[str, dict[str, Any]] = {
        "learner": {"num_ranks": ranks, "gpus_per_rank": 1},
        "sampler": {
            "replicas": replicas,
            "gpus_per_replica": gpus_per_replica,
            "tensor_parallel_size": gpus_per_replica,
        },
        "reward": {"min_replicas": 1, "max_replicas": 2},
    }
    for name, values in more.items():
        sections[name] = {**sections.get(name, {}), **values}
    return _cfg(tmp_path, **sections)


# ---------------------------------------------------------------------------------------- the launcher
class _Hub(http.server.ThreadingHTTPServer):
    """A stand-in for the model hub (HF_ENDPOINT): it answers nothing and records every request."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.requests.append(self.path)
                self.send_error(404)

            do_HEAD = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _launch(
    cluster: Any, redis_url: str, run_dir: str | Path, *args: str, cwd: Path = ROOT, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m deploy.launch`` (as `make run` starts it) on the module's cluster; returns what it said and
    its wall time."""
    environ = {k: v for k, v in os.environ.items() if not (k.startswith("VCPO_") and "__" in k)}
    environ.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])), **env
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "deploy.launch", *args, "--run.run_dir", str(run_dir)),
            *("--run.redis_url", redis_url, "--launcher.ray_address", cluster.address),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,  # the old start waited up to launcher.start_timeout_s (600 s) for what never came
        env=environ,
    )
    return out, time.monotonic() - t0


SMALL_GPU_RUN = (  # deploy/presets/local.toml on GPUs: 2 learner ranks and 1 sampler replica, one GPU each
    "--config",
    str(ROOT / "deploy" / "presets" / "local.toml"),
    "--set",
    "learner.gpus_per_rank=1",
    "--set",
    "sampler.gpus_per_replica=1",
    "--set",
    "launcher.warm_start_steps=0",
)


@pytest.mark.slow
def test_the_7b_preset_is_refused_on_8_gpus_in_seconds_before_any_model_is_fetched(
    cluster: Any, tmp_path: Path, redis_url: str
) -> None:
    """deploy/presets/qwen2.5-7b-math.toml asks for 8 learner ranks and 8 sampler replicas, one GPU each: 16
    GPUs. On a cluster of 8 the learner's placement group used to take all of them, the samplers stayed pending
    and the start failed after launcher.start_timeout_s (600 s) with "the samplers were not generating". The
    launcher must refuse once Ray is up, naming both figures and the keys, and ask the hub for nothing."""
    hub = _Hub()
    hf_home = tmp_path / "hf"
    run_dir = tmp_path / "run"
    out, wall = _launch(
        cluster,
        redis_url,
        run_dir,
        "--config",
        str(PRESET_7B),
        HF_HOME=str(hf_home),
        HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}",
    )
    hub.shutdown()
    text = out.stdout + out.stderr
    print(f"refused after {wall:.1f}s (the launcher's process, imports and report included):\n{out.stdout}")
    assert out.returncode == 2, text  # a bad configuration for this cluster
    assert "the run does not fit the Ray cluster, which has 2 nodes" in text, text
    assert "GPUs: the run asks for 16, the cluster has 8" in text
    assert "learner ranks 8 x 1 = 8 (learner.num_ranks, learner.gpus_per_rank)" in text
    assert "sampler replicas 8 x 1 = 8 (sampler.replicas, sampler.gpus_per_replica" in text
    # nothing past the check ran: no model, no resolved config, no request to the hub, nothing in its cache
    assert "[ok] model" not in text and "[ok] cluster" not in text
    assert not (run_dir / "config.resolved.json").exists()
    assert hub.requests == []
    assert not (hf_home / "hub").exists() or not any((hf_home / "hub").iterdir())
    assert wall < 90, f"the refusal took {wall:.0f}s"


@pytest.mark.slow
def test_a_multi_node_start_whose_run_dir_a_node_does_not_share_is_refused_before_the_model(
    cluster: Any, tmp_path: Path, redis_url: str
) -> None:
    """The launcher runs in another directory than the one the other node's processes started in, and its
    run_dir is /proc/self/cwd/<name>: each process resolves it against its own working directory, as two
    machines resolve a node-local /data each to their own disk."""
    import ray

    launcher_dir = tmp_path / "launcher"
    launcher_dir.mkdir()
    name = f"run-{uuid.uuid4().hex[:8]}"
    out, wall = _launch(cluster, redis_url, f"/proc/self/cwd/{name}", *SMALL_GPU_RUN, cwd=launcher_dir)
    text = out.stdout + out.stderr
    other = next(n for n in ray.nodes() if n["NodeID"] != ray.get_runtime_context().get_node_id())
    assert out.returncode == 2, text  # a bad configuration for this cluster
    assert "[ok] cluster        the run needs 3 GPUs" in text, text  # it fits: the nodes' check refused it
    assert f"node {other['NodeManagerAddress']}/{other['NodeID'][:8]} does not see run.run_dir = " in text
    assert f"/proc/self/cwd/{name} as the launcher does" in text
    assert "[ok] model" not in text and not (launcher_dir / name / "model").exists()
    assert wall < 90


@pytest.mark.slow
def test_a_gpu_start_whose_dev_shm_cannot_hold_a_version_is_refused_naming_the_figures_and_the_flag(
    cluster: Any, tmp_path: Path, redis_url: str
) -> None:
    """The real /dev/shm of the nodes, and a model (its safetensors header) one bf16 version of which is 1 GB
    more than /dev/shm has free: what a Docker run with the default 64 MB /dev/shm meets with any real model."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    model = _model_dir(tmp_path / "model", (free + 10**9) // 2)
    out, wall = _launch(
        cluster,
        redis_url,
        tmp_path / "run",
        *SMALL_GPU_RUN,
        "--run.model",
        str(model),
        "--set",
        "learner.precision=bf16",
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text  # a bad configuration for this cluster
    assert "no room to hand a weight version to the samplers' engines" in text, text
    assert re.search(r"node \S+: /dev/shm has [\d.]+ GB free \(of [\d.]+ GB\), and a sampler hands", text)
    assert "docker run --shm-size=" in text
    assert "[ok] model" not in text
    assert wall < 90


@pytest.mark.slow
def test_a_run_that_fits_the_cluster_passes_and_one_that_does_not_is_refused(
    cluster: Any, tmp_path: Path
) -> None:
    fits = _gpu_run(tmp_path, ranks=4, replicas=4)
    line = preflight_cluster(fits)
    assert line.startswith("the run needs 8 GPUs, 9.5 CPUs; the Ray cluster has 2 nodes:"), line
    too_big = _gpu_run(tmp_path, ranks=4, replicas=5)
    t0 = time.monotonic()
    with pytest.raises(ClusterFitError) as err:
        preflight_cluster(too_big)
    assert time.monotonic() - t0 < 5
    text = str(err.value)
    assert "GPUs: the run asks for 9, the cluster has 8" in text
    assert "learner ranks 4 x 1 = 4 (learner.num_ranks, learner.gpus_per_rank)" in text
    assert "sampler replicas 5 x 1 = 5 (sampler.replicas, sampler.gpus_per_replica" in text
    assert 'launcher.cluster_fit = "warn"' in text
    # a dedicated evaluator's GPU counts too
    evaluating = _gpu_run(
        tmp_path,
        ranks=4,
        replicas=4,
        evaluation={
            "placement": "dedicated",
            "gpus": 1,
            "sets": [{"name": "held", "dataset": str(tmp_path / "held.jsonl")}],
        },
    )
    with pytest.raises(ClusterFitError, match=r"evaluators 1 x 1 = 1 \(evaluation.gpus"):
        preflight_cluster(evaluating)


@pytest.mark.slow
def test_one_process_needing_more_gpus_than_any_node_has_is_refused_though_the_total_fits(
    cluster: Any, tmp_path: Path
) -> None:
    """A tensor-parallel engine's GPUs are one process's: they must be on one node. 8 GPUs in all, 4 per node:
    a replica of tensor_parallel_size 8 can never be placed. The learner's PACK group may spread (PACK is
    Ray's preference, not a requirement), so 6 ranks beside a 2-GPU replica fit."""
    tp8 = _cfg(
        tmp_path,
        sampler={"replicas": 1, "gpus_per_replica": 8, "tensor_parallel_size": 8},
        reward={"min_replicas": 1, "max_replicas": 1},
    )
    with pytest.raises(ClusterFitError) as err:
        preflight_cluster(tp8)
    assert (
        "one sampler replica needs 8 GPUs, 1 CPU on one node, and no node has that (the most on one node: "
        "4 GPUs, 8 CPUs) (sampler.replicas, sampler.gpus_per_replica, sampler.tensor_parallel_size)"
    ) in str(err.value)
    assert "GPUs: the run asks for" not in str(err.value)  # the total is not what is short
    spread = _gpu_run(tmp_path, ranks=6, replicas=1, gpus_per_replica=2)
    assert "8 GPUs" in preflight_cluster(spread)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "replicas", "per_replica"), [(4, 4, 1), (6, 1, 2), (3, 1, 5), (2, 2, 3), (4, 5, 1), (2, 3, 2)]
)
def test_the_check_agrees_with_ray_placing_the_same_processes(
    cluster: Any, tmp_path: Path, ranks: int, replicas: int, per_replica: int
) -> None:
    """What the check says fits, Ray places; what it refuses, Ray cannot place: every process of the run as one
    placement group of its bundles (PACK, as the learner's), given back at once."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cfg = _gpu_run(tmp_path, ranks, replicas, per_replica)
    required = [d for d in demands(cfg) if d.required]
    verdict = not fit(required, [Node(f"n{i}", {"CPU": 8, "GPU": 4}) for i in range(2)])
    pg = placement_group([dict(d.resources) for d in required for _ in range(d.count)], strategy="PACK")
    try:
        placed = ray.get(pg.ready(), timeout=8) is not None if verdict else pg.wait(timeout_seconds=3)
    except ray.exceptions.GetTimeoutError:
        placed = False
    finally:
        remove_placement_group(pg)
    assert placed == verdict


# ---------------------------------------------------------------------------------- unplaced, by name
@pytest.fixture
def gpus_held(cluster: Any) -> Iterator[None]:
    """Every GPU of the cluster held by a placement group of someone else's."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 1}] * (2 * GPUS_PER_NODE), strategy="SPREAD")
    ray.get(pg.ready(), timeout=30)
    yield
    remove_placement_group(pg)


def _services(cfg: SystemConfig) -> Services:
    return Services(cfg, Stopping(), {}, time.monotonic())


@pytest.mark.slow
def test_sampler_replicas_ray_cannot_place_are_named_with_what_each_node_has_free(
    gpus_held: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    from deploy.config import section
    from services.sampler.config import SamplerServiceConfig
    from services.sampler.ray_actor import start_samplers

    cfg = _gpu_run(tmp_path, 1, 2, launcher={"unplaced_report_s": 0.5, "start_timeout_s": 4})
    services = _services(cfg)
    services.samplers, services.sampler_runs = start_samplers(section(cfg, SamplerServiceConfig))
    try:
        with pytest.raises(TimeoutError) as err:
            services.wait_samplers()
    finally:
        for a in services.samplers:
            ray.kill(a)
    text = str(err.value)
    assert text.startswith(
        "not placed by Ray after 4s: sampler replica 0: no node has 1 GPU free (free now: "
    ), text
    assert "0 of 4 GPU" in text and "and 1 more: sampler replica 1" in text
    assert "(sampler.replicas, sampler.gpus_per_replica, sampler.tensor_parallel_size)" in text
    assert "were not generating" not in text
    said = capsys.readouterr().out
    assert "[..] not placed   sampler replica 0: no node has 1 GPU free" in said  # long before the timeout


@pytest.mark.slow
def test_an_actor_is_pending_while_its_gpus_are_held_and_placed_once_they_are_free(cluster: Any) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from deploy.preflight import actor_pending

    @ray.remote(num_gpus=1, num_cpus=0)
    class Tiny:
        def ping(self) -> str:
            return "pong"

    holder = placement_group([{"GPU": 1}] * (2 * GPUS_PER_NODE), strategy="SPREAD")
    ray.get(holder.ready(), timeout=30)
    actor = Tiny.remote()  # type: ignore[attr-defined]
    try:
        time.sleep(1)
        assert actor_pending(actor)
    finally:
        remove_placement_group(holder)
    try:
        assert ray.get(actor.ping.remote(), timeout=60) == "pong"
        assert not actor_pending(actor)
    finally:
        ray.kill(actor)


@pytest.mark.slow
def test_a_learner_ray_cannot_place_is_named_and_its_reservation_given_back(
    cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cfg = _gpu_run(tmp_path, 2, 1, launcher={"unplaced_report_s": 0.5})
    services = _services(cfg)
    holder = placement_group([{"GPU": 1}] * (2 * GPUS_PER_NODE - 1), strategy="SPREAD")  # one GPU left free
    ray.get(holder.ready(), timeout=30)
    try:
        with pytest.raises(TimeoutError) as err:
            services.learner_room(timeout_s=3)
        assert "learner (2 ranks): room for 1 of its 2 (1 GPU, 1 CPU each) (free now: " in str(err.value)
        assert "[..] not placed   learner (2 ranks): room for 1 of its 2" in capsys.readouterr().out
    finally:
        remove_placement_group(holder)
    deadline = time.monotonic() + 10  # the reservation was given back: nothing holds the GPUs now
    while ray.available_resources().get("GPU", 0) < 2 * GPUS_PER_NODE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 2 * GPUS_PER_NODE
    t0 = time.monotonic()
    services.learner_room(timeout_s=10)  # room now: at once, and given back again
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------- run_dir and /dev/shm on each node
@pytest.mark.slow
def test_a_run_dir_every_node_sees_passes_on_two_nodes(cluster: Any, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, launcher={"ray_address": cluster.address})
    cfg.run.run_dir.mkdir(parents=True)
    checks = NodeChecks(cfg)
    assert checks.run() == f"run_dir {cfg.run.run_dir} shared by all 2 nodes"
    assert [p.read for p in checks.probes] == [""]  # the other node read the launcher's token
    assert list(cfg.run.run_dir.iterdir()) == []  # the token is removed


@pytest.mark.slow
def test_a_run_dir_another_node_sees_as_another_directory_is_refused_naming_path_and_node(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/self/cwd/<dir> is a path each process resolves against its own working directory: the launcher's
    (moved here) and the other node's processes' (where that node started) differ, as a node-local /data of
    two machines does."""
    import ray

    launcher_dir = tmp_path / "launcher"
    launcher_dir.mkdir()
    monkeypatch.chdir(launcher_dir)
    name = f"run-{uuid.uuid4().hex[:8]}"
    cfg = _cfg(tmp_path, launcher={"ray_address": cluster.address}, run={"run_dir": f"/proc/self/cwd/{name}"})
    cfg.run.run_dir.mkdir()
    other = next(n for n in ray.nodes() if n["NodeID"] != ray.get_runtime_context().get_node_id())
    with pytest.raises(NodeCheckError) as err:
        NodeChecks(cfg).run()
    text = str(err.value)
    assert f"does not see run.run_dir = /proc/self/cwd/{name} as the launcher does" in text
    assert f"node {other['NodeManagerAddress']}/{other['NodeID'][:8]}" in text
    assert "FileNotFoundError" in text and "filesystem every node mounts at the same path" in text
    assert list((launcher_dir / name).iterdir()) == []  # the token is removed


def _model_dir(path: Path, parameters: int) -> Path:
    """A model directory whose safetensors header declares ``parameters`` (the check reads headers only)."""
    path.mkdir(parents=True)
    header = json.dumps({"model.weight": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 0]}})
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return path


@pytest.mark.slow
def test_a_node_whose_staging_directory_cannot_hold_a_version_is_refused_naming_the_figures(
    cluster: Any, tmp_path: Path
) -> None:
    """On GPUs every sampler hands each version from the broker to its engine's workers as a file in /dev/shm
    (its first one whatever the transport): a node with less room refuses the run. The staging directory here
    is a real one (tmp_path), measured on each node by the node's own task."""
    cfg = _gpu_run(tmp_path, 2, 2, learner={"precision": "bf16"})
    staging = tmp_path / "staging"
    staging.mkdir()
    checks = NodeChecks(cfg, staging=str(staging))
    line = checks.run()
    assert line.startswith("staging room: ") and str(staging) in line
    assert len(checks.probes) == 2  # both nodes can hold a replica
    free = min(p.staging_free for p in checks.probes)
    small = _model_dir(tmp_path / "small", 1000)
    checks_small = NodeChecks(cfg, staging=str(staging))
    checks_small.run()
    assert "every sampler node has room" in checks_small.check_staging(str(small))
    huge = _model_dir(tmp_path / "huge", free // 2 + 1)  # bf16: one version is 2 bytes a parameter
    with pytest.raises(NodeCheckError) as err:
        checks.check_staging(str(huge))
    text = str(err.value)
    assert f"{staging} has " in text and "a sampler hands each weight version" in text
    assert "docker run --shm-size=" in text
    # with LoRA adapter versions a version is the adapters alone (counted from the model's config), which
    # fits where the whole model does not; merged versions are the whole model again
    from services.common.tiny_model import TinyModelSpec, qwen2_config

    qwen2_config(TinyModelSpec()).save_pretrained(huge)
    for publish, fits in (("adapter", True), ("merged", False)):
        lora = {"rank": 8, "publish": publish}
        collective = {"transport": "tcp" if publish == "adapter" else "collective"}
        cfg = _gpu_run(tmp_path, 2, 2, learner={"precision": "bf16", "lora": lora}, weight_broker=collective)
        checks = NodeChecks(cfg, staging=str(staging))
        checks.run()
        if fits:
            said = checks.check_staging(str(huge))
            assert "one LoRA adapter version is" in said and "every sampler node has room" in said, said
        else:
            with pytest.raises(NodeCheckError):
                checks.check_staging(str(huge))


@pytest.mark.slow
def test_a_cpu_run_of_one_node_probes_nothing(cluster: Any, tmp_path: Path) -> None:
    """On CPU with one engine worker the model is in the sampler's process: no file, no staging check; a run
    without launcher.ray_address has no other node to share run_dir with."""
    checks = NodeChecks(_cfg(tmp_path))
    assert checks.run() == "" and checks.probes == []
    assert checks.check_staging(str(_model_dir(tmp_path / "m", 10))) == ""


def test_the_probe_measures_dev_shm_by_default_and_reads_the_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc")
    got = probe(str(token), "abc", "")
    assert got["read"] == "" and got["staging_dir"] == os.environ.get("VCPO_WEIGHT_STAGING", SHM_DIR)
    st = os.statvfs(got["staging_dir"])
    assert got["staging_total"] == st.f_blocks * st.f_frsize
    assert probe(str(tmp_path / "missing"), "abc", str(tmp_path))["read"].startswith("FileNotFoundError")
    assert probe(str(token), "xyz", "")["read"].startswith("it holds another run's token")


# --------------------------------------------------------------------------------- the arithmetic alone
def test_docker_s_default_shm_is_refused_for_a_7b_version_with_the_flag_to_change() -> None:
    cfg = load_config(SystemConfig, [PRESET_7B], overrides=[("run.run_dir", "/tmp/x", "test")])
    size = version_bytes(cfg, 7_615_616_512)  # Qwen2.5-7B, bf16
    assert size == 15_231_233_024
    docker = Probe("10.0.0.1", "-", "/dev/shm", 64 << 20, 64 << 20)
    refuse, warn = staging_problems([docker], size, {"10.0.0.1": 8})
    assert refuse == [
        "node 10.0.0.1: /dev/shm has 64 MiB free (of 64 MiB), and a sampler hands each weight version "
        "(15.23 GB) to its engine's workers as a file there: at least 15.50 GB is needed"
    ]
    roomy = Probe("10.0.0.2", "-", "/dev/shm", 100 * 10**9, 500 * 10**9)
    refuse, warn = staging_problems([roomy], size, {"10.0.0.2": 8})
    assert refuse == [] and warn and "room for 6 of the 8 sampler replicas it can hold" in warn[0]
    assert staging_problems([roomy], size, {"10.0.0.2": 1}) == ([], [])


def test_the_demands_count_what_cfg_gpus_counts_for_every_preset() -> None:
    for preset in sorted((ROOT / "deploy" / "presets").glob("*.toml")):
        cfg = load_config(SystemConfig, [preset], overrides=[("run.run_dir", "/tmp/x", "test")])
        assert totals(demands(cfg)).get("GPU", 0.0) == cfg.gpus(), preset.name


def test_fractions_of_a_gpu_fit_only_in_what_one_device_has_left() -> None:
    one_gpu = [Node("a", {"CPU": 8, "GPU": 1})]
    halves = [Demand("sampler replica", 2, {"CPU": 1, "GPU": 0.5}, "k")]
    assert fit(halves, one_gpu) == []
    two_gpus = [Node("a", {"CPU": 8, "GPU": 2})]
    sixths = [Demand("sampler replica", 3, {"CPU": 1, "GPU": 0.6}, "k")]  # 1.8 of 2, but one per device
    assert fit(sixths, two_gpus) == [
        "1 of 3 sampler replica(s) (0.6 GPUs, 1 CPU each) find no node with room once the others are placed (k)"
    ]


def test_warn_mode_and_an_autoscaler_s_largest_size_start_anyway_or_refuse_beyond_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = [Node("10.0.0.1", {"CPU": 64, "GPU": 8})]
    cfg = _gpu_run(tmp_path, 8, 8)
    with pytest.raises(ClusterFitError, match="GPUs: the run asks for 16, the cluster has 8"):
        check_cluster_fit(cfg, nodes, None)
    warned = cfg.model_copy(update={"launcher": cfg.launcher.model_copy(update={"cluster_fit": "warn"})})
    assert 'starting anyway (launcher.cluster_fit = "warn")' in check_cluster_fit(warned, nodes, None)
    assert "[!!] cluster        GPUs: the run asks for 16" in capsys.readouterr().out
    grows = check_cluster_fit(cfg, nodes, {"CPU": 640, "GPU": 32})
    assert "starting anyway (the cluster's autoscaler can grow it to 32 GPUs, 640 CPUs)" in grows
    with pytest.raises(
        ClusterFitError, match="Even at its largest, as its autoscaler reports it, the cluster"
    ):
        check_cluster_fit(cfg, nodes, {"CPU": 640, "GPU": 12})


def test_reward_replicas_beyond_the_minimum_are_said_not_refused(tmp_path: Path) -> None:
    cfg = _gpu_run(tmp_path, 1, 1, reward={"min_replicas": 1, "max_replicas": 16})
    line = check_cluster_fit(cfg, [Node("a", {"CPU": 4, "GPU": 2})], None)
    assert "no room for all reward.max_replicas = 16 reward replicas: Serve runs those that fit" in line
