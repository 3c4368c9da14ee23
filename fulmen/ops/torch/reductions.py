"""Reduction torch-level ops: sum, mean, prod, amax/amin, max/min, var/std, all/any,
argmax/argmin and logsumexp.

Dtypes follow eager: `sum`/`prod` of bool and integer inputs accumulate (and return) int64;
float16/bfloat16 inputs are reduced in float32 and converted back; `mean`, `var` and `std` need
floating or complex inputs. Reduction prims drop the reduced dims, so `keepdim=True` restores them
with `broadcast_in_dim` (see `restore_dims`).

NOTE [empty dim lists]: for `sum`, `mean`, `amax`, `amin`, `var` and `std`, `dim=()` (or `[]`)
reduces every dimension, like `dim=None`; for `all` and `any` it reduces none.

Argument combinations a decomposition does not cover (named dims, repeated dims, dtypes eager
rejects) raise `NotYetSupportedError`, so the tracer runs the torch op whole and eager's own
checks apply.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import torch

from fulmen.core import NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.utils import Promotion, elementwise, promote, to_dtype

__all__ = ["reduction_dims", "restore_dims", "expand_reduced", "compute_dtype"]

# NOTE: this module defines `sum`, `max`, `min`, `all` and `any` (torch-level ops); helpers
# reach the Python builtins as `builtins.any` etc.

_HALF = (torch.float16, torch.bfloat16)


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of `dtype` values computes in (float32 for half types)."""
    if dtype in _HALF:
        return torch.float32
    if dtype == torch.complex32:
        return torch.complex64
    return dtype


def reduction_dims(
    a: torch.Tensor, dim, *, op: str, empty_means_all: bool = True
) -> tuple[int, ...]:
    """The sorted, non-negative dims a reduction over `dim` reduces.

    `dim` is None (every dim), an int or a sequence of ints; see NOTE [empty dim lists].

    Example:
        >>> reduction_dims(x4d, (-1, 1), op="sum")
        (1, 3)
    """
    rank = a.ndim
    if dim is None:
        return tuple(range(rank))
    if isinstance(dim, int) and not isinstance(dim, bool):
        dims = [dim]
    elif (
        isinstance(dim, Sequence)
        and not isinstance(dim, str)
        and builtins.all(isinstance(d, int) and not isinstance(d, bool) for d in dim)
    ):
        dims = list(dim)
        if not dims:
            return tuple(range(rank)) if empty_means_all else ()
    else:
        raise _unsupported(op, f"dim={dim!r} (named or non-integer dims) is not supported yet")
    bound = builtins.max(rank, 1)
    if not builtins.all(-bound <= d < bound for d in dims):
        raise _unsupported(op, f"dim {dim!r} out of range for rank {rank}")
    wrapped = [d % bound for d in dims]
    if len(set(wrapped)) != len(wrapped):
        raise _unsupported(op, f"dim {dim!r} repeats a dimension")
    if rank == 0:  # a 0-d tensor accepts dim 0 / -1 but has nothing to reduce
        return ()
    return tuple(sorted(wrapped))


