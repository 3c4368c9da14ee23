"""Symbolic sizes in kernels: what lowering may decide about a size, and the sizes of one call.

A region traced with symbolic sizes (`fulmen.tracer.symbolic`) holds `torch.SymInt`s in its
shapes and in the parameters of its view prims. Lowering compares sizes (is this statement on
the iteration shape? does this broadcast add an axis of size 1?); with SymInts each comparison
is asked of the ShapeEnv without adding a guard (`statically_known_true`): a symbol's range
starts at 2 (sizes 0 and 1 are specialised), so `s0 == 1` is known false and `s0 == s0` known
true, while `s0 == s1` is unknown. An unknown comparison raises `Unsupported`: the region is not
fused (the torch executor runs it), never lowered on a guess.

What lowering keeps of a symbolic size is a `SymSize` (its sympy expression: hashable, compared
structurally, no guards); ints stay ints, so a region of static shapes lowers exactly as before.
At run time `Binder` computes the value of every `SymSize` of a region from the sizes of its
input tensors (a generated function, `s0 = t0.shape[0]`, as printed traces bind symbols), and
`concrete` makes the region with those values, which the runtimes then call like any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

from fulmen.core.errors import FulmenError
from fulmen.core.printer import symbol_bindings
from fulmen.executors.codegen.ir import Access, ViewStep
from fulmen.executors.codegen.ops import Unsupported

__all__ = ["Binder", "SymSize", "concrete", "freeze", "has_sym_sizes", "same", "same_shape"]


@dataclasses.dataclass(frozen=True)
class SymSize:
    """A symbolic size as lowering keeps it: the sympy expression of a `torch.SymInt`."""

    expr: object

    def __repr__(self) -> str:
        return str(self.expr)


def _symbolic(value) -> bool:
    return isinstance(value, torch.SymInt) and bool(value.node.expr.free_symbols)


def freeze(value):
    """`value` (a view prim's parameter: a size, a tuple of them, a number) with every
    symbolic size as a `SymSize` and every specialised one as an int; tuples for lists."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, torch.SymInt):
        return SymSize(value.node.expr) if _symbolic(value) else int(value)
    return value


def same(a, b) -> bool:
    """Whether sizes `a` and `b` (ints or `torch.SymInt`s) are equal, as the ShapeEnv knows
    without adding a guard.

    Raises:
        Unsupported: when it does not know (their equality depends on the call).
    """
    if a is b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    # lowering asks the same questions many times (every operand of every candidate region):
    # the answers are kept by the ShapeEnv (a known answer stays known: guards only add facts)
    env = (a if isinstance(a, torch.SymInt) else b).node.shape_env
    key = (_key(a), _key(b))
    if env is None:
        known = {}
    else:
        known = env.__dict__.get(_SAME_SIZES)
        if known is None:
            known = env.__dict__[_SAME_SIZES] = {}
    answer = known.get(key)
    if answer is None:
        known_true = _statically_known_true()
        if known_true(a == b):
            answer = True
        elif known_true(a != b):
            answer = False
        else:
            raise Unsupported(f"whether sizes {a} and {b} are equal depends on the call")
        known[key] = answer
    return answer


_SAME_SIZES = "_fulmen_same_sizes"  # the ShapeEnv's attribute keeping `same`'s answers


def _statically_known_true():
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true


def _key(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def same_shape(a, b) -> bool:
    """Whether shapes `a` and `b` are equal (`same` for each size; raises like it). A size
    compared with itself (the same object: most of lowering's comparisons) is equal without
    a call."""
    return len(a) == len(b) and all(x is y or same(x, y) for x, y in zip(a, b))


def has_sym_sizes(value) -> bool:
    """Whether `value` (a nested tuple or an IR object) holds a `SymSize`."""
    if isinstance(value, SymSize):
        return True
    if isinstance(value, tuple):
        return any(has_sym_sizes(v) for v in value)
    if isinstance(value, (Access, ViewStep)):
        return has_sym_sizes(value.steps if isinstance(value, Access) else value.params)
    return False


def _exprs(value, found: dict) -> None:
    if isinstance(value, SymSize):
        found.setdefault(value.expr, len(found))
    elif isinstance(value, tuple):
        for v in value:
            _exprs(v, found)
    elif isinstance(value, Access):
        _exprs(value.steps, found)
    elif isinstance(value, ViewStep):
        _exprs(value.params, found)


def _substituter(value, index: dict):
    """A function of the values of a region's sizes (a tuple, in the order of `index`, a dict
    {expression: position}) giving `value` with each `SymSize` replaced by its size, rebuilding
    only the tuples and IR objects that hold one (the rest is shared); None when `value` holds
    none. Built once per region as one generated Python expression (NOTE [a region made
    concrete by generated code]): a new size of a symbolic region (every shape of a sweep's
    first pass) then costs one call building its symbolic parts, not a walk of every access
    and view parameter."""
    scope: dict = {"_access": _maker(Access, ("input", "steps")),
                   "_view": _maker(ViewStep, ("name", "params"))}

    def const(item) -> str:
        name = f"_c{len(scope)}"
        scope[name] = item
        return name

    def emit(item) -> str | None:
        if isinstance(item, SymSize):
            return f"v[{index[item.expr]}]"
        if isinstance(item, tuple):
            parts = [emit(part) for part in item]
            if all(part is None for part in parts):
                return None
            return "(" + "".join(f"{const(part) if text is None else text}, "
                                 for part, text in zip(item, parts)) + ")"
        if isinstance(item, Access):
            steps = emit(item.steps)
            return None if steps is None else f"_access({const(item.input)}, {steps})"
        if isinstance(item, ViewStep):
            params = emit(item.params)
            return None if params is None else f"_view({const(item.name)}, {params})"
        return None

    # NOTE [a region made concrete by generated code]: closures per tuple and IR object cost
    # a Python call each (about 20 per region of tiny HF Llama), and the frozen dataclasses'
    # constructors a checked attribute write per field; the generated expression builds the
    # same values (plain tuples, the same IR objects) in one call.
    expression = emit(value)
    if expression is None:
        return None
    exec(_code(f"def _substitute(v):\n    return {expression}\n",
               "<fulmen codegen concrete sizes>"), scope)
    return scope["_substitute"]


_CODES: dict[str, object] = {}


def _code(source: str, filename: str):
    """The compiled code of generated `source`, a pure function of its text (the key): the
    regions of a model's layers generate the same binders and substituters (their constants
    live in each region's own scope, named alike), compiled once and run in each region's
    scope."""
    key = source
    code = _CODES.get(key)
    if code is None:
        if len(_CODES) >= 256:
            _CODES.clear()
        code = _CODES[key] = compile(source, filename, "exec")
    return code


def _maker(cls, fields: tuple[str, ...]):
    """A constructor of the frozen dataclass `cls` without the per-field checked writes of its
    own (the IR classes have no `__post_init__`), as `_replaced` copies one."""
    def make(*values):
        new = object.__new__(cls)
        new.__dict__.update(zip(fields, values))
        return new

    return make


def _parts(lowered) -> tuple:
    """What of a lowered region may hold sizes: its shape, its accesses, its output plan."""
    return lowered.shape, lowered.kernel.accesses, lowered.outputs


class Binder:
    """The sizes of one call of a symbolic region: `Binder(lowered)(inputs)` is the tuple of
    the values of the region's `SymSize`s, read from its input tensors; `concrete(lowered,
    binder, values)` the region with them.

    Raises (constructor):
        Unsupported: when the sizes of the region's inputs do not determine a symbol.
    """

    def __init__(self, lowered) -> None:
        from torch.utils._sympy.printers import PythonPrinter

        found: dict = {}
        _exprs(_parts(lowered), found)
        self.exprs = tuple(found)
        symbols = set().union(*(expr.free_symbols for expr in self.exprs)) if found else set()
        names = [f"_i{i}" for i in range(len(lowered.inputs))]
        proxies = [_Named(name, getattr(proxy, "shape", None))
                   for name, proxy in zip(names, lowered.inputs)]
        try:
            lines = symbol_bindings(proxies, symbols, "a codegen region", strides=False)
        except FulmenError as error:
            raise Unsupported(str(error)) from None
        printer = PythonPrinter()
        values = "".join(f"int({printer.doprint(expr)}), " for expr in self.exprs)
        source = "\n  ".join([f"def _sizes({', '.join(names)}):", *lines,
                              f"return ({values})"])
        scope: dict = {"math": math}
        exec(_code(source, "<fulmen codegen sizes>"), scope)
        self.source = source
        self._sizes = scope["_sizes"]
        parts = _parts(lowered)
        index = {expr: i for i, expr in enumerate(self.exprs)}
        self.substitute = _substituter(parts, index) or (lambda values: parts)

    def __call__(self, inputs) -> tuple[int, ...]:
        return self._sizes(*inputs)


@dataclasses.dataclass(frozen=True)
class _Named:
    """The shape of a region input under the binder's parameter name."""

    name: str
    shape: object


def concrete(lowered, binder: Binder, values: Iterable[int]):
    """`lowered` (a `LoweredRegion` or `LoweredRows`, the one `binder` was made for) with the
    sizes `values` (from `binder`) in place of its `SymSize`s."""
    shape, accesses, outputs = binder.substitute(tuple(values))
    kernel = _replaced(lowered.kernel, accesses=accesses)
    return _replaced(lowered, kernel=kernel, shape=shape, outputs=outputs)


def _replaced(value, **changes):
    """`dataclasses.replace(value, **changes)` for a frozen dataclass without `__post_init__`
    (the IR and lowered regions): its fields copied, without the per-field checks of
    `replace` (two of them were a third of binding a region to a new size)."""
    new = object.__new__(type(value))
    new.__dict__.update(value.__dict__, **changes)
    return new
