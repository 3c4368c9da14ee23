"""Dense layouts read off sizes and strides, static or symbolic: the order of a tensor's dims
from innermost to outermost when its strides lay it out densely without overlap (`dense_order`).
Read by the claim pass (does a proxy report eager's layout) and by the codegen executor's torch
fallback (the strides to relay an output to at each run's sizes)."""

from __future__ import annotations

from torch import SymInt


def _expr(value):
    """The sympy expression (or int) of a size or stride, with `Max(1, e)` read as `e` (how
    PyTorch writes a stride over a size that could be 0; the density check only decides the
    order of dims, and an empty tensor has no elements to lay out)."""
    if not isinstance(value, SymInt):
        return value
    return value.node.expr.replace(_is_max_of_one, _other_than_one)


def _is_max_of_one(expr) -> bool:
    return type(expr).__name__ == "Max" and len(expr.args) == 2 and 1 in expr.args


def _other_than_one(expr):
    return expr.args[0] if expr.args[1] == 1 else expr.args[1]


def dense_order(shape: tuple, strides: tuple) -> list[int] | None:
    """The dims of size above 1, innermost first, when `strides` lay out `shape` densely
    without overlap (each stride the product of the sizes of the dims inside it); else None.
    Symbolic sizes (never 0 or 1: PyTorch specializes those) and strides are matched as
    expressions (`s0*s1` is `s1*s0`), so the answer holds for every size of the symbols."""
    exprs = [(_expr(size), _expr(stride)) for size, stride in zip(shape, strides)]
    left = [d for d, (size, _) in enumerate(exprs) if not (type(size) is int and size <= 1)]
    order, expected = [], 1
    while left:
        found = [d for d in left if _same_expr(exprs[d][1], expected)]
        if len(found) != 1:
            return None
        order.append(found[0])
        left.remove(found[0])
        expected = expected * exprs[found[0]][0]
    return order


def _same_expr(a, b) -> bool:
    """Whether two sizes or strides (ints or sympy expressions) are equal for every value of
    their symbols: a product of sums PyTorch's SymInt arithmetic expanded
    (`-s21*s37 + 7*s37`) equals its factored spelling (`s37*(7 - s21)`)."""
    if a == b:
        return True
    if type(a) is int and type(b) is int:
        return False
    import sympy

    return sympy.expand(a - b) == 0
