"""The public extension API: write and register executors.

    from fulmen.extend import OperatorExecutor, register_executor
"""

from fulmen.executors import (
    Executor,
    FusionExecutor,
    OperatorExecutor,
    get_default_executors,
    get_executor,
    register_executor,
    set_default_executors,
)
from fulmen.executors.base import Implementation, resolve_target

__all__ = [
    "Executor",
    "FusionExecutor",
    "Implementation",
    "OperatorExecutor",
    "get_default_executors",
    "get_executor",
    "register_executor",
    "resolve_target",
    "set_default_executors",
]
