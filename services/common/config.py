"""Configuration: one pydantic model per service, loaded in layers, with errors that name the bad key.

A run is described by one TOML file (presets in ``deploy/presets/``) whose tables are sections:
``[run]`` and ``[streams]`` are shared and read by every service (the lag bound ``k``, groups per step and
the run id live in ``[run]``); ``[sampler]``, ``[learner]``, ``[reward]``, ``[weight_broker]`` belong to one
service each. A service's config model (e.g. ``SamplerServiceConfig``) holds the shared sections plus its
own, and ignores the other services' sections (which their own services validate).

Layers, later wins:
  1. the defaults in the models;
  2. TOML files (or resolved-config JSON files), in the order given (tables deep-merge);
  3. environment variables ``VCPO_<SECTION>__<FIELD>`` (e.g. ``VCPO_RUN__K=16``; nested sections add
     more ``__``); variables without the double underscore (``VCPO_TARGET``) are not config;
  4. command-line flags ``--<section>.<field> VALUE`` (e.g. ``--run.k 16``) or ``--set run.k=16``.
Values from the environment and the command line are read as TOML literals when they parse as one
(``16``, ``1e-6``, ``true``, ``[0.9, 0.999]``) and as plain strings otherwise.

Every leaf value remembers which layer set it, so a validation error reads
``run.k = -1 (from env VCPO_RUN__K): Input should be greater than or equal to 0``.

This module imports nothing heavy: ``--help`` and config validation are instant.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "VCPO_"
# Top-level tables a run file may contain; each service ignores the sections of the others.
SYSTEM_SECTIONS = (
    "run",
    "streams",
    "sampler",
    "learner",
    "reward",
    "weight_broker",
    "launcher",
    "evaluation",
    "agents",
)


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names each bad key, its value and its source."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RunConfig(Section):
    """The shared section every service reads: what run this is and its lag bound."""

    run_id: str = Field(
        "local",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Names the run; prefixes every Redis key and stream so runs can share one Redis.",
    )
    k: int = Field(
        4,
        ge=0,
        description="Maximum policy lag: the learner never trains on a rollout whose first token came from a "
        "version more than k steps older than the one it updates. 0 = synchronous on-policy training.",
    )
    groups_per_step: int = Field(
        8, ge=1, description="Prompt groups the learner consumes per optimizer step."
    )
    model: str = Field(
        "",
        description="The policy: a Hugging Face hub id or a local directory. Empty: the tiny built-in model, "
        "made in the run directory.",
    )
    redis_url: str = Field(
        "",
        description="redis://[:password@]host:port/db. Empty: the launcher starts a local redis-server on a "
        "free port.",
    )
    run_dir: Path = Field(
        Path("runs/local"), description="Where checkpoints, logs and reports of the run go."
    )
    seed: int = Field(0, ge=0, description="Base random seed; each service and replica derives its own.")


class StreamsConfig(Section):
    """Shared settings of the Redis streams between the services."""

    tasks_maxlen: int = Field(10_000, ge=1, description="Cap on unconsumed entries of the `tasks` stream.")
    rollouts_maxlen: int = Field(
        1_024, ge=1, description="Cap on unconsumed entries of `rollouts`; samplers wait when it is full."
    )
    scored_maxlen: int = Field(
        1_024, ge=1, description="Cap on unconsumed entries of `scored`; reward workers wait when full."
    )
    weights_maxlen: int = Field(64, ge=1, description="Announcements kept on the `weights` stream.")
    block_ms: int = Field(
        1_000, ge=1, description="Longest a consumer blocks in one read before re-checking."
    )
    reclaim_idle_ms: int = Field(
        60_000,
        ge=1,
        description="An entry pending this long with a consumer that stopped is reclaimed by another.",
    )
    max_deliveries: int = Field(
        5,
        ge=1,
        description="An entry delivered this many times without an ack goes to the dead-letter stream.",
    )
    producer_wait_timeout_s: float = Field(
        0.0, ge=0, description="Longest a producer waits on a full stream before raising; 0 = forever."
    )


class ServiceConfig(BaseModel):
    """Base of each service's top-level config: the shared sections plus the service's own (in subclasses).

    Other services' sections in the same run file are accepted and ignored here; unknown sections are errors.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True)

    run: RunConfig = Field(default_factory=RunConfig)
    streams: StreamsConfig = Field(default_factory=StreamsConfig)


M = TypeVar("M", bound=BaseModel)


