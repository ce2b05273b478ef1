"""The shipped monitoring: Prometheus config, alert rules (with promtool unit tests), the Grafana dashboard.

Static checks: promtool accepts the config and the rules and passes alerts_test.yml; the dashboard parses,
every panel has a Prometheus query that promtool can parse; every metric the dashboard and the rules name is
one the services register. Live check (:func:`scrape_a_live_run`, run by tests/test_e2e.py on its first whole-
system launch): a real Prometheus scrapes the local run through the launcher's file_sd targets; every metric
named has a series and every panel's query returns data.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from deploy.targets import prometheus_targets, write_prometheus_targets
from services.common.config import RunConfig, StreamsConfig
from services.common.observability import Metrics
from services.common.ports import free_port
from services.common.streams.consumer import StreamConsumer
from services.common.streams.metrics import StreamMetrics
from services.common.streams.producer import StreamProducer
from services.common.streams.specs import stream_specs
from vcpo.v1 import rollout_pb2

ROOT = Path(__file__).parent.parent
PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "run-health.json"
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for every target
METRIC = re.compile(r"(?<![\w:])(vcpo_[a-z0-9_]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Metrics the dashboard shows that a local run of deploy/presets/local.toml legitimately never creates
# (labelled series exist only once something happened):
ABSENT_IN_LOCAL_RUN = {
    # the local preset registers no tool-use environment (builtin:tail_add is single-turn)
    "vcpo_sampler_env_episodes_total": "no environment in the local preset",
    "vcpo_sampler_env_failed_groups_total": "no environment in the local preset",
    "vcpo_sampler_env_paused": "no environment in the local preset",
    # a healthy run has no malformed or endlessly redelivered entry, and a short one gives up no group
    "vcpo_stream_dead_letter_total": "nothing dead-lettered in a healthy run",
}


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool missing: `make setup` installs Debian's prometheus package"
    return path


def _promtool_ok(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that shows data (rows are headings), including those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out += [panel] if panel["type"] != "row" else panel.get("panels", [])
    return out


def _dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(_dashboard()) for t in p["targets"]]


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    return [str(rule["expr"]) for group in groups for rule in group["rules"]]


def _metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())


def registered_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """Metric names the services and the launcher register (counters with their _total), and which are
    histograms: read from their real collectors by scripts/reference_metrics.py, the source of
    docs/reference/metrics.md too."""
    if str(ROOT / "scripts") not in sys.path:  # the generator's modules import each other as a script's do
        sys.path.insert(0, str(ROOT / "scripts"))
    names: tuple[frozenset[str], frozenset[str]] = importlib.import_module(
        "reference_metrics"
    ).registered_metrics()
    return names


def _series_name(name: str, names: AbstractSet[str], histograms: AbstractSet[str]) -> str | None:
    """The name as registered (a histogram's _bucket/_sum/_count map to it); None if the services lack it."""
    if name in names:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            return name.removesuffix(suffix)
    return None


def _substitute(expr: str, run_id: str, rate_interval: str = "15s") -> str:
    return expr.replace("$__rate_interval", rate_interval).replace("$run_id", run_id)


# ---------------------------------------------------------------------------------------------------- static
def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    assert "SUCCESS" in _promtool_ok("check", "rules", "deploy/prometheus/alerts.yml")
    assert "SUCCESS" in _promtool_ok("test", "rules", "alerts_test.yml", cwd=PROM_DIR)


def test_promtool_accepts_the_scrape_config() -> None:
    out = _promtool_ok("check", "config", "deploy/prometheus/prometheus.yml")
    assert "is valid prometheus config file syntax" in out
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True  # the services' own `replica` label wins
    files = job["file_sd_configs"][0]["files"]
    assert files == ["../../runs/local/prometheus/targets.json"]  # `make run`'s run directory


def test_every_rule_has_for_severity_and_annotations() -> None:
    groups = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "VcpoEssRatioLow",
        "VcpoEssRatioCollapse",
        "VcpoGradNormSpike",
        "VcpoLearnerStalled",
        "VcpoSamplersAdmissionBlocked",
        "VcpoStreamGrowing",
    }
    tested = set(re.findall(r"alertname: (\w+)", (PROM_DIR / "alerts_test.yml").read_text()))
    for alert in alerts:
        assert alert.get("for"), alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert {"summary", "description", "action"} <= set(alert["annotations"]), alert["alert"]
        assert alert["alert"] in tested, f"{alert['alert']} has no case in alerts_test.yml"


