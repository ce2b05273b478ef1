"""Every shipped run fits the hardware it states, by the learner's own start-up estimate.

The shipped runs are found by globbing, never listed: the Helm chart's values.yaml and every helm/vcpo-rl/ci/*.yaml
(each rendered by the chart, its run file read back as the launcher reads it), and every deploy/presets/**/*.toml
(an overlay such as deploy/presets/released/math.toml layered on the preset its own usage line names). Each
states its hardware: a values file through the chart's gpuNodes values (count, gpusPerNode, gpuMemoryGB; a count
of 0, which the chart does not check, is taken as one node), a preset in a ``# hardware: {...}`` line of its
header (nodes, gpus_per_node, gpu_memory_gb; memory_gb for a run on CPUs).

For each, the learner's memory plan (services/learner/memory.py ``plan_memory``, which every rank runs before it
loads the model, and which refuses a step that cannot fit) is made with the arguments a rank would pass on that
hardware (services/learner/trainer.py, service.py): the model's config, the run's [learner] section, the
precision and device it resolves to on a GPU, the CUDA context, the weight group's broadcast buffers. The model's
config comes from tests/data/model_configs.json (each entry's config.json fields, by value, with its source), or
for an empty run.model from the tiny built-in model's spec. A GPU's budget is gpu_memory_gb × 10^9 bytes, below
what such a device reports (an 80GB H100: 79.1GiB), so a plan that fits here fits the GPU.
"""

from __future__ import annotations

import functools
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.config import SystemConfig
from services.common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "vcpo-rl"
PRESETS = ROOT / "deploy" / "presets"
MODEL_CONFIGS = ROOT / "tests" / "data" / "model_configs.json"
GB = 10**9

VALUES_FILES = [CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml"))]
PRESET_FILES = sorted(PRESETS.rglob("*.toml"))
SHIPPED = [p.relative_to(ROOT).as_posix() for p in [*VALUES_FILES, *PRESET_FILES]]


@dataclass(frozen=True)
class Hardware:
    """What a shipped file says it runs on."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float  # one GPU's, in GB (10^9 bytes); 0 on CPUs
    memory_gb: float = 0.0  # the machine's, for a run on CPUs
    product: str = ""  # the GPU product a values file selects its nodes by, where it does


@dataclass(frozen=True)
class Shipped:
    name: str
    cfg: SystemConfig
    hardware: Hardware
    spread_learner: bool = False  # a Helm learner allowed over several nodes (learner.spreadAcrossNodes)


def chart_values(path: Path) -> dict[str, Any]:
    """The values a release of ``path`` gets: the chart's, with a ci/ file's on top."""
    from tests.test_helm import scenario_values

    if path == CHART / "values.yaml":
        return dict(yaml.safe_load(path.read_text()))
    return scenario_values(path.name)


def _values_file(path: Path, tmp_path: Path) -> Shipped:
    from tests.test_helm import render, run_config

    values = chart_values(path)
    args: tuple[str, ...] = ()
    if path != CHART / "values.yaml":
        args = ("-f", str(path), "--api-versions", "monitoring.coreos.com/v1")
    _, cfg = run_config(render(*args), tmp_path)
    nodes = values["gpuNodes"]
    products = {
        values[c]["nodeSelector"].get("nvidia.com/gpu.product", "") for c in ("sampler", "learner")
    } - {""}
    assert len(products) <= 1, f"{path.name}: sampler and learner pods select different GPUs {products}"
    hardware = Hardware(
        nodes=max(int(nodes["count"]), 1),  # 0, unchecked at install: the run must fit one node
        gpus_per_node=int(nodes["gpusPerNode"]),
        gpu_memory_gb=float(nodes["gpuMemoryGB"]),
        product=next(iter(products), ""),
    )
    return Shipped(path.name, cfg, hardware, bool(values["learner"]["spreadAcrossNodes"]))


def preset_layers(path: Path) -> list[Path]:
    """The files a preset is used with, in order: those its header's usage line names with --config (an
    overlay on another preset), else the preset alone."""
    named = [ROOT / p for p in re.findall(r"--config\s+(deploy/presets/\S+\.toml)", path.read_text())]
    if not named:
        return [path]
    assert named[-1] == path, f"{path}: its usage line layers {named}, not ending with itself"
    return named


def stated_hardware(path: Path) -> dict[str, Any] | None:
    m = re.search(r"^# hardware: (\{.*?\})", path.read_text(), re.MULTILINE)
    return tomllib.loads(f"h = {m.group(1)}")["h"] if m else None


def _preset(path: Path) -> Shipped:
    layers = preset_layers(path)
    cfg = load_config(SystemConfig, layers, env={})
    stated = [h for h in map(stated_hardware, layers) if h is not None]
    assert stated, (
        f"{path.relative_to(ROOT)} (with {[p.name for p in layers]}) states no hardware: add a header line "
        '# hardware: {nodes = 1, gpus_per_node = 8, gpu = "H100 80GB", gpu_memory_gb = 80}'
    )
    h = stated[-1]
    hardware = Hardware(
        nodes=int(h["nodes"]),
        gpus_per_node=int(h["gpus_per_node"]),
        gpu_memory_gb=float(h.get("gpu_memory_gb", 0)),
        memory_gb=float(h.get("memory_gb", 0)),
        product=str(h.get("gpu", "")),
    )
    return Shipped(path.relative_to(PRESETS).as_posix(), cfg, hardware)


def shipped(name: str, tmp_path: Path) -> Shipped:
    path = ROOT / name
    return (
        _values_file(path, tmp_path) if path.parent.parent == CHART or path.parent == CHART else _preset(path)
    )


@functools.cache
def _model_table() -> dict[str, Any]:
    return dict(json.loads(MODEL_CONFIGS.read_text())["models"])


def hf_config(model: str) -> Any:
    """The model's config: the tiny built-in model's for an empty run.model, else the table's."""
    from transformers import AutoConfig

    if not model:
        from services.common.tiny_model import TinyModelSpec, qwen2_config

        return qwen2_config(TinyModelSpec())
    table = _model_table()
    assert model in table, (
        f"run.model {model!r} has no entry in {MODEL_CONFIGS.relative_to(ROOT)}: add its config.json's "
        "architecture fields there, with their source"
    )
    values = dict(table[model]["config"])
    return AutoConfig.for_model(values.pop("model_type"), **values)


