"""A symbolic bool passed where a torch function takes a `bool` is decided, with a guard.

With symbolic sizes, `q.shape[2] > 1` is a `torch.SymBool`. Code that hands it to a torch
function's `bool` parameter (HF attention: `F.scaled_dot_product_attention(...,
is_causal=q_len > 1)`) fails in torch's argument parser (`argument 'is_causal' must be bool,
not SymBool`) before any `__torch_function__` sees the call, and the symbolic trace is thrown
away (the call is compiled for its exact shapes instead, and again for the next size).

`symbolic_bools_decided()`, around a trace with symbolic sizes, replaces the functions listed
in `_TAKERS` (module attributes looked up when called, as HF and user code do) by wrappers
that turn each `SymBool` argument of one of fulmen's ShapeEnvs into `bool(value)`: the
ShapeEnv answers from the call's sizes and records a guard (`s0 > 1`), so the entry serves only
calls that decide the same way (guard-and-specialise, as torch.compile does with a SymBool it
must make concrete). Everything else (real bools, other threads' eager calls, another
ShapeEnv's SymBools) passes through unchanged. A function imported by name before tracing
(`from torch.nn.functional import scaled_dot_product_attention`) keeps the original and still
fails as before (then compiled for exact shapes, never a wrong answer).
"""

from __future__ import annotations

import functools
import importlib

import torch

from fulmen.tracer.formatting import SHAPE_ENV_MARK
from fulmen.tracer.process_switch import ProcessSwitch

# (module, attribute) of torch functions with `bool` parameters that model code passes
# comparisons of sizes
_TAKERS = (("torch.nn.functional", "scaled_dot_product_attention"),)

_originals: dict[tuple[str, str], object] = {}
_wrappers: dict[tuple[str, str], object] = {}


def _decided(value):
    if type(value) is torch.SymBool and getattr(value.node.shape_env, SHAPE_ENV_MARK, False):
        return bool(value)  # the ShapeEnv's answer, with its guard
    return value


def _deciding(fn):
    """`fn` with each of fulmen's `SymBool` arguments made a bool (a guard)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        args = tuple(map(_decided, args))
        kwargs = {name: _decided(value) for name, value in kwargs.items()}
        return fn(*args, **kwargs)

    call.fulmen_decides_bools = True
    return call


def _replace() -> None:
    for where in _TAKERS:
        module = importlib.import_module(where[0])
        current = getattr(module, where[1])
        if getattr(current, "fulmen_decides_bools", False):
            continue
        _originals[where] = current
        if where not in _wrappers or _wrappers[where].__wrapped__ is not current:
            _wrappers[where] = _deciding(current)
        setattr(module, where[1], _wrappers[where])


def _restore() -> None:
    for where, original in _originals.items():
        module = importlib.import_module(where[0])
        if getattr(module, where[1]) is _wrappers.get(where):  # not replaced again meanwhile
            setattr(module, where[1], original)
    _originals.clear()


_SWITCH = ProcessSwitch(_replace, _restore)


def symbolic_bools_decided() -> ProcessSwitch:
    """The context manager replacing the `_TAKERS` functions around a trace with symbolic
    sizes (see the module docstring)."""
    return _SWITCH