def test_the_dashboard_parses_and_every_panel_has_a_prometheus_query(tmp_path: Path) -> None:
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["run_id"]["type"] == "query" and variables["run_id"]["includeAll"]
    panels = _panels(dashboard)
    assert len(panels) >= 15
    titles = " | ".join(p["title"] for p in panels)
    for wanted in (
        "ESS ratio",
        "Learning-rate scale",
        "Gradient norm",
        "Mean reward",
        "Staleness",
        "dropped",
        "Tokens / s",
        "Queue depths",
        "Weight sync",
        "Episodes",
        "Paused",
    ):
        assert wanted in titles, wanted
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    rules = []
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert '$run_id"' in target["expr"], f"{panel['title']!r} ignores the run_id variable"
            rules.append(
                {
                    "record": f"dashboard:panel_{panel['id']}:{target['refId']}",
                    "expr": _substitute(target["expr"], "local"),
                }
            )
    # promtool parses PromQL: every query as a recording rule
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool_ok("check", "rules", str(path))
    heatmaps = [p for p in panels if p["type"] == "heatmap"]
    assert heatmaps and all(t.get("format") == "heatmap" for p in heatmaps for t in p["targets"])


def test_every_metric_named_in_the_dashboard_and_rules_is_registered_by_the_services() -> None:
    names, histograms = registered_metrics()
    assert "vcpo_learner_ess_ratio" in names and "vcpo_learner_staleness_versions" in histograms
    used = {n for _, e in _dashboard_exprs() for n in _metric_names(e)}
    used |= {n for e in _rule_exprs() for n in _metric_names(e)}
    assert len(used) > 25
    unknown = sorted(n for n in used - PROMETHEUS_OWN if _series_name(n, names, histograms) is None)
    assert not unknown, f"named in the dashboard or rules but registered by no service: {unknown}"
    misused = sorted(n for n in used if n.endswith("_bucket") and n.removesuffix("_bucket") not in histograms)
    assert not misused, misused
    assert set(ABSENT_IN_LOCAL_RUN) <= used  # the allow-list names nothing the dashboard does not show


# ---------------------------------------------------------------------------------------------------- units
def test_stream_length_and_capacity_are_read_from_redis_at_scrape_time(redis_client: redis.Redis) -> None:
    specs = stream_specs(RunConfig(run_id="mon"), StreamsConfig(rollouts_maxlen=8))
    producer_side, consumer_side = Metrics("sampler"), Metrics("reward")
    producer = StreamProducer(redis_client, specs["rollouts"], StreamMetrics(producer_side))
    StreamMetrics(producer_side)  # a second StreamMetrics on the same registry shares the collector
    consumer = StreamConsumer(redis_client, specs["rollouts"], "r0", StreamMetrics(consumer_side))
    for _ in range(3):
        producer.put(rollout_pb2.TrajectoryGroup(), 0)
    consumer.ack([e.id for e in consumer.read(count=2)])
    for metrics in (producer_side, consumer_side):  # both see the acks: the length comes from Redis
        text = metrics.exposition().decode()
        assert 'vcpo_stream_length{stream="rollouts"} 1.0' in text
        assert 'vcpo_stream_capacity{stream="rollouts"} 8.0' in text
    done = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_stream_lengths_are_left_out_while_redis_is_unreachable() -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    metrics = Metrics("sampler")
    spec = stream_specs(RunConfig(run_id="mon"), StreamsConfig())["weights"]
    StreamMetrics(metrics).watch(client, spec)
    text = metrics.exposition().decode()
    assert "# TYPE vcpo_stream_length gauge" in text and "vcpo_stream_length{" not in text


def test_prometheus_targets_list_live_replicas_with_their_labels(tmp_path: Path) -> None:
    def endpoints(path: Path, port: int, pid: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"grpc_port": 1, "metrics_url": f"http://127.0.0.1:{port}", "pid": pid}))

    dead = subprocess.Popen(["true"])
    dead.wait()
    endpoints(tmp_path / "learner" / "endpoints.json", 9001, os.getpid())
    endpoints(tmp_path / "sampler" / "sampler-0.endpoints.json", 9002, os.getpid())
    endpoints(tmp_path / "reward" / "reward-serve-a.endpoints.json", 9003, dead.pid)  # replaced by Serve
    endpoints(tmp_path / "reward" / "reward-serve-b.endpoints.json", 9004, os.getpid())
    endpoints(tmp_path / "evaluator" / "evaluator.endpoints.json", 9005, os.getpid())  # a dedicated evaluator
    groups = prometheus_targets(tmp_path, "r1", "http://127.0.0.1:9000", "http://127.0.0.1:9010")
    assert [(g["targets"], g["labels"]["service"], g["labels"]["replica"]) for g in groups] == [
        (["127.0.0.1:9000"], "weight_broker", "weight_broker"),
        (["127.0.0.1:9010"], "launcher", "launcher"),  # restarts by service
        (["127.0.0.1:9001"], "learner", "learner-rank0"),
        (["127.0.0.1:9002"], "sampler", "sampler-0"),
        (["127.0.0.1:9004"], "reward", "reward-serve-b"),
        (["127.0.0.1:9005"], "evaluator", "evaluator"),
    ]
    assert all(set(g) == {"targets", "labels"} and g["labels"]["run_id"] == "r1" for g in groups)
    assert write_prometheus_targets(tmp_path, groups)
    assert not write_prometheus_targets(tmp_path, groups)  # unchanged: not rewritten
    assert json.loads((tmp_path / "prometheus" / "targets.json").read_text()) == groups
    assert not prometheus_targets(tmp_path / "nothing-yet", "r1")