@functools.cache
def _plan(model: str, learner_json: str, broker_json: str, budget: int) -> Any:
    """The plan a rank of this learner makes on a GPU of ``budget`` bytes (on CPUs: its share of the machine),
    with the arguments services/learner/trainer.py and service.py pass there."""
    from services.learner.config import LearnerConfig
    from services.learner.memory import CUDA_CONTEXT, plan_memory
    from services.weight_transport.config import WeightBrokerConfig

    learner = LearnerConfig.model_validate_json(learner_json)
    broker = WeightBrokerConfig.model_validate_json(broker_json)
    gpu = learner.gpus_per_rank > 0 and learner.backend != "gloo"  # nccl, as resolve_backend gives on a GPU
    precision = learner.precision if learner.precision != "auto" else ("bf16" if gpu else "fp32")
    collective = broker.transport == "collective"
    return plan_memory(
        hf_config(model),
        learner,
        precision,
        learner.num_ranks,
        budget,
        CUDA_CONTEXT if gpu else 0,
        broker.group_bucket_mb << 20 if gpu and collective else 0,
        "cuda" if gpu else "cpu",
    )


# ---------------------------------------------------------------------------------------------------- tests
def test_the_glob_finds_every_kind_of_shipped_file() -> None:
    """The chart's defaults, its ci/ files, the presets and their overlays are all taken (what the globs
    match, not a list kept here: a file added later is checked without being named)."""
    assert "helm/vcpo-rl/values.yaml" in SHIPPED
    assert len([n for n in SHIPPED if n.startswith("helm/vcpo-rl/ci/")]) == len(
        list((CHART / "ci").iterdir())
    )
    assert "deploy/presets/local.toml" in SHIPPED
    assert [n for n in SHIPPED if n.startswith("deploy/presets/released/")]
    assert len(PRESET_FILES) == len(list(PRESETS.rglob("*.toml")))


