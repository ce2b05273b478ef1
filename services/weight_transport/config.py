"""The ``[weight_broker]`` table of a run file: how versions travel (transport, the weight group) and what the
broker keeps; the learner, the samplers and the broker all read it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, model_validator

from services.common.config import Section


class WeightBrokerConfig(Section):
    """Transport, retention and memory bounds of versioned weight distribution."""

    transport: Literal["tcp", "collective"] = Field(
        "tcp",
        description="Through the broker with weight bytes on its TCP data plane (tcp), or broadcast by the "
        "learner into every sampler engine's workers over a process group (collective: NCCL on GPU, gloo on "
        "CPU; the broker is not in it, and its TCP path carries what the group did not: versions published "
        "while it forms, late joiners' catch-up).",
    )
    retain_versions: int = Field(3, ge=1, description="Versions kept for late samplers and audits.")
    storage: Literal["memory", "disk"] = Field("memory", description="Where retained versions live.")
    storage_dir: str = Field("", description="Directory for disk storage; empty = <run_dir>/weights.")
    chunk_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="The most bytes of one payload frame of the broker's data plane (a version's tensors travel in frames of at most this size).",
    )
    rpc_timeout_s: float = Field(300.0, gt=0, description="Deadline of one publish or fetch call.")
    publish_retry_s: float = Field(
        120.0,
        ge=0,
        description="How long the learner retries a publish the broker did not take because it could not be "
        "reached (a broker being restarted comes back on its ports) before the learner fails.",
    )
    grpc_port: int = Field(50052, ge=0, le=65535, description="Broker gRPC port; 0 = a free port.")
    data_port: int = Field(
        50055, ge=0, le=65535, description="Broker TCP data-plane port (weight bytes); 0 = a free port."
    )
    advertise_host: str = Field(
        "",
        description="Host name samplers and the learner reach the broker at (put in announcements). Empty: "
        "the launcher fills in the broker's node IP on a Ray cluster (launcher.ray_address) and 127.0.0.1 "
        "with a local Ray; a broker started on its own, and its clients, use 127.0.0.1 (set it when they run "
        "on other machines; the Helm chart sets the head pod's IP).",
    )
    group_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="collective: the weight group's rendezvous port on learner rank 0: the first free of "
        "group_port .. group_port+7 when it starts (a learner before it may linger), kept for every epoch; "
        "0 = a free port.",
    )
    group_host: str = Field(
        "",
        description="collective: the address receivers reach learner rank 0 at; empty: the address of the "
        "interface that routes to the run's Redis, IPv4 or IPv6 as its host resolves (127.0.0.1 when Redis is "
        "local).",
    )
    group_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="collective: the group's backend; auto = nccl when the learner is on a GPU."
    )
    group_timeout_s: float = Field(120.0, gt=0, description="collective: timeout of one broadcast's steps.")
    group_form_timeout_s: float = Field(
        30.0, gt=0, description="collective: how long members wait for each other when a group forms."
    )
    group_settle_s: float = Field(
        3.0,
        ge=0,
        description="collective: learner rank 0 forms a new epoch only once the registered members have not "
        "changed for this long, so samplers registering one after another (at start-up, each as its engine "
        "has loaded version 0) form one epoch, not one each, every one holding the engines of those already "
        "in it in their joins; meanwhile versions go to those not in a group through the broker. 0 = at once.",
    )
    group_settle_max_s: float = Field(
        30.0,
        gt=0,
        description="collective: the longest a change of the members waits for them to settle "
        "(group_settle_s): members that keep changing form an epoch after this long anyway.",
    )
    group_bucket_mb: int = Field(256, ge=1, description="collective: MiB per broadcast bucket.")
    group_member_ttl_s: float = Field(
        10.0, gt=0, description="collective: a member whose heartbeat is this old has left the group."
    )
    metrics_port: int = Field(9104, ge=0, le=65535, description="Prometheus /metrics port; 0 = a free port.")
    ray_resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources the broker's actor asks for, e.g. {vcpo_broker = 1}: it runs only "
        "on a node that offers them (the Helm chart's head pod, whose IP it advertises).",
    )

    @model_validator(mode="after")
    def _settle_bounded(self) -> WeightBrokerConfig:
        if self.group_settle_max_s < self.group_settle_s:
            raise ValueError(
                f"weight_broker.group_settle_max_s = {self.group_settle_max_s:g} is less than "
                f"weight_broker.group_settle_s = {self.group_settle_s:g}: the members could never be seen "
                "settled before the bound; raise group_settle_max_s or lower group_settle_s"
            )
        return self


def broker_host(wb: WeightBrokerConfig) -> str:
    """The host the broker is reached at: ``advertise_host``, or this machine's loopback when empty."""
    return wb.advertise_host or "127.0.0.1"
