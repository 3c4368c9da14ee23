"""Indexing and masking ops: masked_fill, tril/triu, gather, index_select, scatter_add, roll,
constant-mode F.pad and F.one_hot.

Gathers and scatters map to the `take_along_dim`, `index_select` and `scatter_add` prims (whose
torch implementations check index ranges at run time, as eager does). `torch.scatter` (an
overwriting scatter, nondeterministic with repeated indices) has no prim and stays opaque.
`F.one_hot` needs `num_classes`: without it the output shape depends on the values and tracing
raises a `FulmenError`.
"""

from __future__ import annotations

from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.utils import broadcast_shapes, canonical_dim, to_dtype

T = torch.Tensor
_INDEX_DTYPES = (torch.int64, torch.int32)


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_symbolic(value) -> bool:
    """An int, or an int argument traced as a `torch.SymInt`."""
    return _int(value) or isinstance(value, torch.SymInt)


def _slice_along(a, dim: int, start: int, end: int):
    starts = tuple(start if d == dim else 0 for d in range(a.ndim))
    ends = tuple(end if d == dim else size for d, size in enumerate(a.shape))
    return prims.slice_prim(a, starts, ends, (1,) * a.ndim)


# --------------------------------------------------------------------------- masked_fill


@torch_op(torch.masked_fill, methods=("masked_fill",))
def masked_fill(input, mask, value):
    """`torch.masked_fill`: `value` where the bool `mask` (broadcast to `input`) is true.

    `value` is a number or a 0-d tensor; it is converted to `input`'s dtype.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise _unsupported("masked_fill", "mask must be a bool tensor (eager raises otherwise)")
    shape = tuple(input.shape)
    if broadcast_shapes(shape, mask.shape) != shape:
        raise _unsupported("masked_fill", "mask does not broadcast to the input (eager raises)")
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise _unsupported("masked_fill", "value tensor must be 0-d (eager raises)")
        if value.dtype.is_floating_point and not input.dtype.is_floating_point:
            raise _unsupported("masked_fill", "floating value into a non-floating input")
        fill = prims.broadcast_in_dim(to_dtype(value, input.dtype), shape, ())
    elif isinstance(value, Number):
        if isinstance(value, complex) and not input.dtype.is_complex:
            raise _unsupported("masked_fill", "complex value into a real input (eager raises)")
        if isinstance(value, float) and not (input.dtype.is_floating_point
                                             or input.dtype.is_complex):
            raise _unsupported("masked_fill", "float value into an integer input")
        fill = prims.full(shape, to_dtype(value, input.dtype), input.dtype, input.device)
    else:
        raise _unsupported("masked_fill", f"value={value!r}")
    if tuple(mask.shape) != shape:
        offset = len(shape) - mask.ndim
        mask = prims.broadcast_in_dim(mask, shape, tuple(range(offset, len(shape))))
    return prims.where(mask, fill, input)


# --------------------------------------------------------------------------- tril, triu


def _triangle(op: str, input, diagonal, *, lower: bool):
    if input.ndim < 2:
        raise _unsupported(op, "needs a tensor of rank >= 2 (eager raises)")
    if not _int(diagonal):
        raise _unsupported(op, f"diagonal={diagonal!r}")
    rows, cols = input.shape[-2], input.shape[-1]
    row = prims.broadcast_in_dim(prims.iota(rows, 0, 1, torch.int64, input.device),
                                 (rows, cols), (0,))
    col = prims.broadcast_in_dim(prims.iota(cols, 0, 1, torch.int64, input.device),
                                 (rows, cols), (1,))
    offset = prims.sub(col, row)
    keep = prims.le(offset, diagonal) if lower else prims.ge(offset, diagonal)
    shape = tuple(input.shape)
    keep = prims.broadcast_in_dim(keep, shape, (len(shape) - 2, len(shape) - 1))
    zeros = prims.full(shape, False if input.dtype == torch.bool else 0, input.dtype,
                       input.device)
    return prims.where(keep, input, zeros)


@torch_op(torch.tril, methods=("tril",))
def tril(input, diagonal=0):
    """`torch.tril`: zero the elements above the `diagonal`-th diagonal of the last two dims."""
    return _triangle("tril", input, diagonal, lower=True)


@torch_op(torch.triu, methods=("triu",))
def triu(input, diagonal=0):
    """`torch.triu`: zero the elements below the `diagonal`-th diagonal of the last two dims."""
    return _triangle("triu", input, diagonal, lower=False)


# --------------------------------------------------------------------------- gather, scatter


def _check_index(op: str, index) -> None:
    if not isinstance(index, torch.Tensor) or index.dtype not in _INDEX_DTYPES:
        raise _unsupported(op, "index must be an int64/int32 tensor")


@torch_op(torch.gather, methods=("gather",))
def gather(input, dim, index, *, sparse_grad=False):
    """`torch.gather`: `out[i][j] = input[index[i][j]][j]` for dim 0, and so on."""
    _check_index("gather", index)
    if sparse_grad or not _int(dim) or index.dtype != torch.int64:
        raise _unsupported("gather", "sparse_grad, a non-int dim or int32 index")
    if index.ndim != input.ndim and not (index.ndim <= 1 and input.ndim <= 1):
        raise _unsupported("gather", "index and input ranks differ (eager raises)")
    dim = canonical_dim(dim, input.ndim, op="ltorch.gather")
    for d in range(index.ndim):
        if d != dim and index.shape[d] > input.shape[d]:
            raise _unsupported("gather", "index is larger than input (eager raises)")
    return prims.take_along_dim(input, index, dim)


@torch_op(torch.index_select, methods=("index_select",))
def index_select(input, dim, index):
    """`torch.index_select`: slices of `input` along `dim` at the (0-d or 1-d) `index`."""
    _check_index("index_select", index)
    if not _int(dim) or index.ndim > 1:
        raise _unsupported("index_select", "needs an int dim and a 0-d or 1-d index")
    dim = canonical_dim(dim, input.ndim, op="ltorch.index_select")
    return prims.index_select(input, dim, index)


@torch_op(torch.scatter_add, methods=("scatter_add",))
def scatter_add(input, dim, index, src):
    """`torch.scatter_add`: a copy of `input` with `src[i][j]` added at `index[i][j]` along
    `dim`. Only the leading `index.shape` block of `src` is used, as in eager."""
    _check_index("scatter_add", index)
    if not _int(dim) or not isinstance(src, torch.Tensor) or index.dtype != torch.int64:
        raise _unsupported("scatter_add", "needs an int dim, an int64 index and a src tensor")
    if src.dtype != input.dtype or index.ndim != input.ndim or src.ndim != input.ndim:
        raise _unsupported("scatter_add", "dtypes or ranks differ (eager raises)")
    dim = canonical_dim(dim, input.ndim, op="ltorch.scatter_add")
    for d in range(index.ndim):
        if index.shape[d] > src.shape[d] or (d != dim and index.shape[d] > input.shape[d]):
            raise _unsupported("scatter_add", "index is larger than src or input (eager raises)")
    if index.numel() == 0:
        return prims.add(input, 0) if input.ndim else input
    if tuple(src.shape) != tuple(index.shape):
        src = prims.slice_prim(src, (0,) * src.ndim, tuple(index.shape), (1,) * src.ndim)
    return prims.scatter_add(input, dim, index, src)


# --------------------------------------------------------------------------- roll


def _roll_one(a, shift: int, dim: int):
    size = a.shape[dim]
    if size == 0:
        return a
    shift %= size
    if shift == 0:
        return a
    tail = _slice_along(a, dim, size - shift, size)
    head = _slice_along(a, dim, 0, size - shift)
    return prims.cat((tail, head), dim)


@torch_op(torch.roll, methods=("roll",))
def roll(input, shifts, dims=None):
    """`torch.roll`: elements shifted along `dims` (wrapping around); without `dims` the
    flattened tensor is rolled and the shape restored."""
    if isinstance(shifts, torch.Tensor) or isinstance(dims, torch.Tensor):
        raise _unsupported("roll", "shifts or dims given as a tensor")
    shifts = (shifts,) if _int_or_symbolic(shifts) else tuple(shifts)
    if dims is None or (not _int_or_symbolic(dims) and len(dims) == 0):
        if len(shifts) != 1:
            raise _unsupported("roll", "several shifts need dims (eager raises)")
        flat = prims.reshape(input, (input.numel(),))
        return prims.reshape(_roll_one(flat, shifts[0], 0), tuple(input.shape))
    dims = (dims,) if _int_or_symbolic(dims) else tuple(dims)
    if len(dims) != len(shifts) or not all(map(_int_or_symbolic, shifts + dims)):
        raise _unsupported("roll", "shifts and dims must be ints of the same count")
    out = input
    for shift, dim in zip(shifts, dims):
        out = _roll_one(out, shift, canonical_dim(dim, input.ndim, op="ltorch.roll"))
    if out is input:
        return prims.reshape(input, tuple(input.shape))  # eager returns a new tensor
    return out


# --------------------------------------------------------------------------- pad


@torch_op(F.pad)
def pad(input, pad, mode="constant", value=None):
    """`F.pad` in constant mode: `pad = (left_last, right_last, left_prev, right_prev, ...)`
    elements of `value` (0 by default) around the trailing dims; negative amounts crop.
    Other modes (reflect, replicate, circular) are not decomposed."""
    if mode != "constant":
        raise _unsupported("pad", f"mode={mode!r} (only constant is decomposed)")
    # a symbolic size as an amount (`F.pad(x, (0, window - n))`) is one too
    if not isinstance(pad, (tuple, list, torch.Size)) or not all(
            map(_int_or_symbolic, pad)):
        raise _unsupported("pad", f"pad={pad!r} (a sequence of ints is supported)")
    if len(pad) % 2 or len(pad) // 2 > input.ndim:
        raise _unsupported("pad", "pad length is odd or longer than 2 * rank (eager raises)")
    value = 0 if value is None else value
    if not isinstance(value, Number) or isinstance(value, complex):
        raise _unsupported("pad", f"value={value!r}")
    if isinstance(value, float) and not input.dtype.is_floating_point and value != int(value):
        raise _unsupported("pad", "a fractional value for an integer input")
    config = [(0, 0, 0)] * input.ndim
    for index in range(len(pad) // 2):
        config[input.ndim - 1 - index] = (pad[2 * index], pad[2 * index + 1], 0)
    for size, (low, high, _) in zip(input.shape, config):
        if size + low + high < 0:
            raise _unsupported("pad", "padding makes a negative size (eager raises)")
    if all(low == high == 0 for low, high, _ in config):
        return prims.reshape(input, tuple(input.shape))  # eager returns a new tensor
    return prims.pad(input, to_dtype(value, input.dtype), tuple(config))


# --------------------------------------------------------------------------- one_hot


@torch_op(F.one_hot)
def one_hot(tensor, num_classes=-1):
    """`F.one_hot`: int64 indicators of shape `tensor.shape + (num_classes,)`.

    `num_classes=-1` (one more than the largest value) depends on the values, so it raises
    while tracing: pass `num_classes`. Values outside [0, num_classes) give all-zero rows
    here, where eager raises.
    """
    if tensor.dtype != torch.int64:
        raise _unsupported("one_hot", "needs an int64 tensor (eager raises otherwise)")
    if not _int(num_classes) or num_classes < -1:
        raise _unsupported("one_hot", f"num_classes={num_classes!r}")
    if num_classes == -1:
        raise FulmenError(
            "num_classes=-1 makes the output shape depend on the values of the tensor",
            op="torch.nn.functional.one_hot", argument="num_classes",
            hint="pass num_classes explicitly",
        )
    shape = (*tensor.shape, num_classes)
    classes = prims.broadcast_in_dim(
        prims.iota(num_classes, 0, 1, torch.int64, tensor.device), shape, (len(shape) - 1,))
    values = prims.broadcast_in_dim(tensor, shape, tuple(range(tensor.ndim)))
    return prims.convert_element_type(prims.eq(values, classes), torch.int64)
