"""Whether a run fits the Ray cluster it is given: checked once Ray is up, before any model is downloaded or
loaded, and refused with both figures and the keys to change where it does not.

What each service asks Ray for is listed here once (:func:`demands`), as the services ask for it:

    weight broker     1 actor        {CPU 0.5} + weight_broker.ray_resources
    learner rank      num_ranks      a bundle {CPU 1, GPU gpus_per_rank} + learner.ray_resources, in one PACK
                                     placement group (Ray keeps it on as few nodes as it can, spread if it must)
    sampler replica   replicas       {CPU 1, GPU gpus_per_replica} + sampler.ray_resources, one actor each
    evaluator         1, dedicated   {CPU 1, GPU evaluation.gpus} + evaluation.ray_resources
    reward replica    min_replicas   {CPU 1} + reward.ray_resources (Serve scales up to max_replicas where it
                                     can: those beyond the minimum are a warning, not a refusal)

The check (:func:`fit`) compares the totals per resource (GPUs, CPUs, the custom resources the Helm chart's
pods offer), then places every item on the nodes, largest first: one item is one process, so it must fit on one
node (a sampler with tensor_parallel_size 8 needs 8 GPUs of one node, whatever the cluster's total). GPUs are
placed per device, as Ray places them: a fraction of a GPU must fit in what one device has left.

Why here and not Ray: Ray queues a request it cannot meet yet and waits for good (an actor stays pending, a
placement group's ``ready()`` never returns); it warns only in the driver's log, so a run asking for 16 GPUs of
an 8-GPU node started, held the 8 for its learner, and failed ten minutes later with "the samplers were not
generating". Where the cluster can grow, it is not refused: ``launcher.cluster_fit = "warn"``, or a cluster
whose autoscaler has reported its largest size to Ray's GCS (``get_max_resources_from_cluster_config``, the
figure Ray Train checks its workers against) is compared with that size instead, and only warned about below
it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deploy.config import SystemConfig

EPS = 1e-6
UNBOUNDED = 1e15  # an autoscaler's node group without a maximum reports sys.maxsize
# node resources no service asks for, left out of the figures (Ray adds them to every node)
_NOT_ASKED = ("memory", "object_store_memory", "node:", "accelerator_type:")


class ClusterFitError(ValueError):
    """The run asks the Ray cluster for more than it has."""


@dataclass(frozen=True)
class Demand:
    """``count`` processes of one kind, each asking Ray for ``resources``; ``keys`` size it."""

    kind: str  # "sampler replica"
    count: int
    resources: Mapping[str, float]
    keys: str  # "sampler.replicas, sampler.gpus_per_replica"
    required: bool = True  # False: Serve adds them when it can (reward replicas beyond the minimum)


@dataclass(frozen=True)
class Node:
    name: str  # its IP, with a short Ray node id where IPs repeat
    resources: Mapping[str, float]  # total (or, for what is free, available)


def _with_gpus(cpus: float, gpus: float, extra: Mapping[str, float]) -> dict[str, float]:
    out = {"CPU": cpus}
    if gpus > 0:
        out["GPU"] = gpus
    out.update(extra)
    return out


def demands(cfg: SystemConfig) -> list[Demand]:
    """What the run's services ask Ray for (the module docstring's table)."""
    from services.learner.ray_group import rank_bundle

    lr, s, r, ev, wb = cfg.learner, cfg.sampler, cfg.reward, cfg.evaluation, cfg.weight_broker
    out = [
        Demand("weight broker", 1, {"CPU": 0.5, **wb.ray_resources}, "weight_broker.ray_resources"),
        Demand(
            "learner rank",
            lr.num_ranks,
            rank_bundle(lr),
            "learner.num_ranks, learner.gpus_per_rank",
        ),
        Demand(
            "sampler replica",
            s.replicas,
            _with_gpus(1, s.gpus_per_replica, s.ray_resources),
            "sampler.replicas, sampler.gpus_per_replica, sampler.tensor_parallel_size",
        ),
    ]
    if ev.sets and ev.placement == "dedicated":
        out.append(
            Demand(
                "evaluator",
                1,
                _with_gpus(1, ev.gpus, ev.ray_resources),
                'evaluation.gpus, or evaluation.placement = "shared"',
            )
        )
    reward = {"CPU": 1.0, **r.ray_resources}
    out.append(Demand("reward replica", r.min_replicas, reward, "reward.min_replicas"))
    if r.max_replicas > r.min_replicas:
        out.append(
            Demand("reward replica", r.max_replicas - r.min_replicas, reward, "reward.max_replicas", False)
        )
    return [d for d in out if d.count > 0]


def totals(items: Iterable[Demand]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in items:
        for name, amount in d.resources.items():
            out[name] = out.get(name, 0.0) + d.count * amount
    return out


def _asked(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if not k.startswith(_NOT_ASKED)}


def _fmt(resources: Mapping[str, float]) -> str:
    """{'CPU': 1, 'GPU': 8} -> '8 GPUs, 1 CPU' (GPUs first: they are what runs short)."""
    order = sorted(resources, key=lambda k: (k != "GPU", k != "CPU", k))
    return ", ".join(_amount(resources[k], k) for k in order)


def _plural(name: str) -> str:
    return f"{name}s" if name in ("GPU", "CPU") else name


def _amount(value: float, name: str) -> str:
    plural = name in ("GPU", "CPU") and value != 1
    return f"{value:g} {name}{'s' if plural else ''}"


class _Room:
    """What one node has left while items are placed on it: GPUs per device (a fraction must fit in one
    device's remainder, as Ray places it), every other resource as a sum."""

    def __init__(self, node: Node) -> None:
        self.node = node
        gpus = float(node.resources.get("GPU", 0.0))
        # a node's free GPUs (not its total) may end in a fraction: one device with that much left
        self.gpus = [1.0] * math.floor(gpus + EPS) + ([gpus % 1.0] if gpus % 1.0 > EPS else [])
        self.other = {k: float(v) for k, v in node.resources.items() if k != "GPU"}

    def _devices(self, gpus: float) -> list[int] | None:
        if gpus <= 0:
            return []
        if gpus >= 1 - EPS:  # whole devices (Ray asks whole numbers above one)
            whole = [i for i, left in enumerate(self.gpus) if left >= 1 - EPS]
            need = math.ceil(gpus - EPS)
            return whole[:need] if len(whole) >= need else None
        fits = [(left, i) for i, left in enumerate(self.gpus) if left >= gpus - EPS]
        return [min(fits)[1]] if fits else None  # the fullest device it fits in

    def take(self, resources: Mapping[str, float]) -> bool:
        gpus = float(resources.get("GPU", 0.0))
        devices = self._devices(gpus)
        if devices is None:
            return False
        if any(self.other.get(k, 0.0) + EPS < v for k, v in resources.items() if k != "GPU"):
            return False
        for i in devices:
            self.gpus[i] -= min(gpus, 1.0)
        for k, v in resources.items():
            if k != "GPU":
                self.other[k] -= v
        return True


def place(items: Sequence[Demand], nodes: Sequence[Node]) -> dict[int, int]:
    """Place every item of ``items`` on ``nodes``, largest first (GPUs, then CPUs); returns, by index into
    ``items``, how many of that demand found no room."""
    rooms = [_Room(n) for n in nodes]
    order = sorted(
        range(len(items)),
        key=lambda i: (-items[i].resources.get("GPU", 0.0), -items[i].resources.get("CPU", 0.0), i),
    )
    left: dict[int, int] = {}
    for i in order:
        for _ in range(items[i].count):
            if not any(room.take(items[i].resources) for room in rooms):
                left[i] = left.get(i, 0) + 1
    return left


def _by_kind(items: Sequence[Demand], resource: str) -> str:
    parts = []
    for d in items:
        each = d.resources.get(resource, 0.0)
        if each > 0:
            parts.append(f"{d.kind}s {d.count} x {each:g} = {d.count * each:g} ({d.keys})")
    return "; ".join(parts)


def fit(items: Sequence[Demand], nodes: Sequence[Node]) -> list[str]:
    """Why ``items`` cannot all run on ``nodes`` (empty: they can): resources short in total, then items no
    node can hold alone, then items that find no room once the others are placed."""
    have = totals([Demand("", 1, n.resources, "") for n in nodes])
    need = totals(items)
    problems = [
        f"{_plural(k)}: the run asks for {need[k]:g}, the cluster has {have.get(k, 0.0):g}: {_by_kind(items, k)}"
        for k in sorted(need, key=lambda k: (k != "GPU", k != "CPU", k))
        if need[k] > have.get(k, 0.0) + EPS
    ]
    if problems:
        return problems
    for i, count in sorted(place(items, nodes).items()):
        d = items[i]
        if not any(_Room(n).take(d.resources) for n in nodes):
            most = _fmt({k: max((n.resources.get(k, 0.0) for n in nodes), default=0.0) for k in d.resources})
            problems.append(
                f"one {d.kind} needs {_fmt(d.resources)} on one node, and no node has that (the most on one "
                f"node: {most}) ({d.keys})"
            )
        else:
            problems.append(
                f"{count} of {d.count} {d.kind}(s) ({_fmt(d.resources)} each) find no node with room once the "
                f"others are placed ({d.keys})"
            )
    return problems


# ---------------------------------------------------------------------------------------------- the cluster
def _named(raw: Sequence[tuple[str, str, Mapping[str, float]]]) -> list[Node]:
    """(ip, node id, resources) -> Nodes named by IP, with a short id where IPs repeat (nodes of one host)."""
    ips = [ip for ip, _, _ in raw]
    return [
        Node(ip if ips.count(ip) == 1 else f"{ip}/{node_id[:8]}", _asked(resources))
        for ip, node_id, resources in raw
    ]


def cluster_nodes() -> list[Node]:
    """The alive nodes of the connected Ray cluster and what each has in total."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    return _named([(n["NodeManagerAddress"], n["NodeID"], n.get("Resources", {})) for n in alive])


def free_nodes() -> list[Node]:
    """The alive nodes and what each has free now (held by nothing: actors, placement groups, tasks)."""
    import ray
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()  # Ray's DeveloperAPI: by node id, what the GCS last heard
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return _named([(n["NodeManagerAddress"], n["NodeID"], free.get(n["NodeID"], {})) for n in alive])


def largest_cluster() -> dict[str, float] | None:
    """The most the cluster can grow to, where an autoscaler has reported its node groups to Ray's GCS (the
    figure Ray Train checks its workers against); None where nothing is reported (a fixed cluster, or one
    whose autoscaler says nothing of its size: ``launcher.cluster_fit = "warn"`` is for those)."""
    try:
        from ray._private.state import state

        largest = state.get_max_resources_from_cluster_config()
    except Exception:  # a Ray that cannot say: the cluster is taken as it is now
        return None
    return {k: float(v) for k, v in largest.items()} if largest else None


def describe(nodes: Sequence[Node]) -> str:
    """'2 nodes: 10.0.0.1 (8 GPUs, 96 CPUs), 10.0.0.2 (8 GPUs, 96 CPUs)'."""
    listed = ", ".join(f"{n.name} ({_fmt(n.resources) or 'nothing'})" for n in nodes)
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {listed}"


def check_cluster_fit(cfg: SystemConfig, nodes: Sequence[Node], largest: Mapping[str, float] | None) -> str:
    """Refuse (ClusterFitError) a run that cannot fit ``nodes``; with ``launcher.cluster_fit = "warn"``, or
    where the cluster reports it can grow to ``largest`` and the run fits that, warn instead. Returns the
    line the launcher prints ("needs ... of ...")."""
    items = demands(cfg)
    required = [d for d in items if d.required]
    problems = fit(required, nodes)
    need = totals(required)
    summary = f"the run needs {_fmt(need)}; the Ray cluster has {describe(nodes)}"
    if not problems:
        extra = [d for d in items if not d.required]
        if extra and fit(required + extra, nodes):
            summary += (
                f" (no room for all reward.max_replicas = {cfg.reward.max_replicas} reward replicas: Serve "
                "runs those that fit)"
            )
        return summary
    beyond = [k for k in need if largest is not None and need[k] > largest.get(k, 0.0) + EPS]
    can_grow = largest is not None and not beyond
    if cfg.launcher.cluster_fit == "warn" or can_grow:
        if can_grow and largest is not None:
            bounded = {k: largest[k] for k in need if largest.get(k, 0.0) < UNBOUNDED}
            why = f"the cluster's autoscaler can grow it to {_fmt(bounded) or 'no stated limit'}"
        else:
            why = 'launcher.cluster_fit = "warn"'

        for p in problems:
            print(f"  [!!] cluster        {p}", flush=True)
        return f"{summary}; starting anyway ({why}): what does not fit waits for nodes"
    lines = "\n  ".join(problems)
    if largest is not None and beyond:
        grow = f"\nEven at its largest, as its autoscaler reports it, the cluster has {_fmt(largest)}."
    else:
        grow = (
            '\nWhere an autoscaler adds nodes for what waits, set launcher.cluster_fit = "warn" to start '
            "anyway."
        )
    raise ClusterFitError(
        f"the run does not fit the Ray cluster, which has {describe(nodes)}:\n  {lines}\n"
        f"Make the run smaller (the keys named) or the cluster larger.{grow}"
    )


def preflight_cluster(cfg: SystemConfig) -> str:
    """:func:`check_cluster_fit` against the connected Ray cluster."""
    return check_cluster_fit(cfg, cluster_nodes(), largest_cluster())


def unplaced(what: str, resources: Mapping[str, float], keys: str, count: int = 1) -> str:
    """Why ``what`` (``count`` items of ``resources``, placed together) finds no room, from what every node
    has free now: 'sampler replica 3: no node has 1 GPU free (free now: 10.0.0.1 0 of 8 GPUs, ...)'; '' where
    the cluster has room for it now."""
    free = free_nodes()
    left = place([Demand(what, count, resources, keys)], free).get(0, 0)
    if not left:
        return ""
    total = {n.name: n.resources for n in cluster_nodes()}
    short = [k for k in resources if all(n.resources.get(k, 0.0) + EPS < resources[k] for n in free)]
    shown = short or list(resources)
    now = ", ".join(
        f"{n.name} "
        + ", ".join(
            f"{n.resources.get(k, 0.0):g} of {total.get(n.name, {}).get(k, 0.0):g} {k}" for k in shown
        )
        for n in free
    )
    if count > 1:
        head = f"room for {count - left} of its {count} ({_fmt(resources)} each)"
    else:
        head = f"no node has {' and '.join(_amount(resources[k], k) for k in short) or _fmt(resources)} free"
    return f"{what}: {head} (free now: {now}); something else holds them, or the cluster lacks them ({keys})"


def actor_pending(actor: Any) -> bool:
    """The actor waits to be placed: Ray's GCS has it pending creation (no node has given it its resources
    yet, or its process is starting)."""
    from ray._private.state import actors

    try:
        info = actors(actor_id=actor._actor_id.hex())  # Ray's actor table (the GCS), no dashboard needed
    except Exception:  # an older or newer Ray that cannot say: taken as placed
        return False
    return bool(info) and info.get("State") in ("DEPENDENCIES_UNREADY", "PENDING_CREATION")


def fits_alone(resources: Mapping[str, float], node: Node) -> bool:
    """Whether one item of ``resources`` fits ``node`` with nothing else on it."""
    return _Room(node).take(resources)