@pytest.mark.slow
def test_the_model_table_gives_each_models_published_size() -> None:
    """Each entry, built on the meta device, has the parameter count its model card states (in billions,
    cut to two decimals: 7,615,616,512 is the card's "7.61B")."""
    from services.learner.memory import model_shape

    for name, entry in _model_table().items():
        assert entry["source"] == f"https://huggingface.co/{name}/blob/main/config.json"
        params = model_shape(hf_config(name)).num_params
        assert params // 10**7 == round(entry["card_parameters_billions"] * 100), (name, params)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_run_states_hardware_its_gpus_fit(name: str, tmp_path: Path) -> None:
    """The file states its hardware; every pod or process fits one node, the learner one node (unless a
    Helm file lets it spread), and the whole run the nodes; a GPU product named agrees with the memory."""
    s = shipped(name, tmp_path)
    cfg, hw = s.cfg, s.hardware
    hf_config(cfg.run.model)  # the model is known
    learner_gpus = cfg.learner.num_ranks * cfg.learner.gpus_per_rank
    if hw.gpus_per_node == 0:
        assert cfg.gpus() == 0 and hw.memory_gb > 0, f"{name}: a run on CPUs states its machine's memory_gb"
        return
    assert hw.gpu_memory_gb > 0, f"{name}: states no GPU memory"
    assert cfg.gpus() <= hw.nodes * hw.gpus_per_node, (
        f"{name}: {cfg.gpus():g} GPUs on {hw.nodes} node(s) of {hw.gpus_per_node}"
    )
    assert cfg.sampler.gpus_per_replica <= hw.gpus_per_node, name
    assert cfg.evaluation.gpus <= hw.gpus_per_node, name
    assert learner_gpus <= hw.gpus_per_node or s.spread_learner, f"{name}: the learner spans nodes"
    sizes = re.findall(r"(\d+)GB", hw.product)
    assert not hw.product or sizes == [f"{hw.gpu_memory_gb:g}"], (name, hw)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_run_fits_its_stated_gpus_by_the_learners_estimate(name: str, tmp_path: Path) -> None:
    """The learner's start-up plan, on the stated GPU, accepts the run (a ValueError is the refusal every rank
    would raise at start), and its trajectories fit the model's positions."""
    s = shipped(name, tmp_path)
    cfg, hw = s.cfg, s.hardware
    learner = cfg.learner
    if hw.gpus_per_node == 0:  # ranks on CPUs share one machine's memory
        budget = int(hw.memory_gb * GB / learner.num_ranks)
    else:  # a rank with a fraction of a GPU plans within its share (memory.device_budget)
        share = learner.gpus_per_rank if 0 < learner.gpus_per_rank < 1 else 1.0
        budget = int(hw.gpu_memory_gb * GB * share)
    try:
        plan = _plan(cfg.run.model, learner.model_dump_json(), cfg.weight_broker.model_dump_json(), budget)
    except ValueError as exc:
        pytest.fail(f"{name} on its stated hardware {hw}: {exc}")
    assert plan.peak("recompute" if learner.memory_mode != "saved" else "saved") <= plan.usable
    positions = getattr(hf_config(cfg.run.model), "max_position_embeddings", 0)
    assert learner.max_sequence_tokens <= positions, (name, learner.max_sequence_tokens, positions)


# beside a version on a sampler's GPU: the CUDA context, NCCL's buffers, the layer vLLM's reload materializes
RECEIVE_MARGIN = 2 << 30


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_collective_run_leaves_room_for_a_version_on_every_sampler_gpu(
    name: str, tmp_path: Path
) -> None:
    """Under NCCL each engine's GPU worker receives a whole version into its GPU beside the engine
    (services/weight_transport/receiver.py), every tensor-parallel worker the whole model: what
    sampler.gpu_memory_utilization leaves free on the stated GPU holds it, with a margin."""
    from deploy.preflight_nodes import version_bytes
    from services.learner.memory import model_shape, version_params

    s = shipped(name, tmp_path)
    cfg, hw = s.cfg, s.hardware
    wb = cfg.weight_broker
    nccl = wb.group_backend == "nccl" or (wb.group_backend == "auto" and cfg.learner.gpus_per_rank > 0)
    if wb.transport != "collective" or not nccl or cfg.sampler.gpus_per_replica == 0:
        return  # versions come through the broker (LoRA adapter versions always do), or into host memory
    lora = cfg.learner.lora  # publish = "merged": the base's weights, the adapters merged in
    version = version_bytes(cfg, version_params(model_shape(hf_config(cfg.run.model), lora), lora))
    free = (1 - cfg.sampler.gpu_memory_utilization) * hw.gpu_memory_gb * GB
    assert free >= version + RECEIVE_MARGIN, (
        f"{name}: sampler.gpu_memory_utilization = {cfg.sampler.gpu_memory_utilization:g} leaves "
        f"{free / GB:.1f} GB of a {hw.gpu_memory_gb:g} GB GPU, and a version takes {version / GB:.1f} GB + "
        f"{RECEIVE_MARGIN / GB:.1f} GB there"
    )


