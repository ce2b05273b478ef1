"""The scorers: exact match, math answer equivalence, Countdown, sandboxed code, environment reward."""

from services.reward.scorers.base import (
    Score,
    ScoreInput,
    ScorerError,
    ScorerFn,
    UnknownScorerError,
    get_scorer,
    load_plugins,
    register,
    scorer_names,
)

__all__ = [
    "Score",
    "ScoreInput",
    "ScorerError",
    "ScorerFn",
    "UnknownScorerError",
    "get_scorer",
    "load_plugins",
    "register",
    "scorer_names",
]
