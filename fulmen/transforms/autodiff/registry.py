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


def vjp_rule(sym: Symbol) -> Callable[[Callable], Callable]:
    """Register the decorated function as the VJP rule of `sym`."""

    def register(rule: Callable) -> Callable:
        if sym in _RULES:
            raise ValueError(f"{sym.id} already has a VJP rule")
        _RULES[sym] = rule
        return rule

    return register


def rule_for(sym: Symbol) -> Callable | None:
    return _RULES.get(sym)


def has_rule(sym: Symbol) -> bool:
    return sym in _RULES


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
