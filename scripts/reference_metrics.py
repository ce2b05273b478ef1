"""docs/reference/metrics.md and the one list of the metrics the services register (tests/test_monitoring.py
and tests/test_docs.py read it through :func:`registered_metrics`).

The metrics are read from real Prometheus collectors, not from the source text: each service's metrics
class (:data:`OWNERS`) is built on a fresh :class:`~services.common.observability.Metrics`, as the service
builds it at start, and every collector it holds is described (name, type, help, labels). Nothing is served
and no service starts, except that the launcher's metrics class binds its ``/metrics`` port (a free one),
which is closed at once. :func:`unlisted` cross-checks the source: a ``.counter(``/``.gauge(``/``.histogram(``
call with a literal ``vcpo_*`` name in services/ or deploy/ that no owner registers (a new metrics class
missing from :data:`OWNERS`) is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from reference_markdown import banner, code, prose, table

ROOT = Path(__file__).resolve().parent.parent
CALL = re.compile(r"\.(?:counter|gauge|histogram)\(\s*\"(vcpo_[a-z0-9_]+)\"")
NAME_SUFFIX = {"counter": "_total"}  # prometheus_client names a counter's family without it


@dataclass(frozen=True)
class MetricDoc:
    name: str  # as scraped (a counter with its _total)
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    owner: str  # the section of the page: which process serves it


def _learner(m: Any) -> object:
    from services.learner.metrics import LearnerMetrics

    return LearnerMetrics(m, k=4)


def _sampler(m: Any) -> object:
    from services.sampler.metrics import SamplerMetrics

    return SamplerMetrics(m, "sampler-0")


def _evaluation(m: Any) -> object:
    from services.evaluator.metrics import EvalMetrics

    return EvalMetrics(m)


def _reward(m: Any) -> object:
    from services.reward.metrics import RewardMetrics

    return RewardMetrics(m, "reward-0")


def _broker(m: Any) -> object:
    from services.weight_broker.servicer import BrokerMetrics

    return BrokerMetrics(m)


def _streams(m: Any) -> object:
    from services.common.streams.metrics import StreamMetrics

    return StreamMetrics(m)


def _launcher(_: Any) -> object:
    from deploy.launcher_restarts import LauncherMetrics

    launcher = LauncherMetrics(port=0)
    launcher.close()
    return launcher


# (section, who serves it, the metrics class as its service builds it)
OWNERS: tuple[tuple[str, str, Callable[[Any], object]], ...] = (
    ("Learner", "learner rank 0's `/metrics` (the other ranks serve none)", _learner),
    ("Sampler", "each sampler replica's `/metrics`, labelled by `replica`", _sampler),
    (
        "Evaluation",
        'the sampler replicas (`evaluation.placement = "shared"`) or the evaluator '
        '(`evaluation.placement = "dedicated"`)',
        _evaluation,
    ),
    ("Reward", "each reward replica's `/metrics`", _reward),
    ("Weight broker", "the weight broker's `/metrics`", _broker),
    ("Streams", "every service that writes or reads a Redis stream, labelled by `stream`", _streams),
    ("Launcher", "the launcher's own `/metrics` (`launcher.metrics_port`)", _launcher),
)


def _collectors(obj: object) -> Iterator[Any]:
    """The collectors a metrics class holds: its attributes, and those in its dicts, lists and tuples."""
    stack: list[Any] = list(vars(obj).values())
    seen: set[int] = set()
    while stack:
        item = stack.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        if callable(getattr(item, "describe", None)) and callable(getattr(item, "collect", None)):
            yield item  # a Collector (a Protocol: what registry.register takes)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _describe(collector: Any, owner: str) -> Iterator[MetricDoc]:
    # describe() is the public way to name a collector's families; label names are kept only in the
    # wrappers' and families' `_labelnames` (stable across prometheus_client releases)
    wrapper_labels = tuple(getattr(collector, "_labelnames", ()))
    for family in collector.describe():
        labels = wrapper_labels or tuple(getattr(family, "_labelnames", ()))
        name = family.name + NAME_SUFFIX.get(family.type, "")
        yield MetricDoc(name, family.type, labels, family.documentation, owner)


@cache
def metric_docs() -> tuple[MetricDoc, ...]:
    """Every metric the services and the launcher register, by owner, each owner's in name order."""
    from services.common.observability import Metrics

    out: list[MetricDoc] = []
    for section, _, build in OWNERS:
        holder = build(Metrics(section.lower().replace(" ", "_")))
        found = {d.name: d for c in _collectors(holder) for d in _describe(c, section)}
        out += sorted(found.values(), key=lambda d: d.name)
    names = [d.name for d in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"metrics registered by two owners in scripts/reference_metrics.py: {twice}")
    return tuple(out)


def registered_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """The names of every registered metric (counters with their ``_total``) and of the histograms among
    them (whose series add ``_bucket``, ``_sum`` and ``_count``)."""
    docs = metric_docs()
    return frozenset(d.name for d in docs), frozenset(d.name for d in docs if d.type == "histogram")


def unlisted() -> list[str]:
    """Metrics the source registers by a literal name that no class in :data:`OWNERS` registers."""
    known, _ = registered_metrics()
    out = []
    for folder in ("services", "deploy"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in CALL.findall(path.read_text()):
                if name not in known:
                    out.append(f"{name} ({path.relative_to(ROOT)})")
    return out


def render() -> str:
    missing = unlisted()
    if missing:
        raise SystemExit(
            "metrics registered in the source but built by no class in scripts/reference_metrics.py OWNERS "
            f"(add the class that registers them): {', '.join(missing)}"
        )
    docs = metric_docs()
    parts = [
        "# Metrics reference\n",
        banner(
            "the services' Prometheus collectors (scripts/reference_metrics.py builds each metrics class)"
        ),
        "Every Prometheus metric the services and the launcher register, by the process that serves it. "
        "Every series also carries its scrape target's labels, `service` and `run_id` (and `replica` for a "
        "local run): [monitoring](../deploy/monitoring.md#metrics-by-service). A histogram `x` is scraped as `x_bucket`, `x_sum` and "
        "`x_count`. What healthy values look like: [monitoring](../deploy/monitoring.md) and the alert "
        "rules in `deploy/prometheus/alerts.yml`.\n",
        f"{len(docs)} metrics.\n",
    ]
    for section, served_by, _ in OWNERS:
        rows = [
            [code(d.name), d.type, ", ".join(code(label) for label in d.labels), prose(d.help)]
            for d in docs
            if d.owner == section
        ]
        parts.append(f"## {section}\n")
        parts.append(f"Served by {served_by}.\n")
        parts.append(table(["Metric", "Type", "Labels", "Help"], rows))
    return "\n".join(parts)