def parse_literal(text: str) -> Any:
    """Read a value from the environment or the command line: a TOML literal if it is one, else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _Layers:
    """Deep-merged raw values plus, for each dotted leaf key, the layer that set it."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.source: dict[str, str] = {}

    def merge(self, values: Mapping[str, Any], source: str, prefix: tuple[str, ...] = ()) -> None:
        target = self.data
        for i, part in enumerate(prefix):
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                where = ".".join(prefix[: i + 1])
                raise ConfigError(
                    f"{source}: {where!r} is a list; set a list as a whole (e.g. in a run file), not one "
                    "of its items by a dotted key"
                )
        for key, value in values.items():
            path = (*prefix, key)
            if isinstance(value, Mapping):
                if not isinstance(target.get(key, {}), dict):
                    target[key] = {}
                self.merge(value, source, path)
            else:
                target[key] = value
                self.source[".".join(path)] = source

    def set(self, dotted: str, value: Any, source: str) -> None:
        *parents, leaf = dotted.split(".")
        self.merge({leaf: value}, source, tuple(parents))


def _source_of(layers: _Layers, dotted: str) -> str:
    # an error on a whole table (e.g. a missing section) has no leaf source: use any leaf below it
    if dotted in layers.source:
        return layers.source[dotted]
    for key, source in layers.source.items():
        if key.startswith(dotted + "."):
            return source
    return "default"


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _format_errors(err: ValidationError, layers: _Layers) -> str:
    lines = []
    for e in err.errors():
        dotted = ".".join(str(p) for p in e["loc"])
        source = _source_of(layers, dotted)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {dotted!r} (from {source})")
        else:
            value = _lookup(layers.data, dotted)
            shown = json.dumps(value, default=str) if value is not None else "(missing)"
            lines.append(f"{dotted} = {shown} (from {source}): {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(
    model: type[M],
    files: Sequence[str | Path] = (),
    env: Mapping[str, str] | None = None,
    overrides: Iterable[tuple[str, Any, str]] = (),
) -> M:
    """Build ``model`` from defaults, then ``files``, then ``env`` (default: os.environ), then ``overrides``.

    ``overrides`` are ``(dotted_key, value, source)`` triples, e.g. from the command line.
    Raises ConfigError naming every bad key, its value and where it came from.
    """
    layers = _Layers()
    for f in files:
        path = Path(f)
        try:
            if path.suffix == ".json":  # a resolved config written by write_resolved (what launchers hand on)
                layers.merge(json.loads(path.read_text()), str(path))
            else:
                with path.open("rb") as fh:
                    layers.merge(tomllib.load(fh), str(path))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    for name, raw in sorted((os.environ if env is None else env).items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            layers.set(dotted, parse_literal(raw), f"env {name}")
    for dotted, value, source in overrides:
        layers.set(dotted, value, source)

    if issubclass(model, ServiceConfig):
        unknown = sorted(set(layers.data) - set(SYSTEM_SECTIONS))
        if unknown:
            where = ", ".join(f"{u!r} (from {_source_of(layers, u)})" for u in unknown)
            raise ConfigError(f"invalid configuration:\n  unknown section {where}; known: {SYSTEM_SECTIONS}")
    try:
        return model.model_validate(layers.data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, layers)) from None


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> Iterable[tuple[str, str]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaf_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.description or ""


def add_config_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add ``--config FILE`` (repeatable), ``--set KEY=VALUE`` and one ``--<section>.<field>`` flag per field."""
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="run TOML file (repeatable; later wins)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a value, e.g. run.k=16"
    )
    group = parser.add_argument_group("configuration (also VCPO_<SECTION>__<FIELD> environment variables)")
    for dotted, description in _leaf_fields(model):
        group.add_argument(
            f"--{dotted}",
            dest=f"cfg:{dotted}",
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=description.replace("%", "%%"),
        )


def config_from_args(model: type[M], args: argparse.Namespace, env: Mapping[str, str] | None = None) -> M:
    """Load ``model`` from the arguments added by :func:`add_config_arguments`."""
    overrides: list[tuple[str, Any, str]] = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        overrides.append((key.strip(), parse_literal(value), f"--set {item}"))
    for dest, value in vars(args).items():
        if dest.startswith("cfg:"):
            dotted = dest[4:]
            overrides.append((dotted, parse_literal(value), f"--{dotted}"))
    return load_config(model, args.config, env, overrides)


def write_resolved(config: BaseModel, directory: str | Path, name: str = "config.resolved.json") -> Path:
    """Write the fully resolved config next to the run's outputs, as JSON."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
