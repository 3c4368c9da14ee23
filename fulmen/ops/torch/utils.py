"""Type promotion, broadcasting and dimension helpers for torch-level decompositions.

Type promotion is PyTorch's own (`torch._prims_common.elementwise_dtypes`), so results have
exactly eager's dtypes, including the rules for Python scalars and 0-d tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Number

import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion
from torch._prims_common import elementwise_dtypes

from fulmen.core import FulmenError
from fulmen.ops import prims
from fulmen.proxies.tensor import known_same_shape

__all__ = [
    "Promotion", "broadcast_shapes", "broadcast_to", "canonical_dim", "canonical_dims",
    "check_like_eager", "check_uint64_operands", "elementwise", "exp_saturating", "promote",
    "to_dtype", "is_number",
    "scalar_to_tensor_like",
]  # fmt: skip


def is_number(value) -> bool:
    """A Python number, or a symbolic size (`torch.SymInt`/`SymFloat`) standing for one."""
    return isinstance(value, (Number, torch.SymInt, torch.SymFloat)) \
        and not isinstance(value, torch.Tensor)


def promote(*args, kind: Promotion = Promotion.DEFAULT) -> tuple[torch.dtype, torch.dtype]:
    """(computation dtype, result dtype) of an elementwise op on `args`, as in eager."""
    # a numpy scalar counts as the Python number it holds (np.float64 is a float subclass,
    # which PyTorch's helper refuses; HF CTRL scales by `np.sqrt(d_model)`)
    args = [a.item() if isinstance(a, np.generic) else a for a in args if a is not None]
    return elementwise_dtypes(*args, type_promotion_kind=kind)


def check_uint64_operands(op: str, args) -> None:
    """Raise where eager's promotion raises: a Python int in [2**63, 2**64) is a uint64 to
    eager, which promotes with nothing but wider unsigned types, so eager refuses it beside bool
    tensors alone (`bool_mask / 2**63`); integral or floating operands set the result type."""
    present = [a for a in args if a is not None]
    if any(_is_uint64(a) for a in present) and not any(_outranks_int(a) for a in present):
        raise FulmenError("Promotion for uint16, uint32, uint64 types is not supported, "
                          "attempted to promote Bool and UInt64", op=f"ltorch.{op}")


def _is_uint64(value) -> bool:
    return type(value) is int and 2**63 <= value < 2**64


def _outranks_int(value) -> bool:
    """Whether `value` keeps a Python int from setting the result type (integral or floating
    tensors, Python floats and complex numbers do)."""
    if isinstance(value, torch.Tensor):
        return value.dtype != torch.bool
    return isinstance(value, (float, complex))


def check_like_eager(op: str, torch_fn, *args, **kwargs) -> None:
    """Raise eager's error, as a FulmenError naming `op`, where eager refuses `torch_fn` on
    these arguments for their dtypes and Python numbers alone (`clamp(int8_tensor, min=300)`,
    `where(c, float32_tensor, 1e308)`: numbers that do not fit the result dtype). The call runs
    eager on one-element CPU tensors of the arguments' dtypes."""

    def stand_in(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros((), dtype=value.dtype)
        return value

    with torch._C.DisableTorchFunction():
        try:
            torch_fn(*[stand_in(a) for a in args],
                     **{key: stand_in(value) for key, value in kwargs.items()})
        except RuntimeError as error:
            raise FulmenError(str(error).split("\n")[0], op=f"ltorch.{op}") from None


def to_dtype(a, dtype: torch.dtype):
    """`a` converted to `dtype` (tensors through `prims.convert_element_type`)."""
    if isinstance(a, torch.Tensor):
        return a if a.dtype == dtype else prims.convert_element_type(a, dtype)
    if dtype == torch.bool:
        return bool(a)
    if dtype.is_complex:
        return complex(a)
    if dtype.is_floating_point:
        return float(a)
    return int(a)


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The broadcast of `shapes` (numpy rules).

    With symbolic sizes, a dimension whose sizes are a literal 1 and sizes known equal without
    a guard (`s0` beside `1`, `s0` beside `s0`) is that size whatever it turns out to be, so no
    guard is recorded (`torch.broadcast_shapes` would ask `s0 == 1` and specialise a batch of 1);
    other dimensions are left to torch, which guards what it decides.

    Raises:
        FulmenError: when the shapes do not broadcast.
    """
    if all(isinstance(size, int) for shape in shapes for size in shape):
        return _torch_broadcast_shapes(shapes)
    rank = max(len(shape) for shape in shapes)
    result = []
    for dim in range(-rank, 0):
        sizes = [shape[dim] for shape in shapes if len(shape) >= -dim]
        other = [size for size in sizes if not (isinstance(size, int) and size == 1)]
        if not other:
            result.append(1)
        elif all(known_same_shape((other[0],), (size,)) for size in other[1:]):
            result.append(other[0])
        else:
            result.append(_torch_broadcast_shapes([(size,) for size in sizes])[0])
    return tuple(result)


def _torch_broadcast_shapes(shapes) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError as error:
        raise FulmenError(str(error), op="broadcast") from None


def broadcast_to(a, shape: Sequence[int]):
    """Broadcast tensor `a` to `shape` with numpy rules (numbers pass through)."""
    if not isinstance(a, torch.Tensor) or known_same_shape(a.shape, shape):
        return a  # unknown (symbolic sizes): broadcasting to an equal shape is right too
    offset = len(shape) - a.ndim
    if offset < 0:
        raise FulmenError(f"cannot broadcast {tuple(a.shape)} to {tuple(shape)}", op="broadcast")
    return prims.broadcast_in_dim(a, tuple(shape), tuple(range(offset, len(shape))))


def elementwise(prim, *args, kind: Promotion = Promotion.DEFAULT, compute_dtype=None):
    """Apply an elementwise prim with eager's type promotion and broadcasting.

    Operands are converted to the computation dtype (float16/bfloat16 compute in float32), the
    prim is applied, and the result is converted to the result dtype.
    """
    computation, result = promote(*args, kind=kind)
    if compute_dtype is not None:
        computation = compute_dtype
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise FulmenError("needs at least one tensor operand", op=prim.id)
    shape = broadcast_shapes(*[t.shape for t in tensors])
    operands = [broadcast_to(to_dtype(a, computation) if isinstance(a, torch.Tensor) else a, shape)
                for a in args]
    out = prim(*operands)
    return to_dtype(out, result) if out.dtype != torch.bool else out


def exp_saturating(a):
    """`exp(a)`, with the same values, whose prim-level gradient is 0, not `0 * inf = NaN`,
    where `exp` overflows and the cotangent is 0 (see NOTE [exp past overflow]).

    NOTE [exp past overflow]: `1 / (1 + exp(-x))` (sigmoid, silu, glu) is 0 where `exp(-x)` is
    inf, and differentiated prim by prim (`decompose_to_prims` before autodiff) the cotangent
    reaching `exp` there is 0 and exp's rule multiplies it by `exp(-x) = inf`: NaN where eager's
    gradient is 0. Here `exp` reads 0 where its argument is past the overflow point of the
    dtype, and the result is replaced by inf there: the values are `exp`'s, and the gradient
    through the replaced elements is 0 (correct wherever the cotangent at an overflowed `exp`
    is 0, as in the ops above; not a general `exp`). Where that cotangent is NaN or inf (the
    op's value is NaN, as silu at -inf, or a later op's gradient is inf, as log's at 0),
    eager's gradient is NaN and this one 0. Non-floating inputs get plain `exp`.
    """
    if not a.dtype.is_floating_point:
        return prims.exp(a)
    over = prims.gt(a, math.log(torch.finfo(a.dtype).max))
    return prims.where(over, math.inf, prims.exp(prims.where(over, 0.0, a)))


def scalar_to_tensor_like(value: Number, like: torch.Tensor, dtype: torch.dtype | None = None):
    """A tensor filled with `value`, with `like`'s shape and device."""
    return prims.full(tuple(like.shape), value, dtype or like.dtype, like.device)


def canonical_dim(dim: int, rank: int, *, op: str = "op") -> int:
    """Wrap a possibly negative `dim` into [0, rank) (rank 0 accepts -1 and 0).

    A symbolic `dim` (an int argument traced as a `torch.SymInt`) is specialized to its value
    with a guard, as dynamo does: which dimension an op works on decides the trace's shapes.

    Raises:
        IndexError: `dim` is out of range, with eager's message.
    """
    if isinstance(dim, torch.SymInt):
        dim = int(dim)
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        raise IndexError(f"{op}: Dimension out of range (expected to be in range of "
                         f"[{-bound}, {bound - 1}], but got {dim})")
    return dim % bound


def canonical_dims(dims, rank: int, *, op: str = "op") -> tuple[int, ...]:
    """None -> all dims; int or sequence -> sorted, wrapped dims."""
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({canonical_dim(d, rank, op=op) for d in dims}))
