"""Configuration of the agent API (the ``[agents]`` table of a run file): docs/guides/agents.md."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.common.config import Section


class AgentsConfig(Section):
    """The OpenAI-compatible API agents drive episodes through, served by every sampler replica. Its token and
    TLS are the sampler's client API's (``sampler.api_token``, ``sampler.api_tls``)."""

    enabled: bool = Field(
        False,
        description="Serve the agent API. Tasks without a tool-use environment are then played by agents that "
        "claim them (POST /v1/episodes), not by the sampler itself.",
    )
    host: str = Field("0.0.0.0", description="Address the agent API binds.")
    advertise_host: str = Field(
        "",
        description="Address the other sampler replicas reach this one's agent API at, to pass on an episode's "
        "requests that reached them (behind one Service, any replica may get them); empty: the address of "
        "the interface that routes to the run's Redis.",
    )
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Agent API port; 0 = a free port. sampler.port_per_replica adds the replica index.",
    )
    episode_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Seconds an episode may stay open after it is claimed (and a group's episodes may wait "
        "to be claimed); an expired episode gives its group up (counted, the task retried).",
    )
    claim_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds POST /v1/episodes waits for a task the lag bound admits before it answers 503.",
    )
    max_turns: int = Field(16, ge=1, description="Chat completions per episode.")
    prefix_mode: Literal["splice", "template"] = Field(
        "splice",
        description="How a turn's prompt ids are built: 'splice' keeps the sampled ids and appends what the "
        "chat template added; 'template' renders the whole conversation and breaks where it differs.",
    )
    tool_parser: str = Field(
        "hermes",
        description="vLLM tool parser that reads tool calls out of the model's text (Qwen models: 'hermes'); "
        "empty: answers are text only.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of every chat template render, e.g. {enable_thinking = false}.",
    )
