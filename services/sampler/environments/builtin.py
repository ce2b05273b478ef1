"""The built-in environment types a spec can name (``builtin``): name -> factory of the environment."""

from __future__ import annotations

from collections.abc import Callable

from services.sampler.environments.base import Environment


def _python(name: str) -> Environment:
    from services.sampler.environments.python_env import PythonEnvironment

    return PythonEnvironment(name)


BUILTINS: dict[str, Callable[[str], Environment]] = {"python": _python}