def test_the_charts_learner_check_is_the_fixed_part_of_the_learners_estimate() -> None:
    """The chart's install-time bound on the learner's GPU memory (templates/_hardware.tpl) is the estimator's
    states and buffers for the same parameter count, so it refuses only what every rank would refuse; a 7B
    model on one rank of an 80GB GPU fails at install."""
    from services.learner.memory import (
        CUDA_CONTEXT,
        ModelShape,
        broadcast_buffer_bytes,
        model_state_bytes,
    )
    from tests.test_helm import errors, helm

    params = 7_615_616_512
    values = str(CHART / "ci" / "evaluation-values.yaml")
    flags = [
        "--set",
        "learner.ranks=1,learner.ranksPerPod=1",
        "--set",
        f"modelSize.parameters={params / 1e9}",
    ]
    shape = ModelShape(params, 0)  # the chart knows no weight's size: ZeRO-3's live-parameter floor
    fixed = sum(model_state_bytes(shape, "bf16", 1).values()) + CUDA_CONTEXT
    # the file's tcp transport, then the collective one, whose broadcast buffer the learner holds too
    collective = ["--set", "weightBroker.transport=collective,evaluation.placement=shared"]
    for extra, buffer in (([], 0), (collective, broadcast_buffer_bytes(shape, "bf16", 256 << 20))):
        out = helm("template", "r", str(CHART), "-f", values, *flags, *extra)
        assert out.returncode != 0
        m = re.search(r"on learner\.ranks = 1 takes ([\d.]+)GB per GPU", errors(out))
        assert m, errors(out)
        assert float(m.group(1)) == pytest.approx((fixed + buffer) / GB, abs=0.05)
        assert "raise learner.ranks" in errors(out) and "gpuNodes.gpuMemoryGB = 80GB" in errors(out)
    assert helm("template", "r", str(CHART), "-f", values).returncode == 0  # as shipped: 4 ranks


