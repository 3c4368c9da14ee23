"""Arithmetic and comparisons of fulmen's symbolic sizes, each built once per ShapeEnv.

NOTE [symbolic arithmetic kept by the ShapeEnv]: every operation on a `torch.SymInt` (`s0 * 32`,
`s1 - 1`, `s0 == s1`) builds a new sympy expression and a new `SymNode`, tens of microseconds
each (sympy simplifies and asks its assumptions as it builds). A trace with symbolic sizes and
the passes after it ask the same few hundred operations thousands of times: each new proxy's
row-major strides, each shape compared with another, each view's sizes (tiny HF Llama's
training step: about 4,800 operations, 380 distinct, a third of its symbolic compile's time).
The result of one is a function of its operands' expressions and Python types alone (no guard
is recorded by building an expression; a guard is recorded only when a `SymBool` is made a
Python bool, which is not kept here): while `memoized_symbolic_ops()` is on, an operation of
two nodes of one of fulmen's ShapeEnvs (`keep_symbolic_ops`) returns the node the first such
operation built, kept in a dict on that ShapeEnv (which lives as long as the trace and its
entry). Other ShapeEnvs (torch.compile's), operations under a proxy mode (`make_fx`), and
ShapeEnvs that validate translations get PyTorch's own.
"""

from __future__ import annotations

import functools

from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.sym_node import SymNode

from fulmen.tracer.process_switch import ProcessSwitch

__all__ = ["keep_symbolic_ops", "memoized_symbolic_ops"]

_MEMO = "_fulmen_symbolic_ops"  # the attribute holding a ShapeEnv's built operations

# `SymNode` methods whose result depends only on the operands (`mod` is not one: it picks
# `Mod` or `PythonMod` by the value ranges, which guards narrow)
_PURE = ("add", "sub", "mul", "int_floordiv", "sym_max", "sym_min", "and_", "or_",
         "eq", "ne", "lt", "le", "gt", "ge")

_ORIGINALS = {name: getattr(SymNode, name) for name in _PURE}


def keep_symbolic_ops(env) -> None:
    """Let the operations on `env`'s symbolic sizes be kept (NOTE [symbolic arithmetic kept by
    the ShapeEnv]); not for a ShapeEnv that validates translations (each operation there
    records a node of its own)."""
    if not env._translation_validation_enabled:
        env.__dict__[_MEMO] = {}


def _kept(name: str, original):
    @functools.wraps(original)
    def operation(self: SymNode, other: SymNode) -> SymNode:
        env = self.shape_env
        memo = getattr(env, _MEMO, None)
        if memo is None or type(other) is not SymNode or other.shape_env is not env \
                or get_proxy_mode() is not None:
            return original(self, other)
        key = (name, self.expr, other.expr, self.pytype, other.pytype,
               self._optimized_summation, other._optimized_summation)
        node = memo.get(key)
        if node is None:
            node = memo[key] = original(self, other)
        return node

    return operation


_KEPT = {name: _kept(name, original) for name, original in _ORIGINALS.items()}


def _install() -> None:
    for name, operation in _KEPT.items():
        setattr(SymNode, name, operation)


def _uninstall() -> None:
    for name, original in _ORIGINALS.items():
        setattr(SymNode, name, original)


_SWITCH = ProcessSwitch(_install, _uninstall)


def memoized_symbolic_ops() -> ProcessSwitch:
    """The context manager under which operations on the symbolic sizes of fulmen's ShapeEnvs
    are built once per ShapeEnv (NOTE [symbolic arithmetic kept by the ShapeEnv]); reentrant,
    and process-wide like `fulmen.tracer.int_answers`."""
    return _SWITCH
