"""Comparisons, logical and bitwise torch-level ops, `where` and `clamp`: elementwise ops whose
results are exact in any dtype, so they compute in the result dtype and record no conversions.

Promotion, broadcasting and unsupported arguments as in `elementwise` (its helpers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fulmen.core import Symbol
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.elementwise import (
    _SCALAR_TYPES,
    TensorLike,
    _both_tensors,
    _check_operands,
    _composite,
    _is_integral,
    _map,
    _result_dtype,
    _unsupported,
)
from fulmen.ops.torch.utils import (
    Promotion,
    broadcast_shapes,
    broadcast_to,
    check_like_eager,
    promote,
    to_dtype,
)

T = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Comparisons and logical ops
# ---------------------------------------------------------------------------------------------


def _comparison(
    name: str, prim: Symbol, torch_fn: Callable, *aliases: Callable, methods: tuple[str, ...]
) -> Symbol:
    def decomposition(input, other):
        if not isinstance(input, torch.Tensor):
            raise _unsupported(name, "input must be a tensor")
        return _map(prim, input, other, kind=Promotion.ALWAYS_BOOL, exact=True)

    decomposition.__name__ = name
    decomposition.__doc__ = f"Elementwise `{name}` after promotion to a common dtype; bool result."
    return torch_op(torch_fn, *aliases, methods=methods, name=name)(decomposition)


eq = _comparison("eq", prims.eq, torch.eq, methods=("eq", "__eq__"))
ne = _comparison("ne", prims.ne, torch.ne, torch.not_equal, methods=("ne", "not_equal", "__ne__"))
lt = _comparison("lt", prims.lt, torch.lt, torch.less, methods=("lt", "less", "__lt__"))
le = _comparison("le", prims.le, torch.le, torch.less_equal, methods=("le", "less_equal", "__le__"))
gt = _comparison("gt", prims.gt, torch.gt, torch.greater, methods=("gt", "greater", "__gt__"))
ge = _comparison(
    "ge", prims.ge, torch.ge, torch.greater_equal, methods=("ge", "greater_equal", "__ge__")
)


def _logical(name: str, prim: Symbol) -> Symbol:
    def decomposition(input, other):
        _both_tensors(name, input, other)
        _check_operands(name, (input, other))
        shape = broadcast_shapes(input.shape, other.shape)
        a = broadcast_to(to_dtype(input, torch.bool), shape)
        b = broadcast_to(to_dtype(other, torch.bool), shape)
        return prim(a, b)

    decomposition.__name__ = name
    decomposition.__doc__ = f"`{name}` of the operands' truth values (nonzero is true)."
    torch_fn = getattr(torch, name)
    return torch_op(torch_fn, methods=(name,), name=name)(decomposition)


logical_and = _logical("logical_and", prims.bitwise_and)
logical_or = _logical("logical_or", prims.bitwise_or)
logical_xor = _logical("logical_xor", prims.bitwise_xor)


# ---------------------------------------------------------------------------------------------
# Bitwise ops
# ---------------------------------------------------------------------------------------------


def _bitwise(op: str, prim: Symbol, a, b):
    if _is_integral(_result_dtype(op, a, b)):
        return _map(prim, a, b)
    raise _unsupported(op, "bitwise ops need integral or bool operands")


def _bitwise_op(name: str, prim: Symbol, methods: tuple[str, ...]) -> Symbol:
    def decomposition(input, other):
        return _bitwise(name, prim, input, other)

    decomposition.__name__ = name
    decomposition.__doc__ = f"Elementwise `{name}` of integral or bool operands."
    return torch_op(getattr(torch, name), methods=methods, name=name)(decomposition)


bitwise_and = _bitwise_op("bitwise_and", prims.bitwise_and, ("bitwise_and", "__and__", "__rand__"))
bitwise_or = _bitwise_op("bitwise_or", prims.bitwise_or, ("bitwise_or", "__or__", "__ror__"))
bitwise_xor = _bitwise_op("bitwise_xor", prims.bitwise_xor, ("bitwise_xor", "__xor__", "__rxor__"))
bitwise_left_shift = _bitwise_op(
    "bitwise_left_shift", prims.bitwise_left_shift, ("bitwise_left_shift", "__lshift__")
)
bitwise_right_shift = _bitwise_op(
    "bitwise_right_shift", prims.bitwise_right_shift, ("bitwise_right_shift", "__rshift__")
)


@torch_op(T.__rlshift__)
def rlshift(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other << self`."""
    return _bitwise("rlshift", prims.bitwise_left_shift, other, self)


