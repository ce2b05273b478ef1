"""What a scorer is, and the registry that finds scorers by name.

A scorer is a plain function ``(ScoreInput) -> Score``: the response text and the task's reference in, a
reward out. It knows nothing of streams, gRPC, Ray or timeouts; the scoring pool (``pool.py``) runs it in a
worker process under the scorer's time limit.

What it decides:

- A *wrong* answer is not a failure: it is a ``Score`` with value 0. A scorer raises :class:`ScorerError`
  only when it cannot judge the response at all (the reference is malformed, an environment reward is
  missing, ...); ``reason`` is a short, bounded label (a metric label), the message says what was wrong.
- Scorers register by name with :func:`register`. Names are unique; registering a second function under a
  taken name is an error, so a plugin cannot silently replace a built-in scorer.
- Plugin modules (config ``reward.plugins``) are imported by :func:`load_plugins` in the service and in
  every scoring worker, so their ``@register`` calls run wherever scoring happens.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
_REASON = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


@dataclass(frozen=True)
class ScoreInput:
    """One response to score, with what the task says about the right answer."""

    response: str
    reference: str = ""
    task_id: str = ""
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    payload_json: str = ""
    environment_reward: float | None = None  # the reward a tool-use environment returned, if any


@dataclass(frozen=True)
class Score:
    """A scorer's verdict: the reward, plus named parts of it (e.g. tests passed) for the record."""

    value: float
    components: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


class ScorerError(Exception):
    """The scorer cannot judge this response; ``reason`` is a bounded metric label, the message the detail."""

    def __init__(self, reason: str, message: str) -> None:
        if not _REASON.match(reason):
            raise ValueError(f"scorer failure reason {reason!r} must match {_REASON.pattern}")
        super().__init__(message)
        self.reason = reason


class UnknownScorerError(KeyError):
    """No scorer is registered under the name asked for."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown scorer {self.name!r}; registered: {', '.join(scorer_names())}"


ScorerFn = Callable[[ScoreInput], Score]

_REGISTRY: dict[str, ScorerFn] = {}


def register(name: str) -> Callable[[ScorerFn], ScorerFn]:
    """Decorator: make ``fn`` the scorer called ``name``."""
    if not _NAME.match(name):
        raise ValueError(f"scorer name {name!r} must match {_NAME.pattern}")

    def add(fn: ScorerFn) -> ScorerFn:
        have = _REGISTRY.get(name)
        if have is not None and have is not fn:
            raise ValueError(f"scorer {name!r} is already registered ({have.__module__}.{have.__qualname__})")
        _REGISTRY[name] = fn
        return fn

    return add


def get_scorer(name: str) -> ScorerFn:
    """The scorer registered as ``name``; :class:`UnknownScorerError` names the registered ones otherwise."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownScorerError(name) from None


def scorer_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def load_plugins(modules: Sequence[str]) -> None:
    """Import modules that register extra scorers; an import error names the module."""
    _load_builtins()
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"reward plugin module {module!r} could not be imported: {exc}") from exc


_BUILTINS = (
    "services.reward.scorers.exact",
    "services.reward.scorers.math_answer",
    "services.reward.scorers.countdown",
    "services.reward.scorers.verl_rules",
    "services.reward.scorers.code_tests",
    "services.reward.scorers.environment",
)


def _load_builtins() -> None:
    for module in _BUILTINS:
        importlib.import_module(module)
