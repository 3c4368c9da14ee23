"""Torch implementations of every prim: the reference semantics of the primitive set."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.ops import prims

_SAME_NAME = [
    "neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
    "atanh", "erf", "erfc", "erfinv", "lgamma", "digamma", "floor", "ceil", "round", "trunc",
    "sign", "reciprocal", "bitwise_not", "logical_not", "isnan", "isinf", "isfinite", "signbit",
    "where", "reshape", "permute", "cat", "flip", "index_select", "scatter_add", "index_put",
    "matmul", "convolution",
]  # fmt: skip

# Binary prims: the torch function, which accepts (tensor, tensor) and (tensor, number).
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "remainder": torch.remainder, "fmod": torch.fmod, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
    "copysign": torch.copysign, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "bitwise_left_shift": torch.bitwise_left_shift,
    "bitwise_right_shift": torch.bitwise_right_shift, "eq": torch.eq, "ne": torch.ne,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}  # fmt: skip


def _as_tensor_like(value, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _binary(fn):
    def run(a, b):
        if not isinstance(a, torch.Tensor):
            a = _as_tensor_like(a, b)
        elif not isinstance(b, torch.Tensor) and fn in (torch.maximum, torch.minimum,
                                                        torch.atan2, torch.copysign):
            b = _as_tensor_like(b, a)
        return fn(a, b)

    run.__name__ = fn.__name__
    return run


def floor_div(a, b):
    return torch.div(*_tensors(a, b), rounding_mode="floor")


def trunc_div(a, b):
    return torch.div(*_tensors(a, b), rounding_mode="trunc")


def _tensors(a, b):
    return (_as_tensor_like(a, b) if not isinstance(a, torch.Tensor) else a), b


def convert_element_type(a, dtype):
    return a.to(dtype, copy=True)  # a prim's output never aliases its input


def broadcast_in_dim(a, shape, broadcast_dims):
    view_shape = [1] * len(shape)
    for size, dim in zip(a.shape, broadcast_dims):
        view_shape[dim] = size
    return a.reshape(view_shape).expand(tuple(shape))


def squeeze(a, dims):
    return a.squeeze(tuple(dims)) if dims else a.view(a.shape)


def slice_prim(a, starts, ends, steps):
    index = tuple(slice(s, e, st) for s, e, st in zip(starts, ends, steps))
    return a[index]


def pad(a, value, config):
    if any(interior for _, _, interior in config):
        shape = [size + max(size - 1, 0) * interior for size, (_, _, interior) in zip(a.shape, config)]
        spread = torch.full(shape, value, dtype=a.dtype, device=a.device)
        spread[tuple(slice(None, None, interior + 1) for _, _, interior in config)] = a
        a = spread
    flat = []
    for low, high, _ in reversed(config):
        flat += [low, high]
    return F.pad(a, flat, value=value)


def _reduction(fn):
    def run(a, dims):
        return fn(a, tuple(dims)) if dims else a.clone()

    return run


def sum_(a, dims):
    # dtype=a.dtype: torch.sum promotes bool/integer inputs to int64; the prim keeps the dtype
    return torch.sum(a, tuple(dims), dtype=a.dtype) if dims else a.clone()


def prod(a, dims):
    for dim in sorted(dims, reverse=True):
        a = torch.prod(a, dim, dtype=a.dtype)  # keep the dtype (torch.prod promotes to int64)
    return a.clone() if not dims else a


def var(a, dims, correction):
    if not dims:  # the variance of each element alone
        return torch.var(a.unsqueeze(-1), -1, correction=correction)
    return torch.var(a, tuple(dims), correction=correction)


def argmax(a, dim):
    return torch.argmax(a, dim)


def argmin(a, dim):
    return torch.argmin(a, dim)


def take_along_dim(a, index, dim):
    return torch.gather(a, dim, index)


def linear(a, weight, bias):
    return F.linear(a, weight, bias)


def embedding(indices, weight):
    return F.embedding(indices, weight)


def full(shape, fill_value, dtype, device):
    return torch.full(tuple(shape), fill_value, dtype=dtype, device=device)


def iota(length, start, step, dtype, device):
    if not (dtype.is_floating_point or dtype.is_complex) and step:
        # integers: `start + i * step` in int64 is arange's own arithmetic; one op, not four
        # (the class indices of a cross-entropy backward: 3 us instead of 15-25 us)
        end = start + length * step
        return torch.arange(start, end, step, dtype=torch.int64, device=device).to(dtype)
    wide = torch.float64 if dtype.is_floating_point or dtype.is_complex else torch.int64
    return (torch.arange(length, dtype=wide, device=device) * step + start).to(dtype)


def uniform(shape, low, high, dtype, device):
    return torch.empty(tuple(shape), dtype=dtype, device=device).uniform_(low, high)


def bernoulli(shape, p, dtype, device, strides=None):
    if strides is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device).bernoulli_(p)
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype,
                               device=device).bernoulli_(p)


def prim_implementations() -> dict:
    """prim symbol -> torch callable."""
    table = {getattr(prims, name): getattr(torch, name) for name in _SAME_NAME}
    table.update({getattr(prims, name): _binary(fn) for name, fn in _BINARY.items()})
    table.update({
        prims.floor_div: floor_div, prims.trunc_div: trunc_div,
        prims.convert_element_type: convert_element_type, prims.broadcast_in_dim: broadcast_in_dim,
        prims.squeeze: squeeze, prims.slice_prim: slice_prim, prims.pad: pad,
        prims.sum: sum_, prims.amax: _reduction(torch.amax),
        prims.amin: _reduction(torch.amin), prims.prod: prod, prims.var: var,
        prims.argmax: argmax, prims.argmin: argmin, prims.take_along_dim: take_along_dim,
        prims.linear: linear, prims.embedding: embedding, prims.full: full, prims.iota: iota,
        prims.uniform: uniform, prims.bernoulli: bernoulli,
    })  # fmt: skip
    return table
