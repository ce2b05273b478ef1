"""Where Prometheus finds a local run's services: ``<run_dir>/prometheus/targets.json`` in file_sd format.

Built from the endpoints files every replica writes when it serves (``<run_dir>/<service>/*.endpoints.json``)
and the broker's URL; ``deploy/prometheus/prometheus.yml`` reads it. The launcher rewrites it at each progress
line (a restarted replica serves on another port) and empties it when the run stops.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from services.common.pids import pid_alive


def prometheus_targets(
    run_dir: Path, run_id: str, broker_metrics_url: str = "", launcher_metrics_url: str = ""
) -> list[dict[str, Any]]:
    """Prometheus file_sd target groups: each live replica's ``/metrics`` (from the endpoints files the
    services write) and the launcher's, labelled ``service``, ``replica`` and ``run_id``. A file whose process
    is gone (a reward replica Serve replaced, a sampler before its restart) is left out; only a loopback URL's
    PID is checked."""
    found = [
        ("weight_broker", "weight_broker", {"metrics_url": broker_metrics_url}),
        ("launcher", "launcher", {"metrics_url": launcher_metrics_url}),
    ]
    found += [("learner", "learner-rank0", _read_json(run_dir / "learner" / "endpoints.json"))]
    for service in ("sampler", "reward", "evaluator"):  # evaluator: the dedicated one, when there is one
        for path in sorted((run_dir / service).glob("*.endpoints.json")):
            found.append((service, path.name.removesuffix(".endpoints.json"), _read_json(path)))
    groups = []
    for service, replica, ends in found:
        url = urlsplit(str(ends.get("metrics_url", "")))
        if not url.netloc or (url.hostname in ("127.0.0.1", "localhost") and not _alive(ends.get("pid"))):
            continue
        labels = {"service": service, "replica": replica, "run_id": run_id}
        groups.append({"targets": [url.netloc], "labels": labels})
    return groups


def write_prometheus_targets(run_dir: Path, groups: list[dict[str, Any]]) -> bool:
    """``<run_dir>/prometheus/targets.json``, atomically and only when it changes (Prometheus watches it)."""
    path = run_dir / "prometheus" / "targets.json"
    text = json.dumps(groups, indent=2) + "\n"
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").replace(path)
    return True


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):  # not written yet (files are replaced atomically, never half-written)
        return {}


def _alive(pid: Any) -> bool:
    """Whether a process of this machine still runs (no PID, as for the broker's URL: assume it does)."""
    return not pid or pid_alive(int(pid))