@pytest.mark.slow
def test_the_charts_learner_check_counts_a_lora_learners_frozen_base() -> None:
    """With learner.lora the chart's bound is the estimator's states and buffers for the same parameter count
    frozen (2 bytes a weight in bf16, no optimizer state): the adapters' own states, whose size the chart
    cannot know without the architecture, are left out, so it stays below the whole estimate (by about 1.5GB for
    Qwen2.5-7B at rank 16) and refuses only what every rank would. A 7B LoRA learner of one rank, which the
    estimate fits on an 80GB GPU (tests/test_memory.py) and full fine-tuning does not, passes at install."""
    from services.learner.config import LoraConfig
    from services.learner.memory import (
        CUDA_CONTEXT,
        ModelShape,
        broadcast_buffer_bytes,
        model_shape,
        model_state_bytes,
    )
    from tests.test_helm import errors, helm

    params = 7_615_616_512
    values = str(CHART / "ci" / "evaluation-values.yaml")
    one_rank = [
        "--set",
        "learner.ranks=1,learner.ranksPerPod=1",
        "--set",
        f"modelSize.parameters={params / 1e9}",
    ]
    flags = [*one_rank, "--set", "learner.lora.rank=16"]
    frozen = ModelShape(params, 0, trainable_params=0)  # the base alone; no weight's size: the 300M floor
    fixed = sum(model_state_bytes(frozen, "bf16", 1).values()) + CUDA_CONTEXT
    small = ["--set", "gpuNodes.gpuMemoryGB=16"]  # below the frozen base's 15.2GB + buffers
    merged = LoraConfig(rank=16, publish="merged")  # whole versions: the collective transport may send them
    collective = [
        "--set",
        "weightBroker.transport=collective,evaluation.placement=shared,learner.lora.publish=merged",
    ]
    for extra, buffer in (([], 0), (collective, broadcast_buffer_bytes(frozen, "bf16", 256 << 20, merged))):
        out = helm("template", "r", str(CHART), "-f", values, *flags, *small, *extra)
        said = errors(out)
        assert out.returncode != 0
        m = re.search(r"on learner\.ranks = 1 takes ([\d.]+)GB per GPU", said)
        assert m, said
        assert float(m.group(1)) == pytest.approx((fixed + buffer) / GB, abs=0.05)
        assert "at 2 bytes per parameter, the frozen base of a LoRA run (learner.lora.rank = 16)" in said
        assert "raise learner.ranks" in said and "gpuNodes.gpuMemoryGB = 16GB" in said
    # the learner's own figure for the model's real adapters: above the chart's by their states alone
    adapted = model_shape(hf_config("Qwen/Qwen2.5-7B"), LoraConfig(rank=16))
    assert adapted.num_params - adapted.trained == params  # the frozen base is the count the chart takes
    estimate = sum(model_state_bytes(adapted, "bf16", 1).values()) + CUDA_CONTEXT
    assert fixed < estimate < fixed + 2 * GB
    assert helm("template", "r", str(CHART), "-f", values, *flags).returncode == 0  # 80GB GPUs
    assert helm("template", "r", str(CHART), "-f", values, *one_rank).returncode != 0  # full fine-tuning


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_each_adapter_values_file_states_its_adapters_size(path: Path, tmp_path: Path) -> None:
    """A values file whose versions are LoRA adapters states their size (modelSize.adapterParameters, in
    millions), which the chart sizes the pods' versions by: at least the learner's own count of what a version
    holds, and within 1% of it, so the pods are neither short of room nor sized for much more."""
    from services.learner.memory import model_shape, version_params

    s = shipped(path.relative_to(ROOT).as_posix(), tmp_path)
    lora = s.cfg.learner.lora
    stated = float(chart_values(path)["modelSize"].get("adapterParameters", 0))
    if not lora.adapter_versions:
        assert stated == 0, f"{path.name}: modelSize.adapterParameters set without adapter versions"
        return
    held = version_params(model_shape(hf_config(s.cfg.run.model), lora), lora)
    assert stated * 1e6 >= held and stated * 1e6 <= 1.01 * held, (path.name, stated, held)


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_each_values_files_stop_grace_covers_the_launchers_stop_waits(path: Path, tmp_path: Path) -> None:
    """Kubernetes SIGKILLs a stopping RayJob after rayJob.stopGracePeriodSeconds; the launcher stops the
    evaluator, the samplers and the reward service one after another (launcher.stop_timeout_s each at most),
    then waits for the learner's final checkpoint (deploy/launcher_stopping.learner_stop_wait, from the
    parameters it holds: every weight, or a LoRA run's adapters, as services/learner/checkpoints.py
    model_parameters counts them). A grace shorter than that kills a 7B learner mid-checkpoint on every stop."""
    from deploy.launcher_stopping import learner_stop_wait
    from services.learner.checkpoints import checkpoint_bytes
    from services.learner.memory import model_shape

    values = chart_values(path)
    cfg = shipped(path.relative_to(ROOT).as_posix(), tmp_path).cfg
    stop = cfg.launcher.stop_timeout_s
    held = model_shape(hf_config(cfg.run.model), cfg.learner.lora).trained
    learner = learner_stop_wait(stop, checkpoint_bytes(held))
    needed = 3 * stop + learner.seconds
    grace = float(values["rayJob"]["stopGracePeriodSeconds"])
    assert grace >= needed, (
        f"{path.name}: rayJob.stopGracePeriodSeconds = {grace:g} < {needed:.0f} s the launcher may need to "
        f"stop ({3 * stop:g} s for the other services, then the learner: {learner.detail})"
    )