# ---------------------------------------------------------------------------------------------------- live
class Prometheus:
    """A real ``prometheus`` on a free port scraping ``targets`` every second, with the shipped rules."""

    def __init__(self, workdir: Path, targets: Path) -> None:
        config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(PROM_DIR / "alerts.yml")]
        config["scrape_configs"][0]["file_sd_configs"][0].update(files=[str(targets)], refresh_interval="1s")
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                "--log.level=warn",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[Any]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def _missing(prom: Prometheus, run_id: str) -> list[str]:
    """What the live Prometheus lacks: metrics named without a series, panel queries without data."""
    _, histograms = registered_metrics()
    missing = []
    used = {n for _, e in _dashboard_exprs() for n in _metric_names(e)}
    used |= {n for e in _rule_exprs() for n in _metric_names(e)}
    for name in sorted(used - set(ABSENT_IN_LOCAL_RUN)):
        series = f"{name}_count" if name in histograms else name  # a histogram: its _count (and _bucket)
        if not prom.query(f'{series}{{run_id="{run_id}"}}'):
            missing.append(f"metric {series}")
    for title, expr in _dashboard_exprs():
        if _metric_names(expr) <= set(ABSENT_IN_LOCAL_RUN):
            continue
        if not prom.query(_substitute(expr, run_id)):
            missing.append(f"panel {title!r}: {expr}")
    return missing


def scrape_a_live_run(launch: Any, run_dir: Path, run_id: str, workdir: Path) -> None:
    """A real Prometheus scrapes ``launch`` (a running ``tests.test_e2e.Launch``) through the launcher's file_sd
    targets: every metric the dashboard and the rules name has a series, every panel's query returns data,
    every target is up with its own labels, the rules load and none fires. The run must evaluate (its
    version-0 round fills the accuracy panels); tests/test_e2e.py calls this on its first launch, so one
    whole-system launch serves both checks. After the run stops, its targets file is to be empty."""
    assert shutil.which("prometheus"), "prometheus missing: `make setup` installs Debian's prometheus package"
    targets = run_dir / "prometheus" / "targets.json"
    listed = lambda: targets.exists() and len(json.loads(targets.read_text())) >= 5  # noqa: E731
    launch.wait_for("the scrape targets", listed, timeout_s=480)  # after the start-up and warm start
    services = {g["labels"]["service"] for g in json.loads(targets.read_text())}
    assert services == {"weight_broker", "learner", "sampler", "reward", "launcher"}
    workdir.mkdir(parents=True)
    prom = Prometheus(workdir, targets)
    try:
        prom.wait_ready()
        deadline, missing = time.monotonic() + 90, ["not queried yet"]
        while missing and time.monotonic() < deadline:
            assert launch.proc.poll() is None, launch.output[-6000:]
            time.sleep(3)
            missing = _missing(prom, run_id)
        rounds = {
            r["metric"]["outcome"]: r["value"][1]
            for r in prom.query(f'vcpo_eval_rounds_total{{run_id="{run_id}"}}')
        }
        assert not missing, "\n".join([*missing, f"evaluation rounds by outcome: {rounds}"])

        active = prom.get("/api/v1/targets")["activeTargets"]
        assert {t["labels"]["service"] for t in active} == services
        assert all(t["health"] == "up" and t["labels"]["run_id"] == run_id for t in active), active
        # the services' own replica labels survive (honor_labels) and match the targets'
        assert prom.query(f'vcpo_sampler_tokens_per_second{{replica="sampler-0", run_id="{run_id}"}}')
        rules = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
        assert rules and all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
        assert prom.query(f'vcpo:stream_fill:ratio{{run_id="{run_id}", stream="scored"}}')
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        assert not firing, firing  # a healthy run
    finally:
        prom.stop()
