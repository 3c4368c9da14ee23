"""The executor registry and the default priority list.

Executors are referred to by object or by name. `torch` always ends a resolved list: it runs
every torch-level op and prim, so every trace has an executor for every statement.
"""

from __future__ import annotations

from collections.abc import Sequence

from fulmen.executors.base import Executor

_REGISTRY: dict[str, Executor] = {}
_DEFAULTS: list[str] = []


def register_executor(executor: Executor) -> Executor:
    """Make `executor` available by name. Re-registering a name replaces the old executor."""
    _REGISTRY[executor.name] = executor
    return executor


def get_executor(name: str) -> Executor:
    """The registered executor called `name`.

    Raises:
        KeyError: naming the registered executors when `name` is unknown.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no executor {name!r}; registered: {sorted(_REGISTRY)}") from None


def get_default_executors() -> list[Executor]:
    """The executors `fulmen.jit` uses when none are given, in priority order."""
    return [get_executor(name) for name in _DEFAULTS]


def set_default_executors(executors: Sequence[Executor | str]) -> None:
    """Set the default priority list (names or executor objects; objects get registered)."""
    names = []
    for ex in executors:
        if isinstance(ex, Executor):
            register_executor(ex)
            ex = ex.name
        get_executor(ex)
        names.append(ex)
    _DEFAULTS[:] = names


def resolve_executors(executors: Sequence[Executor | str] | None) -> list[Executor]:
    """Executor objects for a user's priority list, with `torch` appended if missing.

    Executor objects in the list are registered under their names (printed traces look
    executors up by name).
    """
    if executors is None:
        resolved = get_default_executors()
    else:
        resolved = [get_executor(ex) if isinstance(ex, str) else ex for ex in executors]
    for ex in resolved:
        if _REGISTRY.get(ex.name) is not ex:
            register_executor(ex)
    if not any(ex.name == "torch" for ex in resolved):
        resolved.append(get_executor("torch"))
    return resolved
