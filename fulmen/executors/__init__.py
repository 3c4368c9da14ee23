"""Executors: who runs each operation. The extension API lives in `base` and `registry`; each
built-in executor is a package of its own that uses only that API."""

from fulmen.executors.base import Executor, FusionExecutor, OperatorExecutor
from fulmen.executors.codegen import codegen_ex  # registers "codegen"
from fulmen.executors.registry import (
    get_default_executors,
    get_executor,
    register_executor,
    resolve_executors,
    set_default_executors,
)

__all__ = [
    "Executor",
    "codegen_ex",
    "FusionExecutor",
    "OperatorExecutor",
    "get_default_executors",
    "get_executor",
    "register_executor",
    "resolve_executors",
    "set_default_executors",
]

from fulmen.executors.nvfuser import nvfuser_available  # noqa: E402

if nvfuser_available():  # optional: registered only where an nvFuser frontend is installed
    from fulmen.executors.nvfuser import nvfuser_ex

    register_executor(nvfuser_ex)
