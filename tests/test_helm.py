"""The Helm chart (helm/vcpo-rl): lints and renders every ci/ scenario, every rendered object validates against
the Kubernetes schemas (core objects, and the pod templates inside the RayJob) or its CRD (RayJob,
ServiceMonitor, PrometheusRule: vendored in tests/data/crds), the run file it renders is a run file the
launcher accepts and agrees with the pods it places, bad values fail at install with a message naming them."""

from __future__ import annotations

import copy
import functools
import json
import lzma
import math
import re
import shlex
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.config import SystemConfig
from services.common.config import add_config_arguments, config_from_args, load_config

ROOT = Path(__file__).parent.parent
HELM = ROOT / ".tools" / "bin" / "helm"
CHART = ROOT / "helm" / "vcpo-rl"
# the CRDs of the custom resources the chart renders, from KubeRay and the Prometheus operator (see README.md
# there: source, commit, refreshing), xz-compressed; each kind's file by (API group, kind)
CRDS = ROOT / "tests" / "data" / "crds"
CRD_FILES = {
    ("ray.io", "RayJob"): "ray.io_rayjobs.yaml.xz",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml.xz",
    ("monitoring.coreos.com", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml.xz",
}
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
MONITORING_API = "monitoring.coreos.com/v1"
K8S_VERSION = "1.31"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "run-health.json"
ENTRYPOINT = "python -m deploy.launch --config /etc/vcpo/run.toml --launcher.ray_address auto"


# The image the tests' releases run. The chart has no default (no public registry carries the image, and an
# install without image.repository fails: test_an_install_without_an_image_fails_naming_the_build_commands), so
# every `helm template` and `helm lint` of the chart here names one, as an installer must: this file goes
# first, so a ci/ file's own image (each names one) and --set win over it.
TEST_IMAGE = ROOT / "tests" / "data" / "helm-image-values.yaml"


def helm(*args: str, image: bool = True) -> subprocess.CompletedProcess[str]:
    """helm ``args``; a template or lint of the chart gets the tests' image (TEST_IMAGE) unless ``image`` is
    False."""
    assert HELM.exists(), f"{HELM} missing: `make setup` unpacks helm there"
    if image and args and args[0] in ("template", "lint") and str(CHART) in args:
        at = args.index(str(CHART)) + 1
        args = (*args[:at], "-f", str(TEST_IMAGE), *args[at:])
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, cwd=ROOT)


def errors(out: subprocess.CompletedProcess[str]) -> str:
    """stderr without helm's INFO lines about the files/ links it follows."""
    return "\n".join(line for line in out.stderr.splitlines() if "level=INFO" not in line)


@functools.cache
def _render(args: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    out = helm("template", "r", str(CHART), "--namespace", "rl", *args)
    assert out.returncode == 0, errors(out)
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(*args: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_render(args)))


def scenario_args(name: str) -> tuple[str, ...]:
    args = ("-f", str(CHART / "ci" / name))
    return (*args, "--api-versions", MONITORING_API) if name == "monitoring-values.yaml" else args


