"""`isinstance(n, int)` on a symbolic size or integer answers, in user code, as the number does.

While fulmen traces with symbolic sizes (`fulmen.tracer.symbolic`), a size read from a tensor
(`x.shape[1]`) or an integer argument that varies (litgpt's `input_pos_maxp1`, HF's
`logits_to_keep`) is a `torch.SymInt`, which is no `int` to Python. Code that asks
`isinstance(n, int)` (HF's `slice_logits_to_keep`: a slice for an int, an index for a tensor)
would silently take another path than eager, with no guard. `symbolic_ints_are_ints()`, around
such a trace, replaces the builtin `isinstance` so that a call from code outside fulmen and
torch on a SymInt of one of fulmen's ShapeEnvs answers what it answers for an `int`; every
other call (fulmen's and torch's own checks, which tell symbols from numbers, other ShapeEnvs
such as torch.compile's, other objects) gets the builtin's answer. NOTE [what a symbolic int
cannot answer] in `fulmen.tracer.shape_policy` says what is still different (`type(n) is int`).
"""

from __future__ import annotations

import builtins
import sys

import torch

from fulmen.core.source import is_internal
from fulmen.tracer.formatting import SHAPE_ENV_MARK
from fulmen.tracer.process_switch import ProcessSwitch

_builtin_isinstance = builtins.isinstance


_SymInt = torch.SymInt


def _isinstance(obj, classinfo) -> bool:
    answer = _builtin_isinstance(obj, classinfo)
    if type(obj) is not _SymInt:
        return answer
    as_number = _builtin_isinstance(0, classinfo)  # the question asked of a number
    # torch's symbolic-shape code asks tens of thousands of these per trace: the caller's
    # frame is looked at only where the two answers differ
    if answer == as_number or not getattr(obj.node.shape_env, SHAPE_ENV_MARK, False) \
            or is_internal(sys._getframe(1).f_code.co_filename):
        return answer
    return as_number


# NOTE [internal modules keep the builtin isinstance]: while the replacement is in place, the
# modules below (torch's SymInt arithmetic and pytree, fulmen's proxy walks) ask about 70,000
# of the 75,000 `isinstance` questions of a tiny HF Llama's symbolic trace; each went through
# `_isinstance` (~0.15 us more than the builtin). They are internal (`is_internal`), so
# `_isinstance` gives them the builtin's answer anyway: they get the builtin itself, bound as a
# global of theirs (a global is found before `builtins`), and lose it when the replacement ends.
_KEEP_BUILTIN = ("torch.fx.experimental.sym_node", "torch.fx.experimental.symbolic_shapes",
                 "torch.utils._pytree", "torch._prims_common", "fulmen.core.proxy",
                 "fulmen.core.symbol", "fulmen.proxies.tensor", "fulmen.ops.meta")
_BOUND: list = []  # the modules given the builtin by `_replace`


def _replace() -> None:
    builtins.isinstance = _isinstance
    for name in _KEEP_BUILTIN:
        module = sys.modules.get(name)
        if module is None or "isinstance" in vars(module) \
                or not is_internal(getattr(module, "__file__", None) or ""):
            continue
        vars(module)["isinstance"] = _builtin_isinstance
        _BOUND.append(module)


def _restore() -> None:
    builtins.isinstance = _builtin_isinstance
    while _BOUND:
        vars(_BOUND.pop()).pop("isinstance", None)


# Around a trace with symbolic sizes: user code's `isinstance` on fulmen's SymInts answers as for
# an `int` (see the module docstring); the builtin is put back after the last such trace ends,
# also after an error.
_SWITCH = ProcessSwitch(_replace, _restore)


def symbolic_ints_are_ints() -> ProcessSwitch:
    """The context manager replacing `isinstance` around a trace with symbolic sizes (see the
    module docstring)."""
    return _SWITCH