@torch_op(T.__rrshift__)
def rrshift(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other >> self`."""
    return _bitwise("rrshift", prims.bitwise_right_shift, other, self)


@torch_op(torch.bitwise_not, methods=("bitwise_not", "__invert__"))
def bitwise_not(input: torch.Tensor) -> torch.Tensor:
    """`~input` (logical not for bool tensors)."""
    if not isinstance(input, torch.Tensor) or not _is_integral(input.dtype):
        raise _unsupported("bitwise_not", "needs an integral or bool tensor")
    return prims.bitwise_not(input)


# ---------------------------------------------------------------------------------------------
# where and clamp
# ---------------------------------------------------------------------------------------------


@torch_op(torch.where)
def where(condition: torch.Tensor, input: TensorLike = None, other: TensorLike = None):
    """`input` where `condition` holds, else `other`; either may be a number.

    The one-argument form (`torch.where(condition)`, a data-dependent shape) is the opaque op.
    """
    if input is None or other is None:
        raise _unsupported("where", "the one-argument form")
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        raise _unsupported("where", "condition must be a bool tensor")
    for value in (input, other):
        if not isinstance(value, (torch.Tensor, *_SCALAR_TYPES)):
            raise _unsupported("where", "values must be tensors or numbers")
    values = [v for v in (input, other) if isinstance(v, torch.Tensor)]
    if len({t.device for t in (condition, *values)}) > 1:
        raise _unsupported("where", "operands on different devices")
    if len(values) < 2:  # a number that does not fit the result dtype: eager raises
        check_like_eager("where", torch.where, condition, input, other)
    dtype = promote(input, other)[1]
    shape = broadcast_shapes(condition.shape, *[v.shape for v in values])
    pred = broadcast_to(condition, shape)
    a, b = (broadcast_to(to_dtype(v, dtype), shape) for v in (input, other))
    if not values:  # two numbers: materialise one, as the prim needs a tensor value
        a = prims.full(tuple(shape), a, dtype, condition.device)
    return prims.where(pred, a, b)


@torch_op(T.where)
def tensor_where(self: torch.Tensor, condition: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`self.where(condition, other)`: `torch.where(condition, self, other)`."""
    return where(condition, self, other)


@torch_op(torch.clamp, torch.clip, methods=("clamp", "clip"))
def clamp(
    input: torch.Tensor,
    min: TensorLike | None = None,
    max: TensorLike | None = None,
) -> torch.Tensor:
    """`minimum(maximum(input, min), max)`: NaN in any operand gives NaN, and `max` wins where
    `min > max`, as in eager. `min`/`max` are numbers or tensors."""
    if min is None and max is None:
        raise _unsupported("clamp", "needs min or max")
    if not isinstance(input, torch.Tensor):
        raise _unsupported("clamp", "input must be a tensor")
    if len({isinstance(bound, torch.Tensor) for bound in (min, max) if bound is not None}) > 1:
        raise _unsupported("clamp", "one tensor bound and one number bound")  # eager rejects it
    if not any(isinstance(bound, torch.Tensor) for bound in (min, max)):
        check_like_eager("clamp", torch.clamp, input, min, max)  # a bound the dtype cannot hold

    def fn(a, low, high):
        if low is not None:
            a = prims.maximum(a, low)
        if high is not None:
            a = prims.minimum(a, high)
        return a

    return _composite("clamp", fn, input, min, max, exact=True)


@torch_op(torch.clamp_min, methods=("clamp_min",))
def clamp_min(input: torch.Tensor, min: TensorLike) -> torch.Tensor:
    """`clamp(input, min=min)`."""
    return clamp(input, min, None)


@torch_op(torch.clamp_max, methods=("clamp_max",))
def clamp_max(input: torch.Tensor, max: TensorLike) -> torch.Tensor:
    """`clamp(input, max=max)`."""
    return clamp(input, None, max)