def restore_dims(out: torch.Tensor, shape: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    """`out`, the result of reducing a tensor of `shape` over `dims`, with the reduced dims put
    back as size 1 (what `keepdim=True` returns)."""
    if not dims:
        return out
    kept_shape = tuple(1 if d in dims else size for d, size in enumerate(shape))
    kept = tuple(d for d in range(len(shape)) if d not in dims)
    return prims.broadcast_in_dim(out, kept_shape, kept)


def expand_reduced(out: torch.Tensor, shape: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    """Broadcast a reduction result back to the reduced tensor's `shape` (for normalisations)."""
    if not dims:
        return out
    kept = tuple(d for d in range(len(shape)) if d not in dims)
    return prims.broadcast_in_dim(out, tuple(shape), kept)


def _reduced_shape(shape: Sequence[int], dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(size for d, size in enumerate(shape) if d not in dims)


def _finish(out: torch.Tensor, a: torch.Tensor, dims, keepdim: bool, dtype: torch.dtype):
    out = restore_dims(out, a.shape, dims) if keepdim else out
    return to_dtype(out, dtype)


def _check_dtype_arg(op: str, dtype) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise _unsupported(op, f"dtype={dtype!r} is not a torch.dtype")


def _check_not_empty(op: str, a: torch.Tensor, dims) -> None:
    if builtins.any(a.shape[d] == 0 for d in dims):
        raise _unsupported(op, "reducing an empty dimension (eager raises)")


def _check_ordered(op: str, a: torch.Tensor) -> None:
    if a.dtype.is_complex:
        raise _unsupported(op, "complex inputs have no order (eager raises)")


# --------------------------------------------------------------------------- sum, mean, prod


def _accumulation_dtype(a: torch.Tensor, dtype) -> torch.dtype:
    """The result dtype of sum/prod: `dtype`, else int64 for bool/integer inputs, else a's."""
    if dtype is not None:
        return dtype
    if a.dtype == torch.bool or not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.int64
    return a.dtype


@torch_op(torch.sum, methods=("sum",))
def sum(input, dim=None, keepdim=False, *, dtype=None):  # noqa: A001
    """`torch.sum`; bool/integer inputs sum in int64, half inputs in float32."""
    _check_dtype_arg("sum", dtype)
    dims = reduction_dims(input, dim, op="sum")
    result = _accumulation_dtype(input, dtype)
    a = to_dtype(to_dtype(input, result), compute_dtype(result))
    return _finish(prims.sum(a, dims), input, dims, keepdim, result)


@torch_op(torch.mean, methods=("mean",))
def mean(input, dim=None, keepdim=False, *, dtype=None):
    """`torch.mean`: the sum divided by the number of reduced elements."""
    _check_dtype_arg("mean", dtype)
    result = dtype if dtype is not None else input.dtype
    if not (result.is_floating_point or result.is_complex):
        raise _unsupported("mean", f"mean of {result} (eager needs a floating or complex dtype)")
    dims = reduction_dims(input, dim, op="mean")
    a = to_dtype(to_dtype(input, result), compute_dtype(result))
    count = math.prod(input.shape[d] for d in dims)
    out = prims.div(prims.sum(a, dims), count)
    return _finish(out, input, dims, keepdim, result)


@torch_op(torch.prod, methods=("prod",))
def prod(input, dim=None, keepdim=False, *, dtype=None):
    """`torch.prod` over every dim or one dim; bool/integer inputs multiply in int64."""
    _check_dtype_arg("prod", dtype)
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise _unsupported("prod", f"dim={dim!r} (prod takes one int dim)")
    if dim is None and keepdim:
        raise _unsupported("prod", "keepdim without dim")
    dims = reduction_dims(input, dim, op="prod")
    result = _accumulation_dtype(input, dtype)
    a = to_dtype(to_dtype(input, result), compute_dtype(result))
    return _finish(prims.prod(a, dims), input, dims, keepdim, result)


# --------------------------------------------------------------------------- amax, amin, max, min


def _extremum(prim, op: str, input, dims, keepdim):
    _check_ordered(op, input)
    _check_not_empty(op, input, dims)
    return _finish(prim(input, dims), input, dims, keepdim, input.dtype)


@torch_op(torch.amax, methods=("amax",))
def amax(input, dim=(), keepdim=False):
    """`torch.amax`: the maximum over `dim` (every dim when empty); NaN propagates."""
    dims = reduction_dims(input, dim, op="amax")
    return _extremum(prims.amax, "amax", input, dims, keepdim)


@torch_op(torch.amin, methods=("amin",))
def amin(input, dim=(), keepdim=False):
    """`torch.amin`: the minimum over `dim` (every dim when empty); NaN propagates."""
    dims = reduction_dims(input, dim, op="amin")
    return _extremum(prims.amin, "amin", input, dims, keepdim)


def _max_or_min(op: str, input, dim, keepdim, other):
    """The three forms of torch.max/min: full reduction, (values, indices) along `dim`, and the
    elementwise binary form."""
    if isinstance(dim, torch.Tensor):
        dim, other = None, dim
    if other is not None:
        if dim is not None or keepdim:
            raise _unsupported(op, "binary form with dim/keepdim")
        prim = prims.maximum if op == "max" else prims.minimum
        return elementwise(prim, input, other)
    reduce, index = (prims.amax, prims.argmax) if op == "max" else (prims.amin, prims.argmin)
    if dim is None:
        if keepdim:
            raise _unsupported(op, "keepdim without dim")
        return _extremum(reduce, op, input, reduction_dims(input, None, op=op), False)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise _unsupported(op, f"dim={dim!r} (named dims)")
    dims = reduction_dims(input, dim, op=op)
    values = _extremum(reduce, op, input, dims, keepdim)
    indices = _arg_extremum(index, op, input, dim, keepdim)
    result_type = torch.return_types.max if op == "max" else torch.return_types.min
    return result_type((values, indices))


@torch_op(torch.max, methods=("max",))
def max(input, dim=None, keepdim=False, *, other=None):  # noqa: A001
    """`torch.max`: `max(x)` -> amax over all dims; `max(x, dim)` -> (values, indices) named
    tuple (amax and argmax); `max(x, y)` -> elementwise maximum."""
    return _max_or_min("max", input, dim, keepdim, other)


@torch_op(torch.min, methods=("min",))
def min(input, dim=None, keepdim=False, *, other=None):  # noqa: A001
    """`torch.min`: like `max`, with amin, argmin and elementwise minimum."""
    return _max_or_min("min", input, dim, keepdim, other)


# --------------------------------------------------------------------------- argmax, argmin


def _arg_extremum(prim, op: str, input, dim, keepdim):
    """Index of the first extremum along `dim` (int64), or into the flattened tensor."""
    _check_ordered(op, input)
    a = input
    if a.dtype == torch.bool:  # argmax/argmin do not take bool; max/min(dim) do
        a = prims.convert_element_type(a, torch.uint8)
    if dim is None:
        if a.numel() == 0:
            raise _unsupported(op, "arg-reduction of an empty tensor (eager raises)")
        flat = prims.reshape(a, (a.numel(),))
        out = prim(flat, 0)
        return prims.reshape(out, (1,) * a.ndim) if keepdim else out
    dims = reduction_dims(a, dim, op=op)
    _check_not_empty(op, a, dims)
    out = prim(a, dims[0] if dims else 0)
    return restore_dims(out, a.shape, dims) if keepdim else out


def _arg_op(prim, op: str, input, dim, keepdim):
    if input.dtype == torch.bool:
        raise _unsupported(op, "bool input (eager raises)")
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise _unsupported(op, f"dim={dim!r}")
    return _arg_extremum(prim, op, input, dim, keepdim)


@torch_op(torch.argmax, methods=("argmax",))
def argmax(input, dim=None, keepdim=False):
    """`torch.argmax`: index (int64) of the first maximum along `dim`, or of the flattened
    tensor when `dim` is None."""
    return _arg_op(prims.argmax, "argmax", input, dim, keepdim)


@torch_op(torch.argmin, methods=("argmin",))
def argmin(input, dim=None, keepdim=False):
    """`torch.argmin`: index (int64) of the first minimum along `dim` (or flattened)."""
    return _arg_op(prims.argmin, "argmin", input, dim, keepdim)


# --------------------------------------------------------------------------- var, std


def _correction(op: str, dim, unbiased, correction):
    """(dim, correction) from the overloads `(x, unbiased)`, `(x, dim, unbiased, keepdim)` and
    `(x, dim, *, correction, keepdim)`."""
    if isinstance(dim, bool):  # var(x, True): the `unbiased` overload
        if unbiased is not None:
            raise _unsupported(op, "unbiased given twice")
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise _unsupported(op, "both unbiased and correction given (eager raises)")
    if correction is None:
        correction = 0 if unbiased is False else 1
    if isinstance(correction, torch.Tensor) or isinstance(correction, complex):
        raise _unsupported(op, f"correction={correction!r}")
    return dim, correction


def _standard_deviation(var):
    """`sqrt(var)` whose gradient is eager's `std_backward`: 0 where the variance is 0 (a constant
    row, one element), where sqrt's infinite derivative times var's zero one would be NaN. The
    inner `where` keeps that infinity out of the backward altogether."""
    constant = prims.eq(var, 0)
    return prims.where(constant, 0.0, prims.sqrt(prims.where(constant, 1.0, var)))


def _variance(op: str, input, dim, unbiased, keepdim, correction, *, sqrt: bool, with_mean: bool):
    dim, correction = _correction(op, dim, unbiased, correction)
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        raise _unsupported(op, f"{input.dtype} input (eager needs floating or complex)")
    dims = reduction_dims(input, dim, op=op)
    a = to_dtype(input, compute_dtype(input.dtype))
    out = prims.var(a, dims, correction)
    if sqrt:
        out = _standard_deviation(out)
    real = input.dtype.to_real() if input.dtype.is_complex else input.dtype
    out = _finish(out, input, dims, keepdim, real)
    if not with_mean:
        return out
    count = math.prod(input.shape[d] for d in dims)
    average = prims.div(prims.sum(a, dims), count)
    return out, _finish(average, input, dims, keepdim, input.dtype)


@torch_op(torch.var, methods=("var",))
def var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.var` over `dim` with `correction` (1, the default, is Bessel's)."""
    return _variance("var", input, dim, unbiased, keepdim, correction, sqrt=False, with_mean=False)


@torch_op(torch.std, methods=("std",))
def std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.std`: the square root of `var`."""
    return _variance("std", input, dim, unbiased, keepdim, correction, sqrt=True, with_mean=False)


@torch_op(torch.var_mean)
def var_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.var_mean`: the tuple `(var, mean)`."""
    return _variance(
        "var_mean", input, dim, unbiased, keepdim, correction, sqrt=False, with_mean=True
    )


@torch_op(torch.std_mean)
def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """`torch.std_mean`: the tuple `(std, mean)`."""
    return _variance(
        "std_mean", input, dim, unbiased, keepdim, correction, sqrt=True, with_mean=True
    )


# --------------------------------------------------------------------------- all, any


def _truth(op: str, input, dim, keepdim):
    if dim is None and keepdim:
        raise _unsupported(op, "keepdim without dim")
    dims = reduction_dims(input, dim, op=op, empty_means_all=False)
    truth = input if input.dtype == torch.bool else prims.ne(input, 0)
    if builtins.any(input.shape[d] == 0 for d in dims):  # all() of nothing: True; any(): False
        out = prims.full(_reduced_shape(input.shape, dims), op == "all", torch.bool, input.device)
    else:
        out = (prims.amin if op == "all" else prims.amax)(truth, dims)
    result = torch.uint8 if input.dtype == torch.uint8 else torch.bool
    return _finish(out, input, dims, keepdim, result)


@torch_op(torch.all, methods=("all",))
def all(input, dim=None, keepdim=False):  # noqa: A001
    """`torch.all`: whether every element is nonzero (uint8 inputs give uint8)."""
    return _truth("all", input, dim, keepdim)


@torch_op(torch.any, methods=("any",))
def any(input, dim=None, keepdim=False):  # noqa: A001
    """`torch.any`: whether some element is nonzero (uint8 inputs give uint8)."""
    return _truth("any", input, dim, keepdim)


# --------------------------------------------------------------------------- logsumexp


@torch_op(torch.logsumexp, torch.special.logsumexp, methods=("logsumexp",))
def logsumexp(input, dim, keepdim=False):
    """`torch.logsumexp`, stable: `log(sum(exp(x - m))) + m` with `m` the (finite) max."""
    dims = reduction_dims(input, dim, op="logsumexp")
    _check_ordered("logsumexp", input)
    _, result = promote(input, kind=Promotion.INT_TO_FLOAT)
    a = to_dtype(input, compute_dtype(result))
    if builtins.any(input.shape[d] == 0 for d in dims):  # the log of an empty sum
        shape = _reduced_shape(input.shape, dims)
        return _finish(
            prims.full(shape, -math.inf, a.dtype, a.device), input, dims, keepdim, result
        )
    top = prims.amax(a, dims)
    top = prims.where(prims.isinf(top), 0.0, top)  # keep inf - inf out of the exponent
    shifted = prims.sub(a, expand_reduced(top, a.shape, dims))
    out = prims.add(prims.log(prims.sum(prims.exp(shifted), dims)), top)
    return _finish(out, input, dims, keepdim, result)