def merge_values(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` as Helm merges values files: tables deep, the rest replaced."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_values(base[key], value)
        else:
            base[key] = value
    return base


def scenario_values(name: str) -> dict[str, Any]:
    """The chart's values with the scenario's (``ci/<name>``) on top."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge_values(values, yaml.safe_load((CHART / "ci" / name).read_text()) or {})


def one(docs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    """The one object of ``kind`` named ``name_part`` (exactly, else containing it)."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name_part]
    found = found or [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"{len(found)} {kind} objects named *{name_part}*"
    return found[0]


def cluster(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayJob")["spec"]["rayClusterSpec"]


def group(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    spec = cluster(docs)
    if name == "head":
        return spec["headGroupSpec"]
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def container(g: dict[str, Any]) -> dict[str, Any]:
    return g["template"]["spec"]["containers"][0]


def run_config(docs: list[dict[str, Any]], tmp_path: Path) -> tuple[str, SystemConfig]:
    text = one(docs, "ConfigMap", "run-config")["data"]["run.toml"]
    path = tmp_path / "run.toml"
    path.write_text(text)
    return text, load_config(SystemConfig, [path], env={})


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# ---------------------------------------------------------------------------------------------------- CRDs
def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as a JSON schema that also refuses unknown fields (the API server would prune them
    silently: a misspelt field would be lost without an error)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def load_crd(group_name: str, kind: str) -> dict[str, Any]:
    """The vendored CRD of ``kind`` (never a skip: a missing file fails the test, naming it)."""
    name = CRD_FILES.get((group_name, kind))
    assert name, f"no CRD for {group_name} {kind} in CRD_FILES: vendor it in {CRDS} (see its README.md)"
    path = CRDS / name
    assert path.is_file(), f"{path} is missing: the CRD of {group_name} {kind} (see {CRDS}/README.md)"
    text = lzma.decompress(path.read_bytes()).decode()  # RayJob's: 1.4 MB, 25k lines
    crd: dict[str, Any] = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    found = (crd["spec"]["group"], crd["spec"]["names"]["kind"])
    assert found == (group_name, kind), f"{path} is the CRD of {found}, not of {kind}"
    return crd


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    group_name, version = api_version.split("/")
    crd = load_crd(group_name, kind)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return jsonschema.Draft7Validator(_strict(v["schema"]["openAPIV3Schema"]))
    served = [v["name"] for v in crd["spec"]["versions"]]
    raise AssertionError(f"{CRD_FILES[(group_name, kind)]} serves {served}, not {version}")


def is_custom(doc: dict[str, Any]) -> bool:
    """A custom resource (ray.io, monitoring.coreos.com); Kubernetes' own groups are core (v1) or *.k8s.io."""
    api_group = doc["apiVersion"].split("/")[0]
    return "." in api_group and not api_group.endswith(".k8s.io")


def validate(doc: dict[str, Any]) -> None:
    """A rendered object against its schema: the Kubernetes API's (strict) or its CRD's."""
    where = f"{doc['kind']} {doc['metadata']['name']}"
    if is_custom(doc):
        problems = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)
        ]
        assert not problems, f"{where} does not match its CRD:\n  " + "\n  ".join(problems)
    else:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from None
    if doc["kind"] == "RayJob":  # the pod templates again, with the Kubernetes API's own (strict) schema
        for name, template in pod_templates(doc):
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}
            try:
                kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{where}, {name}: {exc.message} at {list(exc.path)}") from None


def pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The pod templates of a rendered object, by name: a RayJob's head and worker groups and its submitter
    (where the chart writes one), a StatefulSet's or Deployment's template."""
    if doc["kind"] in ("StatefulSet", "Deployment"):
        return [(f"{doc['kind']} {doc['metadata']['name']}", doc["spec"]["template"])]
    if doc["kind"] != "RayJob":
        return []
    spec = doc["spec"]["rayClusterSpec"]
    found = [("group head", spec["headGroupSpec"]["template"])]
    found += [(f"group {g['groupName']}", g["template"]) for g in spec["workerGroupSpecs"]]
    if "submitterPodTemplate" in doc["spec"]:
        found.append(("submitter", doc["spec"]["submitterPodTemplate"]))
    return found


# ---------------------------------------------------------------------------------------------------- tests
def test_the_vendored_crds_are_the_ones_the_chart_renders() -> None:
    """tests/data/crds holds a CRD for each kind in CRD_FILES and nothing else, each that kind's; the
    scenarios render exactly those kinds of custom resource (a kind the chart starts rendering fails here)."""
    assert {p.name for p in CRDS.glob("*.xz")} == set(CRD_FILES.values()), f"{CRDS} and CRD_FILES disagree"
    for group_name, kind in CRD_FILES:
        load_crd(group_name, kind)
    docs = [d for scenario in SCENARIOS for d in render(*scenario_args(scenario))]
    rendered = {(d["apiVersion"].split("/")[0], d["kind"]) for d in docs if is_custom(d)}
    assert rendered == set(CRD_FILES), f"rendered custom resources {rendered}, CRD_FILES {set(CRD_FILES)}"


def test_every_scenario_is_tested() -> None:
    assert {
        "default-values.yaml",
        "external-redis-values.yaml",
        "monitoring-values.yaml",
        "multi-gpu-values.yaml",
        "environments-values.yaml",
        "evaluation-values.yaml",
        "lora-values.yaml",
    } <= set(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_lints(scenario: str) -> None:
    # (lint has no --api-versions: the monitoring objects are linted away; rendering tests them)
    out = helm("lint", str(CHART), "--strict", "-f", str(CHART / "ci" / scenario))
    assert out.returncode == 0, out.stdout + errors(out)


def test_an_install_without_an_image_fails_naming_the_build_commands() -> None:
    """No public registry carries the project's image, so values.yaml names none: an install without
    image.repository fails before any other check, with the value to set and the commands that build and push
    the image; with one, every pod the release runs (bar Redis) runs it, and so does an environment server
    the chart runs without an image of its own."""
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"] == {
        "repository": "",
        "tag": "",
        "pullPolicy": "IfNotPresent",
    }
    build = "docker build -f deploy/docker/Dockerfile.gpu -t <registry>/vcpo-rl-gpu:{tag} ."
    push = "docker push <registry>/vcpo-rl-gpu:{tag}"
    for flags, tag in (
        ((), "0.1.0"),  # the chart's appVersion
        (("--set", "image.tag=0.2.0-cu130"), "0.2.0-cu130"),
        (
            ("--set", "run.model=/data/models/ckpt"),
            "0.1.0",
        ),  # refused for its size too: the image comes first
        (("-f", str(CHART / "ci" / "environments-values.yaml"), "--set", "image.repository="), "0.1.0"),
    ):
        out = helm("template", "r", str(CHART), *flags, image=False)
        assert out.returncode != 0, flags
        assert "image.repository is not set" in errors(out), errors(out)
        assert f"{build.format(tag=tag)} && {push.format(tag=tag)}" in errors(out), errors(out)
        assert "--set image.repository=<registry>/vcpo-rl-gpu" in errors(out)
        assert "deploy/docker/Dockerfile.cpu" in errors(out)
    for dockerfile in ("Dockerfile.gpu", "Dockerfile.cpu"):  # the files the message names
        assert (ROOT / "deploy" / "docker" / dockerfile).is_file()
    assert (
        "docker build -f deploy/docker/Dockerfile.gpu -t <registry>/vcpo-rl-gpu:"
        in (ROOT / "deploy" / "docker" / "Dockerfile.gpu").read_text()
    )

    mine = ("--set", "image.repository=registry.example.com/rl/vcpo-rl-gpu", "--set", "image.tag=t1")
    docs = render(*scenario_args("environments-values.yaml"), *mine)
    images = {
        c["image"] for d in docs for _, template in pod_templates(d) for c in template["spec"]["containers"]
    }
    assert images == {
        "registry.example.com/rl/vcpo-rl-gpu:t1",
        one(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]["image"],
    }
    assert one(docs, "Deployment", "env-calculator")["spec"]["template"]["spec"]["containers"][0][
        "image"
    ] == ("registry.example.com/rl/vcpo-rl-gpu:t1")
    assert helm("template", "r", str(CHART), *mine, image=False).returncode == 0


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_names_its_own_image(scenario: str) -> None:
    """Each shipped values file renders without the tests' image: it names the image the release runs (`helm
    lint` skips the chart's `fail` checks, so this renders)."""
    out = helm("template", "r", str(CHART), *scenario_args(scenario), image=False)
    assert out.returncode == 0, errors(out)
    want = scenario_values(scenario)["image"]
    assert want["repository"] and want["repository"] != "registry.example.com/test/vcpo-rl-gpu"
    job = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "RayJob")
    assert {c["image"] for _, pod in pod_templates(job) for c in pod["spec"]["containers"]} == {
        f"{want['repository']}:{want['tag'] or '0.1.0'}"
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rendered_object_validates(scenario: str) -> None:
    docs = render(*scenario_args(scenario))
    kinds = {d["kind"] for d in docs}
    assert {"RayJob", "ConfigMap", "Service", "Secret"} <= kinds
    for doc in docs:
        validate(doc)


# Kubernetes' IANA_SVC_NAME (a container port's name, a Service's string targetPort): the schemas leave it out
PORT_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])(?!.*--)[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def port_names(node: Any) -> Iterator[str]:
    """Every container port name and string targetPort anywhere in ``node`` (pod templates inside the RayJob
    too)."""
    if isinstance(node, dict):
        if "containerPort" in node and "name" in node:
            yield node["name"]
        if isinstance(node.get("targetPort"), str):
            yield node["targetPort"]
        for value in node.values():
            yield from port_names(value)
    elif isinstance(node, list):
        for value in node:
            yield from port_names(value)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_port_name_is_one_kubernetes_accepts(scenario: str) -> None:
    # at most 15 characters: a longer one passed the schemas and failed at install (`launcher-metrics`)
    names = list(port_names(render(*scenario_args(scenario))))
    assert "vcpo-metrics" in names and "weight-group" in names  # it found the pods' ports
    assert [n for n in names if not PORT_NAME.match(n)] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_run_file_is_accepted_and_matches_the_pods(scenario: str, tmp_path: Path) -> None:
    values = scenario_values(scenario)
    docs = render(*scenario_args(scenario))
    _, cfg = run_config(docs, tmp_path)
    run = values["run"]
    assert (cfg.run.k, cfg.run.groups_per_step, cfg.run.model) == (
        run["k"],
        run["groupsPerStep"],
        run["model"],
    )
    assert cfg.sampler.n == values["sampler"]["groupSize"]
    assert cfg.sampler.dataset == values["data"]["dataset"]
    assert cfg.learner.checkpoint_every == values["learner"]["checkpointEvery"]
    assert cfg.streams.scored_maxlen == values["streams"]["scoredMaxlen"]
    assert str(cfg.run.run_dir).startswith(values["sharedStorage"]["mountPath"] + "/")
    assert cfg.run.redis_url == "" and not cfg.sampler.api_token.get_secret_value()  # from the pods' env only

    # the sizes and resources in the file are what the worker groups offer
    sampler, learner, reward = group(docs, "sampler"), group(docs, "learner"), group(docs, "reward")
    assert sampler["replicas"] == sampler["maxReplicas"] == cfg.sampler.replicas
    assert {k: float(v) for k, v in sampler["resources"].items()} == cfg.sampler.ray_resources
    learner_slots = learner["replicas"] * int(learner["resources"]["vcpo_learner"])
    assert learner_slots == cfg.learner.num_ranks * cfg.learner.ray_resources["vcpo_learner"]
    assert reward["maxReplicas"] == cfg.reward.max_replicas
    assert set(reward["resources"]) == set(cfg.reward.ray_resources)
    assert set(group(docs, "head")["resources"]) == set(cfg.weight_broker.ray_resources)
    assert cfg.reward.serve_ports == "configured" and cfg.sampler.port_per_replica is False

    # each service's ports in the file are ports its pods declare
    def ports(name: str) -> set[int]:
        return {p["containerPort"] for p in container(group(docs, name))["ports"]}

    assert {cfg.sampler.grpc_port, cfg.sampler.metrics_port} <= ports("sampler")
    assert {cfg.learner.grpc_port, cfg.learner.metrics_port} <= ports("learner")
    assert {cfg.reward.grpc_port, cfg.reward.metrics_port} <= ports("reward")
    wb = cfg.weight_broker
    assert {wb.grpc_port, wb.data_port, wb.metrics_port} <= ports("head")

    # a dedicated evaluator gets a group of its own that offers what the evaluator asks Ray for
    groups = {g["groupName"] for g in cluster(docs)["workerGroupSpecs"]}
    dedicated = bool(cfg.evaluation.sets) and cfg.evaluation.placement == "dedicated"
    assert ("evaluator" in groups) == dedicated
    if dedicated:
        evaluator = group(docs, "evaluator")
        assert evaluator["replicas"] == evaluator["maxReplicas"] == 1
        assert {k: float(v) for k, v in evaluator["resources"].items()} == cfg.evaluation.ray_resources
        assert container(evaluator)["resources"]["limits"].get("nvidia.com/gpu", 0) == cfg.evaluation.gpus
        assert cfg.evaluation.metrics_port in ports("evaluator")


def test_group_resources_and_gpus() -> None:
    docs = render()
    values = scenario_values("default-values.yaml")
    for name, gpus in (("sampler", 1), ("learner", 2), ("reward", 0), ("head", 0)):
        res = container(group(docs, name))["resources"]
        assert res["limits"].get("nvidia.com/gpu", 0) == gpus, name
        assert res["requests"].get("nvidia.com/gpu", 0) == gpus, name
        want = values[name]["resources"]
        assert (res["requests"]["cpu"], res["limits"]["memory"]) == (
            want["requests"]["cpu"],
            want["limits"]["memory"],
        ), name

    docs = render(*scenario_args("multi-gpu-values.yaml"))
    spec = cluster(docs)
    assert spec["enableInTreeAutoscaling"] is True
    sampler, learner, reward = group(docs, "sampler"), group(docs, "learner"), group(docs, "reward")
    assert (sampler["replicas"], container(sampler)["resources"]["limits"]["nvidia.com/gpu"]) == (4, 2)
    assert (learner["replicas"], container(learner)["resources"]["limits"]["nvidia.com/gpu"]) == (1, 8)
    assert (reward["minReplicas"], reward["maxReplicas"]) == (2, 8)
    for g in (sampler, learner):
        pod = g["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert container(g)["image"] == "registry.example.com/rl/vcpo-rl-gpu:0.1.0-cu130"
    assert "nvidia.com/gpu" not in container(reward)["resources"]["limits"]


def test_multi_gpu_run_file_uses_tensor_parallelism(tmp_path: Path) -> None:
    _, cfg = run_config(render(*scenario_args("multi-gpu-values.yaml")), tmp_path)
    assert (cfg.sampler.tensor_parallel_size, cfg.sampler.gpus_per_replica, cfg.sampler.replicas) == (2, 2, 4)
    assert (cfg.learner.num_ranks, cfg.learner.gpus_per_rank) == (8, 1)
    assert (cfg.learner.truncation, cfg.learner.precision) == (8.0, "bf16")  # from extraConfig


GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}


def tolerates(template: dict[str, Any], taint: dict[str, str]) -> bool:
    """Whether a pod template tolerates ``taint`` (Kubernetes' matching: an empty key with Exists tolerates
    every taint; an empty effect every effect)."""
    for t in template["spec"].get("tolerations", []):
        key_ok = (
            t.get("key", "") in ("", taint["key"])
            if t.get("operator") == "Exists"
            else (t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""))
        )
        if key_ok and t.get("effect", "") in ("", taint["effect"]):
            return True
    return False


def test_every_pod_of_the_multi_gpu_release_tolerates_the_gpu_taint() -> None:
    """multi-gpu-values.yaml is for a cluster whose GPU nodes are tainted: every pod the release makes (the Ray
    head, each worker group, the RayJob's submitter, Redis) tolerates the taint, so none is left pending
    where the GPU nodes are the only nodes; the submitter carries the private registry's pull secret too."""
    docs = render(*scenario_args("multi-gpu-values.yaml"))
    templates = [t for d in docs for t in pod_templates(d)]
    names = {name for name, _ in templates}
    assert {"group head", "group reward", "group sampler", "group learner", "submitter"} <= names
    assert any(n.startswith("StatefulSet") for n in names)  # Redis
    assert [name for name, t in templates if not tolerates(t, GPU_TAINT)] == []
    job = one(docs, "RayJob")["spec"]
    submitter = job["submitterPodTemplate"]["spec"]
    assert job["submissionMode"] == "K8sJobMode" and submitter["restartPolicy"] == "Never"
    assert submitter["imagePullSecrets"] == [{"name": "regcred"}]
    assert submitter["containers"][0]["image"] == container(group(docs, "head"))["image"]
    for doc in docs:
        validate(doc)


def test_tolerations_are_global_and_per_pod() -> None:
    """The global `tolerations` reach every pod the chart renders, before each one's own, each once; without
    them (and without pull secrets) the chart leaves KubeRay's default submitter alone."""
    assert "submitterPodTemplate" not in one(render(), "RayJob")["spec"]
    mine = {"key": "example.com/dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    env = "environments[0].server.command[0]=python"
    docs = render(
        "--set-json",
        f"tolerations={json.dumps([gpu])}",
        "--set-json",
        f"reward.tolerations={json.dumps([mine, gpu])}",
        "--set-json",
        f"redis.tolerations={json.dumps([mine])}",
        "--set",
        "environments[0].name=calc",
        "--set",
        env,
    )
    found = {name: t["spec"].get("tolerations") for d in docs for name, t in pod_templates(d)}
    assert any(n.startswith("Deployment") for n in found)  # the environment server
    for name, tolerations in found.items():
        want = [gpu, mine] if name in ("group reward", "StatefulSet r-vcpo-rl-redis") else [gpu]
        assert tolerations == want, name
    for doc in docs:
        validate(doc)
    out = helm("template", "r", str(CHART), "--set", "tolerations=gpu")
    assert out.returncode != 0 and "tolerations" in errors(out)


def test_a_learner_stays_on_one_node_unless_spreading_is_asked() -> None:
    """ZeRO-3 gathers every weight for each micro-batch: a learner is kept on one node. multi-gpu-values.yaml
    runs its 8 ranks in one pod; a learner of several pods gets a required podAffinity among its own pods
    (one node); learner.spreadAcrossNodes opts in to spreading them (podAntiAffinity, preferred), and only
    then may a learner need more GPUs than one node has."""
    mg = scenario_args("multi-gpu-values.yaml")
    learner = group(render(*mg), "learner")
    assert learner["replicas"] == 1 and container(learner)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "podAntiAffinity" not in learner["template"]["spec"].get("affinity", {})

    pods = group(render(*mg, "--set", "learner.ranksPerPod=4"), "learner")
    assert pods["replicas"] == 2
    affinity = pods["template"]["spec"]["affinity"]
    assert "podAntiAffinity" not in affinity
    (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    selector = term["labelSelector"]["matchLabels"]
    assert selector.items() <= pods["template"]["metadata"]["labels"].items()  # the learner pods' own labels
    assert selector["vcpo.io/component"] == "learner"
    assert term["matchLabelKeys"] == ["ray.io/cluster"]  # this job's cluster, not a replaced one's

    spread = group(
        render(*mg, "--set", "learner.ranksPerPod=4", "--set", "learner.spreadAcrossNodes=true"), "learner"
    )
    affinity = spread["template"]["spec"]["affinity"]
    assert "podAffinity" not in affinity
    (pref,) = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    # a learner affinity of one's own replaces the chart's rule; other affinity is kept beside it
    own = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    node = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}
                ]
            }
        }
    }
    docs = render(*mg, "--set", "learner.ranksPerPod=4", "--set-json", f"learner.affinity={json.dumps(own)}")
    assert group(docs, "learner")["template"]["spec"]["affinity"] == own
    docs = render(*mg, "--set", "learner.ranksPerPod=4", "--set-json", f"learner.affinity={json.dumps(node)}")
    assert group(docs, "learner")["template"]["spec"]["affinity"] == node | {"podAffinity": affinity_of(term)}
    for doc in docs:
        validate(doc)

    # 16 ranks cannot be on one node of 8 GPUs: refused unless spreading is asked
    big = (
        *mg,
        "--set",
        "learner.ranks=16,learner.ranksPerPod=8",
        "--set",
        "gpuNodes.count=3",
    )
    out = helm("template", "r", str(CHART), *big)
    assert out.returncode != 0 and "set learner.spreadAcrossNodes = true" in errors(out), errors(out)
    assert helm("template", "r", str(CHART), *big, "--set", "learner.spreadAcrossNodes=true").returncode == 0


def affinity_of(term: dict[str, Any]) -> dict[str, Any]:
    return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}


def test_the_gpu_node_checks_are_off_at_zero() -> None:
    """gpuNodes.count, gpusPerNode and gpuMemoryGB of 0 turn their checks off (a cluster the release does not
    size itself against)."""
    for flags in (
        ["sampler.replicas=7"],  # count 0, the default
        ["gpuNodes.gpusPerNode=0", "sampler.replicas=7"],
        ["gpuNodes.gpuMemoryGB=0", "learner.ranks=1", "learner.ranksPerPod=1"],
    ):
        out = helm("template", "r", str(CHART), *[a for f in flags for a in ("--set", f)])
        assert out.returncode == 0, (flags, errors(out))


def test_rayjob_runs_the_launcher_against_its_cluster(tmp_path: Path) -> None:
    docs = render()
    job = one(docs, "RayJob")
    assert job["spec"]["entrypoint"] == ENTRYPOINT
    assert "clusterSelector" not in job["spec"]  # it owns its cluster (values.yaml explains why)
    assert len(job["metadata"]["name"]) <= 47
    # the entrypoint's flags are the launcher's: parse them as deploy/launch.py does
    import argparse

    run_config(docs, tmp_path)  # writes tmp_path/run.toml
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "deploy.launch"]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SystemConfig)
    args = parser.parse_args(
        [str(tmp_path / "run.toml") if a == "/etc/vcpo/run.toml" else a for a in argv[3:]]
    )
    assert config_from_args(SystemConfig, args, env={}).launcher.ray_address == "auto"
    # the run file is mounted where the entrypoint reads it, in every Ray pod
    for g in [cluster(docs)["headGroupSpec"], *cluster(docs)["workerGroupSpecs"]]:
        mounts = {m["name"]: m["mountPath"] for m in container(g)["volumeMounts"]}
        volumes = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        assert mounts["run-config"] == "/etc/vcpo"
        assert (
            volumes["run-config"]["configMap"]["name"]
            == one(docs, "ConfigMap", "run-config")["metadata"]["name"]
        )
    env = {e["name"]: e for e in container(group(docs, "head"))["env"]}
    assert env["VCPO_WEIGHT_BROKER__ADVERTISE_HOST"]["value"] == "$(POD_IP)"  # the broker runs on the head
    assert json.dumps(job["spec"]["runtimeEnvYAML"]).count("RAY_JOB_STOP_WAIT_TIME_S") == 1


def test_the_job_is_replaced_exactly_when_its_definition_changes() -> None:
    def name(*args: str) -> str:
        return str(one(render(*args), "RayJob")["metadata"]["name"])

    base = name()
    assert name() == base
    assert name("--set", "run.k=16") != base
    assert name("--set", "sampler.replicas=3") != base
    assert name("--set", "image.tag=0.2.0") != base
    assert name("--set", "rayJob.redeployKey=again") != base
    assert name("--set", "monitoring.dashboard.enabled=true") == base  # not part of the job


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_objects_referenced_by_name_exist(scenario: str) -> None:
    values = scenario_values(scenario)
    docs = render(*scenario_args(scenario))
    rendered = {(d["kind"], d["metadata"]["name"]) for d in docs}
    external = {  # secrets the scenario says exist already
        values[k]["existingSecret"] for k in ("apiToken", "hub") if values[k]["existingSecret"]
    } | {
        s
        for s in (values["redis"]["auth"]["existingSecret"], values["redis"]["external"]["existingSecret"])
        if s
    }
    secret_refs = {
        n["secretKeyRef"]["name"] for n in walk(docs) if isinstance(n, dict) and "secretKeyRef" in n
    }
    assert secret_refs, "the pods get the Redis URL and the API token from Secrets"
    missing = {s for s in secret_refs if ("Secret", s) not in rendered} - external
    assert not missing, f"{scenario}: Secrets referenced but neither rendered nor given: {missing}"
    config_maps = {n["configMap"]["name"] for n in walk(docs) if isinstance(n, dict) and "configMap" in n}
    assert all(("ConfigMap", c) in rendered for c in config_maps)
    claims = {n["claimName"] for n in walk(docs) if isinstance(n, dict) and "claimName" in n}
    assert claims == {values["sharedStorage"]["existingClaim"] or "r-vcpo-rl-data"}
    assert (("PersistentVolumeClaim", "r-vcpo-rl-data") in rendered) != bool(
        values["sharedStorage"]["existingClaim"]
    )
    # every pod env var a Ray container gets: the Redis URL, the API token (and the hub token when given)
    env = {e["name"]: e for e in container(group(docs, "sampler"))["env"]}
    assert "VCPO_RUN__REDIS_URL" in env and "VCPO_SAMPLER__API_TOKEN" in env
    assert ("HF_TOKEN" in env) == bool(values["hub"]["token"] or values["hub"]["existingSecret"])


def test_redis_in_the_release_or_external() -> None:
    docs = render()
    sts = one(docs, "StatefulSet", "redis")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][redis["args"].index("--appendonly") + 1] == "yes"
    assert "$(REDIS_PASSWORD)" in redis["args"]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    url = next(e for e in container(group(docs, "learner"))["env"] if e["name"] == "VCPO_RUN__REDIS_URL")
    assert url["value"] == "redis://:$(REDIS_PASSWORD)@r-vcpo-rl-redis.rl.svc:6379/0"
    assert one(docs, "Service", "r-vcpo-rl-redis")  # the Service the URL names (not only the headless one)
    password = one(render("--set", "redis.auth.password=abc123"), "Secret", "redis")["data"]["password"]
    assert password == "YWJjMTIz"

    docs = render(*scenario_args("external-redis-values.yaml"))
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    url = next(e for e in container(group(docs, "head"))["env"] if e["name"] == "VCPO_RUN__REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "r-vcpo-rl-redis-url", "key": "url"}
    assert "REDIS_PASSWORD" not in {e["name"] for e in container(group(docs, "head"))["env"]}


@pytest.mark.parametrize("scenario", ["environments-values.yaml", "evaluation-values.yaml"])
def test_services_select_the_pods_that_serve_them(scenario: str) -> None:
    docs = render(*scenario_args(scenario))
    pods: list[dict[str, Any]] = [
        g["template"] for g in [cluster(docs)["headGroupSpec"], *cluster(docs)["workerGroupSpecs"]]
    ]
    pods += [d["spec"]["template"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        chosen = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
        assert chosen, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for pod in chosen:
                names = {p.get("name") for c in pod["spec"]["containers"] for p in c["ports"]}
                assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    api = one(docs, "Service", "r-vcpo-rl-sampler")
    assert api["spec"]["selector"]["vcpo.io/component"] == "sampler"
    assert api["spec"]["ports"] == [
        {"name": "grpc", "port": 50051, "targetPort": "vcpo-grpc", "protocol": "TCP"}
    ]
    metrics = {
        d["metadata"]["labels"]["vcpo.io/service"] for d in docs if d["metadata"]["name"].endswith("-metrics")
    }
    extra = {"evaluator"} if scenario == "evaluation-values.yaml" else set()  # its dedicated evaluator
    assert metrics == {
        "sampler",
        "learner",
        "reward",
        "weight_broker",
        "launcher",  # restarts by service (vcpo_service_restarts_total), from the head pod
        *extra,
    }  # the `service` label alerts use


def test_network_policy_admits_the_releases_own_pods_on_every_port() -> None:
    """networkPolicy.enabled: one NetworkPolicy over every pod of the release (the Ray pods, Redis, the
    environment servers), admitting the release's own pods on every port (NCCL and gloo pick theirs at random)
    and the head's dashboard to the RayJob's submitter and the KubeRay operator; none by default."""
    scenario = scenario_args(
        "environments-values.yaml"
    )  # Redis and an environment server besides the Ray pods
    assert not [d for d in render(*scenario) if d["kind"] == "NetworkPolicy"]
    docs = render(*scenario, "--set", "networkPolicy.enabled=true")
    policy = one(docs, "NetworkPolicy")
    validate(policy)
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"vcpo.io/release": "r"}}
    assert spec["policyTypes"] == ["Ingress"]  # the pods' own connections out are left alone
    own, dashboard = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"vcpo.io/release": "r"}}}]}  # no port list
    # every pod of the release is selected, and so admitted as a peer
    pods: list[dict[str, Any]] = [
        g["template"] for g in [cluster(docs)["headGroupSpec"], *cluster(docs)["workerGroupSpecs"]]
    ]
    pods += [d["spec"]["template"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    assert {p["metadata"]["labels"]["vcpo.io/component"] for p in pods} == {
        "head",
        "sampler",
        "learner",
        "reward",
        "redis",
        "env-calculator",
    }
    for pod in pods:
        assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # the head's Ray dashboard, which only the head serves (and takes job submissions): the submitter Job
    # (named after the RayJob) and the KubeRay operator's pods, in any namespace unless
    # networkPolicy.operatorNamespace names its own; never every pod of a namespace
    assert dashboard["ports"] == [{"port": 8265, "protocol": "TCP"}]
    dashboard_ports = {
        p["name"]: p["containerPort"] for pod in pods for c in pod["spec"]["containers"] for p in c["ports"]
    }
    assert dashboard_ports["dashboard"] == 8265
    assert [
        p
        for pod in pods[1:]
        for c in pod["spec"]["containers"]
        for p in c["ports"]
        if p["containerPort"] == 8265
    ] == []
    job = one(docs, "RayJob")["metadata"]["name"]
    operator = {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}
    assert dashboard["from"] == [
        {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": job}}},
        {"podSelector": {"matchLabels": {"job-name": job}}},  # before Kubernetes 1.27
        {"podSelector": operator, "namespaceSelector": {}},
    ]
    assert all("podSelector" in peer for peer in dashboard["from"])
    docs = render(
        *scenario, "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.operatorNamespace=kuberay"
    )
    policy = one(docs, "NetworkPolicy")
    validate(policy)
    assert policy["spec"]["ingress"][1]["from"][2] == {
        "podSelector": operator,
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}},
    }
    assert one(docs, "RayJob")["metadata"]["name"] == job  # the policy is not part of the job's definition
    out = helm(
        "lint",
        str(CHART),
        "--strict",
        "-f",
        str(CHART / "ci" / "environments-values.yaml"),
        "--set",
        "networkPolicy.enabled=true",
    )
    assert out.returncode == 0, out.stdout + errors(out)
    out = helm("template", "r", str(CHART), "--set", "networkPolicy.operatorNamespace=Kube_Ray")
    assert out.returncode != 0 and "/networkPolicy/operatorNamespace" in errors(out), errors(out)


def test_restart_settings_reach_the_launcher_and_its_metrics_are_served(tmp_path: Path) -> None:
    docs = render(
        "--set",
        "run.maxRestarts=3",
        "--set",
        "run.restartBackoffSeconds=5",
        "--set",
        "run.learnerHangTimeoutSeconds=90",
    )
    _, cfg = run_config(docs, tmp_path)
    assert (cfg.launcher.max_restarts, cfg.launcher.restart_backoff_s) == (3, 5.0)
    assert cfg.launcher.learner_hang_timeout_s == 90.0
    assert cfg.launcher.metrics_port == 9106
    svc = one(docs, "Service", "r-vcpo-rl-launcher-metrics")
    assert svc["spec"]["selector"]["vcpo.io/component"] == "head"
    assert svc["spec"]["ports"][0] == {
        "name": "metrics",
        "port": 9106,
        "targetPort": "launch-metrics",
        "protocol": "TCP",
    }
    _, defaults = run_config(render(), tmp_path)
    assert (defaults.launcher.max_restarts, defaults.launcher.restart_backoff_s) == (10, 2.0)
    assert defaults.launcher.learner_hang_timeout_s == 300.0


def test_the_papers_data_layout_and_scorers_by_source_reach_the_sampler(tmp_path: Path) -> None:
    docs = render(
        "--set",
        "data.answerField=reward_model.ground_truth",
        "--set-json",
        'data.scorerBySource={"openai/gsm8k": "gsm8k", "aime*": "math_dapo"}',
    )
    _, cfg = run_config(docs, tmp_path)
    assert (
        cfg.sampler.answer_field == "reward_model.ground_truth" and cfg.sampler.source_field == "data_source"
    )
    assert cfg.sampler.scorer_by_source == {"openai/gsm8k": "gsm8k", "aime*": "math_dapo"}
    _, defaults = run_config(render(), tmp_path)
    assert defaults.sampler.scorer_by_source == {}


def test_environments_are_registered_from_values(tmp_path: Path) -> None:
    docs = render(*scenario_args("environments-values.yaml"))
    _, cfg = run_config(docs, tmp_path)
    envs = {e.name: e for e in cfg.sampler.environments}
    assert envs["python"].builtin == "python" and envs["python"].max_turns == 5
    calc = envs["calculator"]
    assert calc.endpoint == "r-vcpo-rl-env-calculator.rl.svc:50070"
    assert (calc.tool_parser, calc.max_concurrency, calc.step_timeout_seconds) == ("json", 64, 10.0)
    assert cfg.sampler.dataset_environment == "python" and cfg.learner.rho_base == 0.55
    (held_out,) = cfg.evaluation.sets  # evaluated as episodes of the same interpreter
    assert (held_out.name, held_out.environment, held_out.n) == ("math500-tir", "python", 4)
    server = one(docs, "Deployment", "env-calculator")["spec"]["template"]["spec"]["containers"][0]
    assert server["command"][1] == "/opt/vcpo/examples/calculator_env.py"
    assert (ROOT / "examples" / "calculator_env.py").exists()


def test_environment_tls_and_token_secrets_reach_the_run_file_and_the_pods_that_register(
    tmp_path: Path,
) -> None:
    """environments[].tls and authTokenSecret: the run file's entries get tls = true and an auth_token_file
    that is the Secret's key as mounted, read-only, in the sampler and evaluator pods (which register
    environments) and in no other pod; the token is in no run file and no pod's environment. A builtin with
    either is refused at install, naming it; the Secret needs a name."""
    envs = [
        {
            "name": "calc",
            "endpoint": "calc.tools.svc:50070",
            "tls": True,
            "authTokenSecret": {"name": "calc-token"},
        },
        {
            "name": "search",
            "endpoint": "search.tools.svc:443",
            "authTokenSecret": {"name": "s-creds", "key": "bearer"},
        },
        {"name": "python", "builtin": "python"},
    ]
    held = [{"name": "held", "dataset": "/data/held.jsonl", "environment": "calc"}]
    docs = render(
        *(
            "--set-json",
            f"environments={json.dumps(envs)}",
            "--set-json",
            f"evaluation.sets={json.dumps(held)}",
        ),
        *("--set", "evaluation.placement=dedicated", "--set", "weightBroker.transport=tcp"),
        *("--set", "tls.envCaSecret=env-ca"),
    )
    text, cfg = run_config(docs, tmp_path)
    found = {e.name: (e.tls, e.auth_token_file, e.auth_token_env) for e in cfg.sampler.environments}
    assert found == {
        "calc": (True, "/etc/vcpo/env-tokens/calc/token", ""),
        "search": (False, "/etc/vcpo/env-tokens/search/token", ""),
        "python": (False, "", ""),
    }
    for name in ("sampler", "evaluator"):
        mounts = {m["name"]: m for m in container(group(docs, name))["volumeMounts"]}
        volumes = {v["name"]: v for v in group(docs, name)["template"]["spec"]["volumes"]}
        for env, secret, key in (("calc", "calc-token", "token"), ("search", "s-creds", "bearer")):
            mount, volume = mounts[f"env-token-{env}"], volumes[f"env-token-{env}"]["secret"]
            assert volume == {
                "secretName": secret,
                "items": [{"key": key, "path": "token"}],
                "defaultMode": 0o440,
            }
            assert mount["readOnly"] and f"{mount['mountPath']}/token" == found[env][1], (name, env)
    for name in ("head", "learner", "reward"):
        pod = group(docs, name)["template"]["spec"]
        assert not [v for v in pod["volumes"] if v["name"].startswith("env-token-")], name
        assert not [
            m for m in container(group(docs, name))["volumeMounts"] if m["name"].startswith("env-token-")
        ]
    secret_env = {  # Secrets that reach a container's environment
        e["valueFrom"]["secretKeyRef"]["name"]
        for d in docs
        for _, pod in pod_templates(d)
        for c in pod["spec"]["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secret_env and not {"calc-token", "s-creds"} & secret_env
    assert "calc-token" not in text and "s-creds" not in text
    for doc in docs:
        validate(doc)

    out = helm(
        *(
            "template",
            "r",
            str(CHART),
            "--set",
            "environments[0].name=py",
            "--set",
            "environments[0].builtin=python",
        ),
        *("--set", "environments[0].tls=true"),
    )
    assert out.returncode != 0
    assert 'environments "py": tls and authTokenSecret are for an endpoint or a server' in errors(out), (
        errors(out)
    )
    out = helm(
        *(
            "template",
            "r",
            str(CHART),
            "--set",
            "environments[0].name=calc",
            "--set",
            "environments[0].endpoint=h:1",
        ),
        *("--set", "environments[0].authTokenSecret.key=bearer"),
    )
    assert out.returncode != 0 and "/environments/0/authTokenSecret" in errors(out), errors(out)


def test_extra_config_merges_and_keeps_zero_values(tmp_path: Path) -> None:
    docs = render(
        "--set",
        "run.k=16",
        "--set",
        "run.groupsPerStep=32",
        # 32 groups per step: checkpoints every 25 steps keep (25 + 1) * 32 = 832 scored groups <= the 1024
        # the stream holds (a larger interval is refused: the learner acknowledges only at checkpoints)
        "--set-string",
        "extraConfig=[sampler]\nn = 4\ntemperature = 0.0\n[learner]\ncheckpoint_every = 25\n",
    )
    _, cfg = run_config(docs, tmp_path)
    assert (cfg.run.k, cfg.run.groups_per_step, cfg.sampler.n, cfg.learner.checkpoint_every) == (
        16,
        32,
        4,
        25,
    )
    assert cfg.sampler.temperature == 0.0  # a zero from extraConfig replaces the chart's 1.0
    _, cfg = run_config(render("--set-string", "extraConfig=[run]\nk = 0\n"), tmp_path)
    assert cfg.run.k == 0


def test_learner_lora_values_render_the_run_files_lora_table_only_when_a_rank_is_set(tmp_path: Path) -> None:
    """learner.lora reaches the run file's [learner.lora] as the launcher reads it; rank 0 (the default) renders
    no table (full fine-tuning), and extraConfig still merges into the table."""
    from services.common.lora import PROJECTIONS, LoraConfig

    text, cfg = run_config(render(), tmp_path)
    assert "[learner.lora]" not in text and cfg.learner.lora == LoraConfig()
    assert yaml.safe_load((CHART / "values.yaml").read_text())["learner"]["lora"] == {
        "rank": 0,
        "alpha": 0,
        "dropout": 0.0,
        "targetModules": list(PROJECTIONS),  # the learner's default
        "publish": "adapter",
    }
    text, cfg = run_config(render(*scenario_args("lora-values.yaml")), tmp_path)
    assert "[learner.lora]" in text
    assert cfg.learner.lora == LoraConfig(rank=16, alpha=32, target_modules=list(PROJECTIONS))
    assert cfg.learner.lora.adapter_versions and cfg.weight_broker.transport == "tcp"
    tcp = ("--set", "weightBroker.transport=tcp")
    _, cfg = run_config(
        render(
            *tcp,
            "--set",
            "learner.lora.rank=8,learner.lora.targetModules={q_proj,v_proj}",
            "--set-json",
            "learner.lora.dropout=0.05",  # (--set would give the string "0.05")
            "--set-string",
            "extraConfig=[learner.lora]\nalpha = 4\n",
        ),
        tmp_path,
    )
    lora = cfg.learner.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 4, 0.05, ["q_proj", "v_proj"])
    # merged versions are whole models: the collective transport carries them
    docs = render("--set", "learner.lora.rank=8,learner.lora.publish=merged")
    _, cfg = run_config(docs, tmp_path)
    assert cfg.learner.lora.publish == "merged" and cfg.weight_broker.transport == "collective"


def test_adapter_versions_over_the_collective_transport_fail_at_install_as_the_launcher_refuses_them(
    tmp_path: Path,
) -> None:
    """The chart refuses what deploy/config.py refuses at start (services/sampler/config.py,
    check_adapter_transport): adapter versions with weightBroker.transport collective, the chart's default,
    whether the rank comes from values or extraConfig; the message names the fix."""
    for flags in (
        ("--set", "learner.lora.rank=16"),
        ("--set-string", "extraConfig=[learner.lora]\nrank = 16\n"),
        ("-f", str(CHART / "ci" / "lora-values.yaml"), "--set", "weightBroker.transport=collective"),
    ):
        out = helm("template", "r", str(CHART), *flags)
        assert out.returncode != 0, flags
        said = errors(out)
        assert "learner.lora.rank = 16 with learner.lora.publish = adapter" in said, said
        assert "set weightBroker.transport = tcp" in said and "learner.lora.publish = merged" in said
    text, _ = run_config(render(*scenario_args("lora-values.yaml")), tmp_path)
    (tmp_path / "run.toml").write_text(text.replace('transport = "tcp"', 'transport = "collective"'))
    with pytest.raises(ValueError, match=r'set weight_broker\.transport = "tcp"'):
        load_config(SystemConfig, [tmp_path / "run.toml"], env={})


def test_evaluation_sets_come_through_extra_config(tmp_path: Path) -> None:
    extra = (
        '[evaluation]\nevery = 50\n[[evaluation.sets]]\nname = "gsm8k"\n'
        'dataset = "/data/gsm8k_test.parquet"\nn = 8\ntemperature = 0.0\n'
    )
    _, cfg = run_config(render("--set-string", f"extraConfig={extra}"), tmp_path)
    assert cfg.evaluation.every == 50 and cfg.evaluation.placement == "shared"
    assert [(s.name, s.dataset, s.n, s.temperature) for s in cfg.evaluation.sets] == [
        ("gsm8k", "/data/gsm8k_test.parquet", 8, 0.0)
    ]


def test_evaluation_sets_come_from_values_with_their_sampling_settings(tmp_path: Path) -> None:
    docs = render(*scenario_args("evaluation-values.yaml"))
    _, cfg = run_config(docs, tmp_path)
    ev = cfg.evaluation
    assert (ev.placement, ev.every, ev.at_start, ev.max_delay_s) == ("dedicated", 25, True, 30.0)
    math500, aime = ev.sets
    assert (math500.name, math500.dataset, math500.prompt_field, math500.answer_field, math500.scorer) == (
        "math500",
        "/data/eval/math500.jsonl",
        "problem",
        "answer",
        "math",
    )
    assert (math500.n, math500.temperature, math500.top_p, math500.max_tokens) == (4, 0.8, 0.7, 4096)
    assert (aime.n, aime.temperature, aime.every) == (16, 0.0, 50)  # a 0 (greedy) is kept, not dropped
    assert (aime.prompt_field, aime.scorer, aime.top_p) == ("", "", 0.7)  # unset: the defaults
    # the evaluator's pod: the samplers' GPUs (its engine is theirs), its own resources, their scheduling
    pod = group(docs, "evaluator")["template"]
    res = pod["spec"]["containers"][0]["resources"]
    samplers = container(group(docs, "sampler"))["resources"]["limits"]["nvidia.com/gpu"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == samplers == 1 == ev.gpus
    assert (res["limits"]["cpu"], res["limits"]["memory"]) == ("8", "64Gi")
    assert pod["spec"]["tolerations"] == group(docs, "sampler")["template"]["spec"]["tolerations"]
    assert pod["metadata"]["labels"]["vcpo.io/component"] == "evaluator"


def test_an_evaluator_group_exists_only_for_a_dedicated_evaluator_with_sets(tmp_path: Path) -> None:
    def groups(*args: str) -> set[str]:
        return {g["groupName"] for g in cluster(render(*args))["workerGroupSpecs"]}

    with_sets = ("-f", str(CHART / "ci" / "evaluation-values.yaml"))
    assert "evaluator" not in groups(*with_sets, "--set", "evaluation.placement=shared")
    assert "evaluator" not in groups(
        "--set", "evaluation.placement=dedicated"
    )  # no sets: nothing to evaluate
    # sets given through extraConfig count too: the group follows the merged run file
    extra = '[[evaluation.sets]]\nname = "gsm8k"\ndataset = "/data/gsm8k_test.parquet"\n'
    dedicated = ("--set", "evaluation.placement=dedicated", "--set-string", f"extraConfig={extra}")
    # with the collective transport the broker, outside the weight group, would hold too few versions for it
    out = helm("template", "r", str(CHART), "--namespace", "rl", *dedicated)
    assert out.returncode != 0 and "set evaluation.placement = shared" in errors(out), errors(out)
    docs = render(*dedicated, "--set", "weightBroker.transport=tcp")
    assert "evaluator" in {g["groupName"] for g in cluster(docs)["workerGroupSpecs"]}
    _, cfg = run_config(docs, tmp_path)
    assert [s.name for s in cfg.evaluation.sets] == ["gsm8k"] and cfg.evaluation.placement == "dedicated"
    for doc in docs:
        validate(doc)
    # without GPUs for the samplers (the CPU image), the evaluator asks for none either
    cpu = render(*with_sets, "--set", "sampler.gpusPerReplica=0", "--set", "learner.gpusPerRank=0")
    assert "nvidia.com/gpu" not in container(group(cpu, "evaluator"))["resources"].get("limits", {})


def test_monitoring_objects_need_the_operator_api() -> None:
    monitoring = ("-f", str(CHART / "ci" / "monitoring-values.yaml"))
    without = {d["kind"] for d in render(*monitoring)}
    assert not {"ServiceMonitor", "PrometheusRule"} & without
    docs = render(*monitoring, "--api-versions", MONITORING_API)
    assert {"ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}
    assert not {"ServiceMonitor", "PrometheusRule"} & {
        d["kind"] for d in render("--api-versions", MONITORING_API)
    }

    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"] == {"vcpo.io/release": "r", "vcpo.io/metrics": "true"}
    endpoint = monitor["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["interval"], endpoint["honorLabels"]) == ("metrics", "30s", True)
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["service"]["sourceLabels"] == ["__meta_kubernetes_service_label_vcpo_io_service"]
    assert relabel["run_id"]["replacement"] == "r"


def test_dashboard_config_map_has_the_sidecar_label() -> None:
    if not DASHBOARD.exists():
        pytest.skip(f"{DASHBOARD.relative_to(ROOT)} is not written yet")
    docs = render(*scenario_args("monitoring-values.yaml"))
    dashboard = one(docs, "ConfigMap", "dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "RL"}
    assert json.loads(dashboard["data"]["vcpo-run-health.json"]) == json.loads(DASHBOARD.read_text())
    custom = render(
        "--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.dashboard.labels.team=rl"
    )
    assert one(custom, "ConfigMap", "dashboard")["metadata"]["labels"]["team"] == "rl"
    assert not [d for d in render() if d["metadata"]["name"].endswith("-dashboard")]


def test_prometheus_rule_is_the_alerts_file() -> None:
    if not ALERTS.exists():
        pytest.skip(f"{ALERTS.relative_to(ROOT)} is not written yet")
    rule = one(render(*scenario_args("monitoring-values.yaml")), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    assert "{{ $labels.run_id }}" in json.dumps(rule)  # Prometheus' templates, untouched by Helm


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """``labels`` after a ServiceMonitor endpoint's relabelings (Prometheus' replace action, the only one the
    chart uses: the joined source labels matched by regex, the replacement expanded; an empty result drops the
    label)."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", rule
        value = rule.get("separator", ";").join(out.get(s, "") for s in rule.get("sourceLabels", []))
        m = re.fullmatch(rule.get("regex", "(.*)"), value)
        if m:
            result = m.expand(re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1")))
            if result:
                out[rule["targetLabel"]] = result
            else:
                out.pop(rule["targetLabel"], None)
    return {k: v for k, v in out.items() if not k.startswith("__")}


def scrape_targets(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, str]]]:
    """The targets Prometheus gets from the release's ServiceMonitor, as (component, labels): one per pod behind
    each -metrics Service it selects (a worker group at its most pods), labelled as the Prometheus
    operator labels an endpoint's targets (namespace, service, pod, job, endpoint, instance), then by the
    ServiceMonitor's relabelings, from the Service's labels."""
    monitor = one(docs, "ServiceMonitor")["spec"]
    (endpoint,) = monitor["endpoints"]
    pods = {g["groupName"]: int(g["maxReplicas"]) for g in cluster(docs)["workerGroupSpecs"]} | {"head": 1}
    targets = []
    for svc in docs:
        meta = svc["metadata"]
        if (
            svc["kind"] != "Service"
            or not monitor["selector"]["matchLabels"].items() <= meta["labels"].items()
        ):
            continue
        component = svc["spec"]["selector"]["vcpo.io/component"]
        (port,) = svc["spec"]["ports"]
        assert port["name"] == endpoint["port"]
        for i in range(pods[component]):
            labels = {
                f"__meta_kubernetes_service_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
                for k, v in meta["labels"].items()
            }
            labels |= {
                "namespace": "rl",
                "service": meta["name"],
                "job": meta["name"],
                "endpoint": endpoint["port"],
                "pod": f"r-{component}-worker-{i}",
                "instance": f"10.0.{len(targets)}.{i}:{port['port']}",
            }
            targets.append((component, relabel(labels, endpoint["relabelings"])))
    return targets


def test_service_down_fires_only_for_a_pod_that_should_serve(tmp_path: Path) -> None:
    """The recommended 16-GPU values (multi-gpu-values.yaml) with monitoring, a learner of two pods, and the
    reward group at its most pods (autoscaled up) while Serve is back at its fewest replicas (the pods idle
    until KubeRay's idleTimeoutSeconds): the targets the chart's ServiceMonitor makes, with the chart's
    PrometheusRule, under promtool. The learner pod without rank 0 and the reward pods without a Serve replica
    serve no /metrics (down, by design): VcpoServiceDown does not fire for them. It fires for a sampler pod
    that stops serving, for the learner once no learner pod serves (rank 0's down too), and for the reward
    service once none of its pods serves."""
    docs = render(
        *scenario_args("multi-gpu-values.yaml"),
        *("--set", "learner.ranksPerPod=4", "--api-versions", MONITORING_API),
        *(
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
        ),
    )
    targets = scrape_targets(docs)
    by = {c: [labels for comp, labels in targets if comp == c] for c, _ in targets}
    assert (len(by["learner"]), len(by["reward"]), len(by["sampler"])) == (2, 8, 4)
    minimum = scenario_values("multi-gpu-values.yaml")["reward"]["minReplicas"]
    # minute by minute (promtool's series notation): a sampler pod stops at 5, the learner's rank 0 at 20,
    # every reward replica at 30; the other learner pod and the reward pods beyond the minimum never serve
    values = {("sampler", 0): "1x4 0x45", ("learner", 0): "1x19 0x30", ("learner", 1): "0x50"}
    values |= {("reward", i): ("1x29 0x20" if i < minimum else "0x50") for i in range(len(by["reward"]))}
    series = []
    for component, labels in targets:
        index = by[component].index(labels)
        body = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        series.append({"series": f"up{{{body}}}", "values": values.get((component, index), "1x50")})
    rules = one(docs, "PrometheusRule")["spec"]["groups"]
    for rule in (r for g in rules for r in g["rules"]):
        rule.pop("annotations", None)  # alerts_test.yml checks the text; here only who fires
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rules}))

    def alert(labels: dict[str, str]) -> dict[str, Any]:
        return {"exp_labels": labels | {"severity": "critical"}}

    sampler = alert(by["sampler"][0])
    learner = alert({"run_id": "qwen7b-math", "service": "learner"})
    reward = alert({"run_id": "qwen7b-math", "service": "reward"})
    expected = {"9m": [], "11m": [sampler], "24m": [sampler], "26m": [sampler, learner]}
    expected |= {"34m": [sampler, learner], "36m": [sampler, learner, reward]}
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": when, "alertname": "VcpoServiceDown", "exp_alerts": alerts}
                    for when, alerts in expected.items()
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make setup` installs Debian's prometheus package"
    done = subprocess.run(
        [promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert {labels.get("metrics_pods") for labels in by["learner"] + by["reward"]} == {"some"}
    assert not [labels for labels in by["sampler"] + by["head"] if "metrics_pods" in labels]


def test_chart_reads_the_deploy_files_through_links(tmp_path: Path) -> None:
    for link, target in (("prometheus", "deploy/prometheus"), ("grafana", "deploy/grafana")):
        path = CHART / "files" / link
        assert path.is_symlink() and path.resolve() == (ROOT / target).resolve(), path
        assert path.resolve().is_dir(), f"{path} points at a missing {target}: every helm command would fail"
    out = helm("package", str(CHART), "--destination", str(tmp_path))
    assert out.returncode == 0, errors(out)
    with tarfile.open(next(tmp_path.glob("vcpo-rl-*.tgz"))) as tar:
        names = {n.removeprefix("vcpo-rl/") for n in tar.getnames()}
    assert {n for n in names if n.startswith("files/")} == {
        f"files/{p}"
        for p in ("prometheus/alerts.yml", "grafana/run-health.json")
        if (ROOT / "deploy" / p).exists()
    }
    assert not {n for n in names if n.startswith("ci/")}


def test_generated_secrets_are_kept_or_given() -> None:
    docs = render("--set", "apiToken.token=tok-123")
    assert one(docs, "Secret", "api-token")["data"]["token"] == "dG9rLTEyMw=="
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret"' in text  # an upgrade reads the generated value back instead of a new one
    docs = render("--set", "apiToken.existingSecret=mine", "--set", "hub.token=hf_x")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-api-token")]
    env = {e["name"]: e for e in container(group(docs, "reward"))["env"]}
    assert env["VCPO_SAMPLER__API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "token"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "r-vcpo-rl-hub"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["run.k=-1"], "/run/k"),
        (["run.groupsPerStep=0"], "/run/groupsPerStep"),
        (["run.kk=3"], "kk"),
        (["sampler.gpusPerReplica=-1"], "/sampler/gpusPerReplica"),
        (["sampler.maxRequestsInFlight=-1"], "/sampler/maxRequestsInFlight"),
        # the schema checks an objective name's form (the launcher, which sees the image's, the name itself)
        (["learner.objective=PPO-clip"], "/learner/objective"),
        (["learner.objectiveSettings=3"], "/learner/objectiveSettings"),
        (["sampler.service.type=Ingress"], "/sampler/service/type"),
        (["redis.auth.password=p@ss/word"], "/redis/auth/password"),
        (["monitoring.serviceMonitor.interval=soon"], "/monitoring/serviceMonitor/interval"),
        (["reward.minReplicas=0"], "/reward/minReplicas"),
        (["tls.apiSecrets=x"], "apiSecrets"),
        (
            ["environments[0].name=calc", "environments[0].builtin=python", "environments[0].endpoint=h:1"],
            "/environments/0",
        ),
        (["environments[0].name=Calc", "environments[0].builtin=python"], "/environments/0/name"),
        (["evaluation.placement=elsewhere"], "/evaluation/placement"),
        (["evaluation.sets[0].name=gsm8k"], "/evaluation/sets/0"),  # no dataset
        (
            ["evaluation.sets[0].name=gsm8k", "evaluation.sets[0].dataset=x.jsonl", "evaluation.sets[0].n=4"],
            "/evaluation/sets/0",
        ),  # samples, not n
        # checks the launcher would make at start-up, made at install
        (["streams.scoredMaxlen=100"], "streams.scored_maxlen = 100 is less than"),
        (["learner.ranks=3", "learner.ranksPerPod=2", "run.groupsPerStep=8"], "not a multiple of"),
        (["learner.ranks=4", "learner.ranksPerPod=4", "run.groupsPerStep=2"], "run.groupsPerStep = 2"),
        (["reward.minReplicas=3", "reward.maxReplicas=2"], "reward.maxReplicas = 2"),
        (["sampler.maxRequestsInFlight=4"], "sampler.maxRequestsInFlight = 4 is below sampler.groupSize = 8"),
        # a GPU learner with CPU samplers: every replica's engine would open cuda:0 beside the learner
        (
            ["sampler.gpusPerReplica=0", "rayCluster.shmSize=64Mi"],
            "sampler.gpusPerReplica = 0 while learner.gpusPerRank = 1",
        ),
        (["datasetEnvironment=nope"], 'datasetEnvironment = "nope"'),
        (
            [
                "evaluation.sets[0].name=a",
                "evaluation.sets[0].dataset=x.jsonl",
                "evaluation.sets[0].environment=nope",
            ],
            'evaluation set "a": environment "nope" is not one of the environments',
        ),
        (["extraConfig=[sampler]\nreplicas = 9\n"], "extraConfig sets sampler.replicas"),
        (["extraConfig=[learner\n"], "extraConfig is not valid TOML"),
        (["learner.lora.rank=-1"], "/learner/lora/rank"),
        (["learner.lora.dropout=1"], "/learner/lora/dropout"),
        (["learner.lora.publish=full"], "/learner/lora/publish"),
        (["modelSize.adapterParameters=-1"], "/modelSize/adapterParameters"),
        (["learner.lora.targetModules={.q_proj}"], "/learner/lora/targetModules/0"),
        (["learner.lora.rnak=8"], "rnak"),
        (['extraConfig=[evaluation]\nplacement = "dedicated"\n'], "extraConfig sets evaluation.placement"),
        # pods too small for the model's weights (templates/_sizing.tpl)
        (
            ["sampler.resources.limits.memory=16Gi"],
            "sampler.resources.limits.memory = 16Gi is below the 18Gi",
        ),
        (["run.model=/data/models/ckpt"], "set modelSize.parameters"),
        # pods against the GPU nodes the release states (templates/_hardware.tpl)
        (["gpuNodes.count=1", "sampler.replicas=7"], "the pods ask for 9 GPUs"),
        (["gpuNodes.gpusPerNode=1", "sampler.gpusPerReplica=2"], "sampler.gpusPerReplica = 2 is more than"),
        (["learner.ranks=16", "learner.ranksPerPod=16", "run.groupsPerStep=16"], "a learner pod asks for"),
        (
            ["learner.ranks=1", "learner.ranksPerPod=1", "gpuNodes.gpuMemoryGB=16"],
            "the learner cannot fit its GPUs",
        ),
    ],
)
def test_bad_values_fail_at_install(flags: list[str], message: str) -> None:
    args = [
        a for flag in flags for a in ("--set-string" if flag.startswith("extraConfig") else "--set", flag)
    ]
    out = helm("template", "r", str(CHART), *args)
    assert out.returncode != 0
    assert message in errors(out), errors(out)


def test_values_file_documents_every_key() -> None:
    """Every leaf of values.yaml has a comment line above it, and the schema knows every key."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing tables
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9_]*):(\s.*)?$", line)
        if not m:
            continue
        indent = len(m.group(1))
        stack = [s for s in stack if s[0] < indent]
        documented = lines[i - 1].strip().startswith("#") or any(d for _, d in stack)
        if (m.group(3) or "").strip():
            if not documented:
                undocumented.append(m.group(2))
        else:  # a table: documented itself, or through its leaves
            stack.append((indent, documented))
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"

    def check(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        node = schema["definitions"][node["$ref"].split("/")[-1]] if "$ref" in node else node
        for key, value in values.items():
            assert key in node.get("properties", {}), f"values.schema.json lacks {path}{key}"
            if isinstance(value, dict) and node["properties"][key].get("additionalProperties") is False:
                check(value, node["properties"][key], f"{path}{key}.")

    check(yaml.safe_load((CHART / "values.yaml").read_text()), schema, "")


def test_deploy_guide_names_real_paths_and_values() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"`((?:helm|deploy|examples|services|tests|scripts)/[^`\s*<>{}]*)`", guide))
    assert paths
    assert not [p for p in paths if not (ROOT / p.rstrip("/")).exists()], "docs/deploy.md names missing paths"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    keys = set(re.findall(r"--set(?:-string)? ([A-Za-z][\w.]*)=", guide))
    assert keys
    for key in keys:
        node: Any = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"docs/deploy.md sets unknown value {key}"
            node = node[part]


# ------------------------------------------------------------------- memory and /dev/shm from the model size
GIB = 2**30


def minimums(
    billions: float,
    gpus: int = 1,
    dtype_bytes: int = 2,
    retain: int = 2,
    in_memory: bool = True,
    collective: bool = True,
    nccl: bool = True,
    ranks_per_pod: int = 2,
    adapter_millions: float = 0.0,
) -> dict[str, int]:
    """docs/deploy.md's rule ("Memory and /dev/shm"), written out again, in whole Gi: W = the whole model's
    weights; ``nccl``: the weight group's backend is NCCL (a GPU learner), under which GPU workers receive
    versions into their GPUs, not into the pod's host memory; ``adapter_millions``: versions are LoRA adapters
    of that many million parameters, held wherever a version is, with the frozen base in a CPU engine."""
    w = billions * 1e9 * dtype_bytes / GIB
    base = w if adapter_millions and not gpus else 0.0  # a CPU engine holds the frozen base in host memory
    w = adapter_millions * 1e6 * dtype_bytes / GIB if adapter_millions else w  # one version
    broker_path = (3 if gpus else 2) * w + base + 6 + 2 * max(1, gpus)
    # with the collective transport over gloo (or in a CPU sampler) each engine worker receives the broadcast
    # version into its own host memory; under NCCL each GPU worker receives it into its GPU
    received = max(1, gpus) if collective and not (nccl and gpus) else 0
    return {
        # staged + previous version + the /dev/shm file (tmpfs is the pod's memory) + the engine's processes,
        # + the versions the weight group's receivers hold in host memory
        "sampler": math.ceil(broker_path + received * w),
        "evaluator": math.ceil(broker_path),  # a dedicated evaluator takes its versions from the broker
        "shm": math.ceil(w + 4) if gpus else 0,  # the file vLLM's workers read + NCCL, vLLM, Ray
        # the broker's retained versions + the one being published, in memory; the launcher, Ray
        "head": math.ceil((retain + 1) * w + 8) if in_memory else 8,
        # the ranks' processes; with the collective transport, the version rank 0 stages to broadcast from
        "learner": math.ceil((w if collective else 0) + 6 + 2 * ranks_per_pod),
    }


def most_gpu_memory_utilization(billions: float, gpu_gb: float, dtype_bytes: int = 2) -> float:
    """The highest sampler.gpu_memory_utilization that leaves one version + 2GiB of a ``gpu_gb`` GPU free
    (docs/deploy.md, "Memory and /dev/shm"), rounded down to 2 decimals."""
    need = billions * 1e9 * dtype_bytes + 2 * GIB
    return math.floor((1 - need / (gpu_gb * 1e9)) * 100) / 100


def test_minimums_of_the_documented_examples() -> None:
    # the examples docs/deploy.md gives, from the rule above (the collective transport, the chart's default,
    # under NCCL; the evaluator's figure is the tcp transport's sampler's, which under NCCL is the same)
    m15, m7, m762 = minimums(1.5 * 1.1), minimums(7 * 1.1), minimums(7.62)
    # Qwen2.5-1.5B, size from its name; Qwen2.5-7B, likewise; modelSize.parameters=7.62
    assert m15 == {"sampler": 18, "evaluator": 18, "shm": 8, "head": 18, "learner": 14}
    assert m7 == {"sampler": 52, "evaluator": 52, "shm": 19, "head": 52, "learner": 25}
    assert m762 == {"sampler": 51, "evaluator": 51, "shm": 19, "head": 51, "learner": 25}
    assert minimums(7 * 1.1, collective=False)["learner"] == 10
    assert minimums(7 * 1.1, ranks_per_pod=4)["learner"] == 29
    assert minimums(7 * 1.1, collective=False)["sampler"] == 52
    # tensor parallelism 2 and 4: one more GPU worker process each; the versions they receive are on the GPUs
    assert (
        minimums(7 * 1.1, gpus=2)["sampler"] == minimums(7 * 1.1, gpus=2, collective=False)["sampler"] == 54
    )
    assert (
        minimums(7 * 1.1, gpus=4)["sampler"] == minimums(7 * 1.1, gpus=4, collective=False)["sampler"] == 58
    )
    # over gloo (a CPU learner) each engine worker receives a version into host memory: one more W per GPU
    assert [minimums(7 * 1.1, gpus=g, nccl=False)["sampler"] for g in (1, 2, 4)] == [66, 82, 115]
    # Qwen2.5-72B on 8 GPUs: 3 copies of 147.5GiB, and 8 more over gloo
    m72 = minimums(72 * 1.1, gpus=8)
    assert m72 == {"sampler": 465, "evaluator": 465, "shm": 152, "head": 451, "learner": 158}
    assert minimums(72 * 1.1, gpus=8, nccl=False)["sampler"] == 1645
    # the room a received version needs on a sampler's 80GB GPU: the highest gpu_memory_utilization
    most = [most_gpu_memory_utilization(b, 80) for b in (1.5 * 1.1, 7 * 1.1, 7.62)]
    assert most == [0.93, 0.78, 0.78]
    assert most_gpu_memory_utilization(72 * 1.1, 80) < 0  # a 72B version alone is more than one GPU
    guide = (ROOT / "docs" / "deploy.md").read_text()
    for figure in ("18Gi", "52Gi", "54Gi", "58Gi", "66Gi", "82Gi", "115Gi", "19Gi", "51Gi", "8Gi"):
        assert figure in guide, f"docs/deploy.md's sizing examples lack {figure}"
    for figure in ("465Gi", "1645Gi", "152Gi", "451Gi", "14Gi", "25Gi", "29Gi", "158Gi", "0.78"):
        assert figure in guide, f"docs/deploy.md's sizing examples lack {figure}"


def test_default_pods_hold_the_default_model() -> None:
    values = scenario_values("default-values.yaml")
    assert values["modelSize"]["parameters"] == 0 and "1.5B" in values["run"]["model"]  # sized from its name
    need = minimums(
        1.5 * 1.1, gpus=values["sampler"]["gpusPerReplica"], retain=values["weightBroker"]["retainVersions"]
    )
    gi = {"sampler": values["sampler"], "head": values["head"], "learner": values["learner"]}
    for name, v in gi.items():
        for kind in ("requests", "limits"):
            assert int(v["resources"][kind]["memory"].removesuffix("Gi")) >= need[name], (name, kind)
    assert int(values["rayCluster"]["shmSize"].removesuffix("Gi")) >= need["shm"]
    # every Ray pod has /dev/shm in memory, rayCluster.shmSize large (the sampler writes versions there)
    for g in [cluster(render())["headGroupSpec"], *cluster(render())["workerGroupSpecs"]]:
        shm = next(v for v in g["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": values["rayCluster"]["shmSize"]}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(g)["volumeMounts"]
    # and the samplers' GPUs a received version beside the engine at the default utilization
    utilization = values["sampler"]["gpuMemoryUtilization"]
    assert utilization <= most_gpu_memory_utilization(1.5 * 1.1, values["gpuNodes"]["gpuMemoryGB"])


SIZING_CASES = {  # name: (flags, minimums)
    "1.5B from its name": ((), minimums(1.5 * 1.1)),
    "7B from its name": (("run.model=Qwen/Qwen2.5-7B",), minimums(7 * 1.1)),
    "7B, tensor parallel 2": (
        ("run.model=Qwen/Qwen2.5-7B", "sampler.gpusPerReplica=2"),
        minimums(7 * 1.1, gpus=2),
    ),
    "7B, tensor parallel 4": (
        ("run.model=Qwen/Qwen2.5-7B", "sampler.gpusPerReplica=4"),
        minimums(7 * 1.1, gpus=4),
    ),
    "7B, tensor parallel 2, a CPU learner: gloo, a version per GPU worker in host memory": (
        ("run.model=Qwen/Qwen2.5-7B", "sampler.gpusPerReplica=2", "learner.gpusPerRank=0"),
        minimums(7 * 1.1, gpus=2, nccl=False),
    ),
    # (the learner's GPUs, which 2 ranks of 72B would not fit, and the samplers', where a 72B version does not
    # fit under NCCL, are not what these size: gpuNodes' GPU memory checks are off)
    "72B, tensor parallel 8": (
        ("run.model=Qwen/Qwen2.5-72B", "sampler.gpusPerReplica=8", "gpuNodes.gpuMemoryGB=0"),
        minimums(72 * 1.1, gpus=8),
    ),
    "72B, tensor parallel 8, a CPU learner: gloo, a version per GPU worker in host memory": (
        ("run.model=Qwen/Qwen2.5-72B", "sampler.gpusPerReplica=8", "learner.gpusPerRank=0"),
        minimums(72 * 1.1, gpus=8, nccl=False),
    ),
    "7.62B given": (("run.model=Qwen/Qwen2.5-7B", "modelSize.parameters=7.62"), minimums(7.62)),
    "fp32 checkpoint": (("modelSize.parameters=3", "modelSize.dtypeBytes=4"), minimums(3, dtype_bytes=4)),
    "4 retained": (
        ("run.model=Qwen/Qwen2.5-7B", "weightBroker.retainVersions=4"),
        minimums(7 * 1.1, retain=4),
    ),
    "broker on disk": (
        ("run.model=Qwen/Qwen2.5-7B", "weightBroker.storage=disk"),
        minimums(7 * 1.1, in_memory=False),
    ),
    "tcp transport": (
        ("run.model=Qwen/Qwen2.5-7B", "weightBroker.transport=tcp"),
        minimums(7 * 1.1, collective=False),
    ),
    "tcp, tensor parallel 2": (
        ("run.model=Qwen/Qwen2.5-7B", "sampler.gpusPerReplica=2", "weightBroker.transport=tcp"),
        minimums(7 * 1.1, gpus=2, collective=False),
    ),
    "LoRA, adapter versions of a stated size": (
        (
            "run.model=Qwen/Qwen2.5-7B",
            "weightBroker.transport=tcp",
            "learner.lora.rank=16",
            "modelSize.adapterParameters=40.4",
        ),
        minimums(7 * 1.1, collective=False, adapter_millions=40.4),
    ),
    "LoRA, adapter versions of a stated size, 4 retained, tensor parallel 2": (
        (
            "run.model=Qwen/Qwen2.5-7B",
            "weightBroker.transport=tcp",
            "learner.lora.rank=64",
            "modelSize.adapterParameters=161.5",
            "weightBroker.retainVersions=4",
            "sampler.gpusPerReplica=2",
        ),
        minimums(7 * 1.1, gpus=2, collective=False, retain=4, adapter_millions=161.5),
    ),
    "LoRA, adapter versions of no stated size: whole versions": (
        ("run.model=Qwen/Qwen2.5-7B", "weightBroker.transport=tcp", "learner.lora.rank=16"),
        minimums(7 * 1.1, collective=False),
    ),
    "LoRA, merged versions: whole versions whatever the adapters' size": (
        (
            "run.model=Qwen/Qwen2.5-7B",
            "learner.lora.rank=16",
            "learner.lora.publish=merged",
            "modelSize.adapterParameters=40.4",
        ),
        minimums(7 * 1.1),
    ),
}
SIZED_KEYS = {  # the minimum's name -> the values it checks
    "sampler": ("sampler.resources.requests.memory", "sampler.resources.limits.memory"),
    "shm": ("rayCluster.shmSize",),
    "head": ("head.resources.requests.memory", "head.resources.limits.memory"),
    "learner": ("learner.resources.requests.memory", "learner.resources.limits.memory"),
}


@pytest.mark.parametrize("case", SIZING_CASES)
def test_pod_sizes_follow_the_model_size(case: str) -> None:
    flags, need = SIZING_CASES[case]
    at_minimum = {key: f"{need[name]}Gi" for name, keys in SIZED_KEYS.items() for key in keys}
    # room on the samplers' 80GB GPUs for a 7B version beside the engine (that check's own tests are below)
    base = [
        "--set-json",
        "sampler.gpuMemoryUtilization=0.75",
        *(a for flag in flags for a in ("--set", flag)),
    ]

    def args(values: dict[str, str]) -> list[str]:
        return base + [a for key, value in values.items() for a in ("--set", f"{key}={value}")]

    docs = render(*args(at_minimum))  # exactly the minimums: installs
    sampler, head = container(group(docs, "sampler")), container(group(docs, "head"))
    assert sampler["resources"]["limits"]["memory"] == f"{need['sampler']}Gi"
    assert head["resources"]["limits"]["memory"] == f"{need['head']}Gi"
    dshm = next(v for v in group(docs, "sampler")["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["sizeLimit"] == f"{need['shm']}Gi"
    for name, keys in SIZED_KEYS.items():
        for key in keys:  # 1Gi less: refused, naming the value and the minimum
            out = helm("template", "r", str(CHART), *args({**at_minimum, key: f"{need[name] - 1}Gi"}))
            assert out.returncode != 0, f"{case}: {key} = {need[name] - 1}Gi was accepted"
            assert f"{key} = {need[name] - 1}Gi is below the {need[name]}Gi" in errors(out), errors(out)
            assert f"raise {key} to at least {need[name]}Gi" in errors(out)


def test_a_collective_samplers_host_memory_holds_received_versions_only_over_gloo() -> None:
    """Under NCCL (a GPU learner, group_backend auto) each GPU worker receives a version into its GPU: the
    sampler pod's minimum is the broker path's alone. Over gloo (a CPU learner, or group_backend gloo) each
    engine worker receives it into host memory, its own copy: one W per GPU more, which the error names."""
    need, gloo = minimums(7 * 1.1, gpus=2)["sampler"], minimums(7 * 1.1, gpus=2, nccl=False)["sampler"]
    assert (need, gloo) == (54, 82)

    def sampler_memory(gi: int) -> tuple[str, ...]:
        return ("--set", f"sampler.resources.limits.memory={gi}Gi,sampler.resources.requests.memory={gi}Gi")

    base = (
        *("--set", "run.model=Qwen/Qwen2.5-7B,sampler.gpusPerReplica=2,rayCluster.shmSize=19Gi"),
        *("--set", "head.resources.limits.memory=52Gi,head.resources.requests.memory=52Gi"),
        *("--set-json", "sampler.gpuMemoryUtilization=0.75"),
    )
    assert helm("template", "r", str(CHART), *base, *sampler_memory(need)).returncode == 0
    for over_gloo in (
        ("--set", "learner.gpusPerRank=0"),
        ("--set-string", 'extraConfig=[weight_broker]\ngroup_backend = "gloo"\n'),
    ):
        out = helm("template", "r", str(CHART), *base, *over_gloo, *sampler_memory(need))
        assert f"sampler.resources.requests.memory = {need}Gi is below the {gloo}Gi" in errors(out), errors(
            out
        )
        received = "+ 2 more, the weight group's broadcast as each engine worker receives it into host memory"
        assert received in errors(out)
        out = helm("template", "r", str(CHART), *base, *over_gloo, *sampler_memory(gloo))
        assert out.returncode == 0, errors(out)


def test_a_samplers_gpus_hold_a_received_version_beside_the_engine() -> None:
    """With the collective transport under NCCL every GPU worker of a sampler receives each version whole into
    its GPU, beside vLLM's engine: (1 - gpu_memory_utilization) × gpuNodes.gpuMemoryGB must hold it + 2GiB.
    A 7B model on 80GB GPUs: 0.85 leaves 12GB, below 15.4GB + 2GiB; the error names the figures, the highest
    utilization that fits and the tcp transport, and either way out installs."""
    seven = ("-f", str(CHART / "ci" / "environments-values.yaml"))  # 7B, 1 GPU per sampler, 80GB, collective

    def at(utilization: float, *more: str) -> subprocess.CompletedProcess[str]:
        utilization_flag = ("--set-json", f"sampler.gpuMemoryUtilization={utilization}")
        return helm("template", "r", str(CHART), *seven, *utilization_flag, *more)

    most = most_gpu_memory_utilization(7 * 1.1, 80)
    assert most == 0.78
    out = at(0.85)
    assert out.returncode != 0
    for text in (
        "each GPU worker of a sampler receives every version whole into its own GPU",
        '15.4GB for run.model "Qwen/Qwen2.5-7B" (7.7B parameters from its name + 10%',
        "+ 2GiB (the CUDA context, NCCL's buffers, the layer vLLM's reload materializes) = 17.5GB, above the "
        "12.0GB that sampler.gpuMemoryUtilization = 0.85 leaves of one gpuNodes.gpuMemoryGB = 80GB GPU",
        "lower sampler.gpuMemoryUtilization to at most 0.78, or set weightBroker.transport = tcp",
    ):
        assert text in errors(out), errors(out)
    for utilization in (most, 0.75):  # the figure the error names installs, and one with a margin
        out = at(utilization)
        assert out.returncode == 0, (utilization, errors(out))
    assert "to at most 0.78" in errors(at(0.79))
    # the tcp transport (versions through the broker into the pod's host memory), gpuNodes.gpuMemoryGB 0, or
    # a CPU learner (gloo: versions into host memory, which the file's 72Gi sampler pods hold): no GPU room
    for more in ("weightBroker.transport=tcp", "gpuNodes.gpuMemoryGB=0", "learner.gpusPerRank=0"):
        out = at(0.85, "--set", more)
        assert out.returncode == 0, (more, errors(out))
    # a utilization set in extraConfig is the run file's: the error names it
    extra = "[sampler]\ngpu_memory_utilization = 0.9\n[learner]\nactivation_checkpointing = true\n"
    out = at(0.75, "--set-string", f"extraConfig={extra}")
    assert "that sampler.gpu_memory_utilization in extraConfig = 0.9 leaves" in errors(out), errors(out)
    assert "lower sampler.gpu_memory_utilization in extraConfig to at most 0.78" in errors(out)
    # tensor parallel 2: each worker receives the whole version, not its half: the same bound
    two = ("-f", str(CHART / "ci" / "multi-gpu-values.yaml"))
    out = helm("template", "r", str(CHART), *two, "--set-json", "sampler.gpuMemoryUtilization=0.85")
    assert "lower sampler.gpuMemoryUtilization to at most 0.78" in errors(out), errors(out)


def test_a_72b_version_fits_no_80gb_sampler_gpu_beside_its_engine() -> None:
    """Qwen2.5-72B on samplers of tensor parallel 8, each of whose workers would receive the whole 158GB
    version on an 80GB GPU: no gpu_memory_utilization makes room, the error offers the tcp transport alone,
    and that installs."""
    big = (
        *("-f", str(CHART / "ci" / "multi-gpu-values.yaml")),
        *("--set", "run.model=Qwen/Qwen2.5-72B,sampler.gpusPerReplica=8"),
        # a learner that fits 80GB GPUs (32 ranks over 4 nodes), and pods that hold the model's weights
        *(
            "--set",
            "learner.ranks=32,learner.spreadAcrossNodes=true,gpuNodes.count=0,rayCluster.shmSize=152Gi",
        ),
        *("--set", "sampler.resources.limits.memory=465Gi,sampler.resources.requests.memory=465Gi"),
        *("--set", "head.resources.limits.memory=451Gi,head.resources.requests.memory=451Gi"),
    )
    out = helm("template", "r", str(CHART), *big)
    assert out.returncode != 0
    assert '158.4GB for run.model "Qwen/Qwen2.5-72B"' in errors(out), errors(out)
    assert (
        "no sampler.gpuMemoryUtilization makes room, as the version alone is more than one GPU holds"
        in errors(out)
    )
    assert "set weightBroker.transport = tcp" in errors(out) and "lower sampler" not in errors(out)
    out = helm("template", "r", str(CHART), *big, "--set", "weightBroker.transport=tcp")
    assert out.returncode == 0, errors(out)


def test_sizes_of_other_units_and_of_cpu_samplers() -> None:
    # quantities in other units are compared in bytes: 18Gi = 19327352832 = 18432Mi; 19G = 17.7Gi
    for value in ("19327352832", "18432Mi", "20G"):
        render("--set", f"sampler.resources.limits.memory={value}")
    out = helm("template", "r", str(CHART), "--set", "sampler.resources.limits.memory=19G")
    assert "sampler.resources.limits.memory = 19G is below the 18Gi" in errors(out)  # 19G = 17.7Gi
    # without GPUs vLLM runs in the sampler's process: no /dev/shm file, two copies, and the broadcast its one
    # worker receives (gloo); the tiny built-in model
    cpu = minimums(1.5 * 1.1, gpus=0)["sampler"]  # 3 × 3.1GiB + 8Gi
    assert cpu == 18
    # adapter versions without GPUs: the engine in the sampler's process holds the frozen base, + 2 versions
    cpu_lora = minimums(1.5 * 1.1, gpus=0, adapter_millions=18.5)["sampler"]  # 3.1GiB + 2 × 0.03GiB + 8Gi
    assert cpu_lora == 12
    lora = "weightBroker.transport=tcp,learner.lora.rank=16,modelSize.adapterParameters=18.5"
    base_in_engine = "the frozen base in the engine (3.1GiB) + 2 copies of a version"
    cases = ((cpu, (), ""), (cpu_lora, ("--set", lora), base_in_engine))
    for need, extra, said in cases:
        for memory, ok in ((need, True), (need - 1, False)):
            out = helm(
                "template",
                "r",
                str(CHART),
                *("--set", "sampler.gpusPerReplica=0,learner.gpusPerRank=0,rayCluster.shmSize=64Mi"),
                *extra,
                *("--set", f"sampler.resources.limits.memory={memory}Gi"),
                *("--set", f"sampler.resources.requests.memory={memory}Gi"),
            )
            assert (out.returncode == 0) == ok, errors(out)
            assert ok or said in errors(out)
    render(
        "--set",
        "run.model=",
        "--set",
        "sampler.gpusPerReplica=0",
        "--set",
        "learner.gpusPerRank=0",
        "--set",
        "rayCluster.shmSize=64Mi",
        "--set",
        "sampler.resources.limits.memory=8Gi",
        "--set",
        "sampler.resources.requests.memory=8Gi",
    )


def test_the_evaluator_and_the_shared_volume_are_sized_too() -> None:
    evaluation = ("-f", str(CHART / "ci" / "evaluation-values.yaml"))
    # the evaluator's engine is the samplers' (1 GPU); it takes its versions from the broker, not the group
    gpus = scenario_values("evaluation-values.yaml")["sampler"]["gpusPerReplica"]
    need = minimums(7 * 1.1, gpus=gpus)["evaluator"]
    assert (gpus, need, minimums(7 * 1.1, gpus=2)["evaluator"]) == (1, 52, 54)
    render(*evaluation, "--set", f"evaluation.evaluator.resources.limits.memory={need}Gi")
    out = helm(
        "template",
        "r",
        str(CHART),
        *evaluation,
        "--set",
        f"evaluation.evaluator.resources.limits.memory={need - 1}Gi",
    )
    assert f"raise evaluation.evaluator.resources.limits.memory to at least {need}Gi" in errors(out), errors(
        out
    )
    # versions on the shared volume (storage disk): the created claim holds them
    w = 1.5 * 1.1 * 2e9 / GIB
    flag = "weightBroker.storage=disk"
    out = helm("template", "r", str(CHART), "--set", flag, "--set", "sharedStorage.size=5Gi")
    assert f"raise sharedStorage.size to at least {math.ceil(3 * w)}Gi" in errors(out), errors(out)
    render("--set", flag, "--set", "sharedStorage.size=5Gi", "--set", "sharedStorage.existingClaim=mine")


def test_tls_secrets_are_mounted_where_the_samplers_settings_point(tmp_path: Path) -> None:
    """tls.* Secrets: each mounted read-only in every Ray pod, and the VCPO_SAMPLER__*_TLS__* variables that name
    the files make the run's config (the launcher reads them and hands them to the samplers)."""
    plain = render()
    assert not [e for e in container(group(plain, "sampler"))["env"] if "_TLS__" in e["name"]]
    docs = render(
        "--set",
        "tls.apiSecret=api-cert",
        "--set",
        "tls.clientCaSecret=clients",
        "--set",
        "tls.envCaSecret=env-ca",
        "--set",
        "tls.envClientSecret=env-client",
    )
    for name in ("head", "sampler", "learner"):
        pod = group(docs, name)["template"]["spec"]
        mounts = {m["name"]: m for m in container(group(docs, name))["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for volume, secret, path in (
            ("tls-api", "api-cert", "/etc/vcpo/tls/api"),
            ("tls-client-ca", "clients", "/etc/vcpo/tls/client-ca"),
            ("tls-env-ca", "env-ca", "/etc/vcpo/tls/env-ca"),
            ("tls-env-client", "env-client", "/etc/vcpo/tls/env-client"),
        ):
            assert mounts[volume]["mountPath"] == path and mounts[volume]["readOnly"], (name, volume)
            assert volumes[volume]["secret"]["secretName"] == secret, (name, volume)
    env = {e["name"]: e["value"] for e in container(group(docs, "head"))["env"] if "_TLS__" in e["name"]}
    _, _ = run_config(docs, tmp_path)
    cfg = load_config(SystemConfig, [tmp_path / "run.toml"], env=env)
    assert cfg.sampler.api_tls.cert_file == "/etc/vcpo/tls/api/tls.crt"
    assert cfg.sampler.api_tls.key_file == "/etc/vcpo/tls/api/tls.key"
    assert cfg.sampler.api_tls.client_ca_file == "/etc/vcpo/tls/client-ca/ca.crt"
    assert cfg.sampler.env_tls.ca_file == "/etc/vcpo/tls/env-ca/ca.crt"
    assert (cfg.sampler.env_tls.cert_file, cfg.sampler.env_tls.key_file) == (
        "/etc/vcpo/tls/env-client/tls.crt",
        "/etc/vcpo/tls/env-client/tls.key",
    )
    out = helm("template", "r", str(CHART), "--set", "tls.clientCaSecret=clients")
    assert out.returncode != 0 and "tls.clientCaSecret (mutual TLS) needs tls.apiSecret" in errors(out)


def test_the_weight_groups_settings_reach_the_run_file(tmp_path: Path) -> None:
    _, cfg = run_config(render(), tmp_path)
    wb = cfg.weight_broker
    assert (wb.transport, wb.group_port, wb.group_timeout_s, wb.group_form_timeout_s) == (
        "collective",
        29600,
        120.0,
        30.0,
    )
    assert wb.group_bucket_mb == 256
    _, cfg = run_config(render("--set", "weightBroker.group.bucketMiB=64"), tmp_path)
    assert cfg.weight_broker.group_bucket_mb == 64
    out = helm("template", "r", str(CHART), "--set-string", "weightBroker.group.bucketMiB=big")
    assert out.returncode != 0 and "/weightBroker/group/bucketMiB': got string, want integer" in errors(out)
    # the bucket digests were removed: a values file that still sets them is refused, naming the value
    out = helm("template", "r", str(CHART), "--set", "weightBroker.group.digests=false")
    assert out.returncode != 0 and "additional properties 'digests' not allowed" in errors(out)


def test_the_weight_groups_members_take_a_security_context_for_nccl_over_infiniband() -> None:
    """NCCL over InfiniBand or RoCE registers (locks) its buffers: the learner's and the samplers' containers
    take a securityContext (IPC_LOCK); the evaluator's follows the samplers' unless it has its own; the other
    pods keep none. Every rendered object still validates against the Kubernetes API's schema."""
    ib = {"capabilities": {"add": ["IPC_LOCK"]}}
    args = ("-f", str(CHART / "ci" / "evaluation-values.yaml"), "--set", "evaluation.placement=dedicated")
    assert "securityContext" not in container(group(render(*args), "sampler"))
    docs = render(
        *args,
        "--set-json",
        f"sampler.securityContext={json.dumps(ib)}",
        "--set-json",
        f"learner.securityContext={json.dumps(ib)}",
    )
    for name in ("sampler", "learner", "evaluator"):
        assert container(group(docs, name))["securityContext"] == ib, name
    assert "securityContext" not in container(group(docs, "reward"))
    assert "securityContext" not in container(group(docs, "head"))
    for doc in docs:
        validate(doc)
    own = {"capabilities": {"add": ["IPC_LOCK", "SYS_NICE"]}}
    docs = render(
        *args,
        "--set-json",
        f"sampler.securityContext={json.dumps(ib)}",
        "--set-json",
        f"evaluation.evaluator.securityContext={json.dumps(own)}",
    )
    assert container(group(docs, "evaluator"))["securityContext"] == own
    out = helm("template", "r", str(CHART), "--set", "learner.securityContext=IPC_LOCK")
    assert out.returncode != 0 and "/learner/securityContext': got string, want object" in errors(out)


def test_the_samplers_request_cap_reaches_the_run_file(tmp_path: Path) -> None:
    """sampler.maxRequestsInFlight is the run file's sampler.max_requests_in_flight (0 by default: the engine's
    batch limit), the training side of a shared engine that the evaluator's start-up rule weighs."""
    _, cfg = run_config(render(), tmp_path)
    assert cfg.sampler.max_requests_in_flight == 0
    _, cfg = run_config(render("--set", "sampler.maxRequestsInFlight=256"), tmp_path)
    assert cfg.sampler.max_requests_in_flight == 256
    _, cfg = run_config(render(*scenario_args("environments-values.yaml")), tmp_path)
    (python,) = [e for e in cfg.sampler.environments if e.name == "python"]
    assert (cfg.sampler.max_requests_in_flight, python.max_concurrency) == (256, 768)


def test_the_agent_api_is_served_on_the_sampler_pods_and_their_service(tmp_path: Path) -> None:
    """agents.enabled: the run file's [agents] (port 8000, the chart's), the sampler pods' port and the sampler
    Service's; off by default; the chart's own keys cannot be set through extraConfig."""
    docs = render()
    assert [p["name"] for p in one(docs, "Service", "r-vcpo-rl-sampler")["spec"]["ports"]] == ["grpc"]
    _, cfg = run_config(docs, tmp_path)
    assert not cfg.agents.enabled
    docs = render(
        "--set", "agents.enabled=true", "--set", "agents.service.port=8443", "--set", "agents.maxTurns=4"
    )
    _, cfg = run_config(docs, tmp_path)
    assert (cfg.agents.enabled, cfg.agents.port, cfg.agents.max_turns) == (True, 8000, 4)
    ports = {p["name"]: p for p in one(docs, "Service", "r-vcpo-rl-sampler")["spec"]["ports"]}
    assert ports["agents"]["port"] == 8443 and ports["agents"]["targetPort"] == "vcpo-agents"
    (container,) = group(docs, "sampler")["template"]["spec"]["containers"]
    assert {"name": "vcpo-agents", "containerPort": 8000} in container["ports"]
    out = helm("template", "r", str(CHART), "--set", "extraConfig=[agents]\nport = 9000")
    assert out.returncode != 0 and "extraConfig sets agents.port" in errors(out)
