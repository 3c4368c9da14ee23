"""Formatting a symbolic size from user code gives its number, guarded.

A `torch.SymInt` prints as its expression (`s0`), so user code that formats a size while
fulmen traces with symbolic sizes (`f"{x.shape[1]}"`, `str(cache.length)`, a dict key or a
string length built from it) would silently take another path than eager, with no guard.
`install()` wraps `SymInt.__str__` and `__repr__` and gives it a `__format__` once: called from
code outside fulmen and torch while a trace records, on a size of one of fulmen's ShapeEnvs
(`SymbolicSizes` marks them), they answer with the number and specialise the size to it
(`int()`: a guard, as `range(n)` does); every other caller gets PyTorch's behaviour (fulmen's
printer and checks, torch's own messages, other ShapeEnvs such as torch.compile's).
"""

from __future__ import annotations

import sys

import torch

from fulmen.core import get_tracectx
from fulmen.core.printer import size_text
from fulmen.core.source import is_internal

SHAPE_ENV_MARK = "_fulmen_env"  # the attribute `SymbolicSizes` sets on its ShapeEnv
_installed = False


def _from_user_code(value: torch.SymInt) -> bool:
    """Whether formatting `value` now is user code's question about one of fulmen's sizes."""
    if get_tracectx() is None or not value.node.expr.free_symbols:
        return False
    if not getattr(value.node.shape_env, SHAPE_ENV_MARK, False):
        return False
    caller = sys._getframe(2).f_code.co_filename  # (the frame that called str() or format())
    return not is_internal(caller)


# NOTE [the text of a symbolic size]: PyTorch prints a SymInt as its sympy expression (`str` and
# `repr` alike), through sympy's printer: 20-40 us a size. A printed trace writes every size of
# every proxy in its type comments and of every view in its arguments (tiny HF Llama's
# symbolic training step: about 550 sizes per forward and backward print, a quarter of their
# Python compilation), and the expressions repeat; the text of an expression never changes, so
# it is kept, with the printer's other texts (`fulmen.core.printer.size_text`, NOTE [printed
# expressions kept]).


def install() -> None:
    """Wrap `torch.SymInt`'s string conversions (idempotent)."""
    global _installed
    if _installed:
        return
    original_format = torch.SymInt.__format__

    def __str__(self) -> str:
        if _from_user_code(self):
            return str(int(self))
        return size_text(self)

    def __repr__(self) -> str:
        if _from_user_code(self):
            return repr(int(self))
        return size_text(self)

    def __format__(self, spec: str) -> str:
        if _from_user_code(self):
            return format(int(self), spec)
        return original_format(self, spec)

    torch.SymInt.__str__ = __str__
    torch.SymInt.__repr__ = __repr__
    torch.SymInt.__format__ = __format__
    _installed = True
