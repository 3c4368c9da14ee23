"""Every `FULMEN_*` environment variable fulmen reads, declared once: name, type, default, meaning.

This module is the only one in `fulmen` that reads `os.environ` for them, and it imports
nothing from fulmen, so every layer may use it (it is the lowest layer of
`tests/test_layers.py`). Each reader asks `config.get(NAME)` where it always read the
variable (at import, when a jitted function is made, when the kernel cache is opened), so
setting a variable takes effect at the same moment as before.

Example:
    >>> from fulmen import config
    >>> config.get("FULMEN_CACHE_SIZE_LIMIT")     # 8 unless the environment says otherwise
    8
    >>> print(config.describe())                   # the table of all variables
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variable:
    """One environment variable: `parse` turns its text into the value (`str`, `int`), which
    is `default` when the variable is unset."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


VARIABLES: dict[str, Variable] = {variable.name: variable for variable in (
    Variable("FULMEN_CHECK", str, "structural",
             "trace checks after every pass: `structural` (SSA, def-before-use, metadata), `1` "
             "also prints and compiles every stage (the test suite sets it), `0` none; read at "
             "import (`fulmen.transforms.base`)"),
    Variable("FULMEN_LOGS", str, "",
             "log topics to turn on at import, comma-separated (`recompiles`, `passes`, "
             "`fusion`, `breaks`) or `all` (`fulmen.logs`)"),
    Variable("FULMEN_DYNAMIC", str, "",
             "the default of `jit(dynamic=)`: `1` symbolic sizes from the first call, `0` "
             "never, `strict` symbolic and raising where a symbolic trace fails; empty: "
             "automatic (static first, symbolic for the dimensions that change); `defer`: "
             "automatic, with the first call run eagerly, its shapes only recorded, so that "
             "a sweep of shapes compiles once (NOTE [a deferred first call] in "
             "`tracer/shape_policy.py`)"),
    Variable("FULMEN_CACHE_SIZE_LIMIT", int, 8,
             "the default of `jit(cache_size_limit=)`: specialisations kept per call structure "
             "(argument tree, leaf types, what object arguments hold; NOTE [cache limits per "
             "call structure] in `fulmen/cache_policy.py`) before its calls run eagerly"),
    Variable("FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT", int, 64,
             "specialisations kept per jitted function over all call structures together "
             "(at least `cache_size_limit`), before further new calls run eagerly"),
    Variable("FULMEN_CACHE_DIR", str, None,
             "the compiled-kernel disk cache; unset or empty: `$XDG_CACHE_HOME/fulmen`, else "
             "`~/.cache/fulmen` (`executors/codegen/cache.py`)"),
    Variable("FULMEN_CODEGEN_COMPILE", str, "lazy",
             "when codegen compiles a region's kernel: `lazy` (in a background thread from its "
             "`FULMEN_CODEGEN_HOT_CALLS`-th call) or `eager` (when fused); read at import "
             "(`executors/codegen/build.py`)"),
    Variable("FULMEN_CODEGEN_HOT_CALLS", int, 3,
             "the call of a region at which its lazy compile starts"),
    Variable("FULMEN_FUSE_TINY", int, 0,
             "`1`: fuse every CPU region, also those the tiny-region policy leaves on torch "
             "(`transforms/region_size.py` `TINY_REGION`; the test suite sets it); read at each "
             "fusion pass"),
    Variable("FULMEN_CODEGEN_POOL_BYTES", int, None,
             "bytes of free blocks the CPU output pool keeps (0 turns it off); unset: "
             "min(1 GiB, RAM / 16) (`executors/codegen/cpu/pool.py`)"),
    Variable("FULMEN_CODEGEN_SCALARS", int, 0,
             "`1`: CPU kernels take floats read at run time as arguments, so the ops of "
             "`executors/codegen/ops.SCALAR_OPS` fuse (off by default: NOTE [run-time floats as "
             "kernel arguments]); read at import, `ops.set_scalar_arguments` changes it"),
)}


def get(name: str) -> Any:
    """The value of the declared variable `name` now: its parsed text, else its default.

    Raises:
        KeyError: `name` is not declared in `VARIABLES`.
        ValueError: the text does not parse as the variable's type (the message names it).
    """
    variable = VARIABLES[name]
    text = os.environ.get(name)
    if text is None:
        return variable.default
    try:
        return variable.parse(text)
    except ValueError as error:
        raise ValueError(f"{name}={text!r}: expected {variable.parse.__name__} ({error})") \
            from None


def describe() -> str:
    """One line per variable: name, default, meaning (for docs and `print`)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.doc}" for v in VARIABLES.values())


__all__ = ["VARIABLES", "Variable", "describe", "get"]
