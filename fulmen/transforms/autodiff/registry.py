"""The VJP rule registry, owned by the autodiff transform.

A rule receives the output cotangent(s), the forward output and the forward arguments, and
returns one cotangent per argument (None where there is none): JAX-style reverse rules written
with fulmen ops, so backward traces are traces like any other.

    @vjp_rule(prims.mul)
    def _mul_vjp(grad, out, a, b):
        return grad * b, grad * a

For torch-level ops (composite rules), arguments are bound to the op's signature first: the rule
receives every parameter positionally, defaults filled in, and returns one cotangent per
parameter. For multi-output ops `grad` is a tuple with None for outputs that received no
cotangent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from fulmen.core import Symbol

_RULES: dict[Symbol, Callable] = {}
_SAVING_FORWARDS: dict[Symbol, Callable] = {}


def _registrar(table: dict, sym: Symbol, what: str) -> Callable[[Callable], Callable]:
    """A decorator putting the decorated function in `table` under `sym` (once: a second
    registration raises `ValueError` naming `what`)."""

    def register(fn: Callable) -> Callable:
        if sym in table:
            raise ValueError(f"{sym.id} already has {what}")
        table[sym] = fn
        return fn

    return register


def vjp_rule(sym: Symbol) -> Callable[[Callable], Callable]:
    """Register the decorated function as the VJP rule of `sym`."""

    return _registrar(_RULES, sym, "a VJP rule")


def rule_for(sym: Symbol) -> Callable | None:
    return _RULES.get(sym)


def has_rule(sym: Symbol) -> bool:
    return sym in _RULES


def saving_forward(sym: Symbol) -> Callable[[Callable], Callable]:
    """Register the decorated function as the saving forward of `sym` (NOTE [saving forwards]).

    NOTE [saving forwards]: a VJP rule sees only the op's inputs and output, so an op whose
    fused backward needs statistics of its forward (attention's log-sum-exp) would have to
    recompute the forward. A saving forward is called by the split, inside a recording context,
    as `saving(bsym, requires)` (`requires`: names of values that require grad); it records
    statements computing the op's output and the statistics, and returns
    `(new_output, backward)`: the value standing for the op's output in what it recorded
    (renamed to the op's own output by the split), and `backward(grad, output)`, called while
    the backward is recorded with a value equal to the op's output (NOTE [values kept under
    another layout] in `split.py`), returning one cotangent per argument like a rule. It
    returns None to decline the call site (the op then runs whole and its rule applies).
    """

    return _registrar(_SAVING_FORWARDS, sym, "a saving forward")


def saving_forward_for(sym: Symbol) -> Callable | None:
    return _SAVING_FORWARDS.get(sym)


def bound_arguments(sym: Symbol, args: tuple, kwargs: dict) -> list:
    """The call's arguments in `sym`'s signature order, defaults filled in.

    Prims are called positionally and are returned as given.
    """
    if sym.is_prim or not kwargs and sym.fn is None:
        return list(args)
    signature = inspect.signature(sym.fn)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = []
    for name, param in signature.parameters.items():
        value = bound.arguments[name]
        if param.kind == param.VAR_POSITIONAL:
            values.extend(value)
        elif param.kind == param.VAR_KEYWORD:
            values.extend(value.values())
        else:
            values.append(value)
    return values
