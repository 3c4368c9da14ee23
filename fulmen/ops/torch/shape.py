"""Shape torch-level ops: views and reshapes, and the helpers `joins` and `permutations`
share (joins, splits, selection and basic indexing live in `joins`; permutations, flips and
repeats in `permutations`).

Every op here decomposes into the shape prims (`reshape`, `broadcast_in_dim`, `permute`,
`slice`, `squeeze`, `cat`, `flip`). Output shapes and values match eager; aliasing does not
carry over (a traced view is a new value), except where eager returns the very same tensor
object (`flatten` over a single dim, `contiguous` on a contiguous tensor): there the input
proxy itself is returned, so nothing is recorded.

Argument forms follow the canonical callable of each op: ops whose method takes sizes as
varargs (`x.view(2, 3)`, `x.permute(1, 0)`) are declared on the `torch.Tensor` method, and the
`torch.*` function spelling (`torch.reshape(x, (2, 3))`) is an alias, since the method accepts
both forms. A call the decomposition does not understand (an unknown keyword such as numpy's
`axis=`, a tensor used as a size or an index) raises `NotYetSupportedError`, and the tracer
records the exact torch op instead.

NOTE [identity views]: a view that changes nothing (`x.reshape(x.shape)`, `x[...]`) is still
recorded, as `prims.reshape` to the same shape, because eager returns a new tensor object there.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.core.symbol import Tag
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.utils import Promotion, canonical_dim, promote, to_dtype
from fulmen.proxies.tensor import row_major

T = torch.Tensor
VIEW = (Tag.VIEW,)  # ops whose outputs torch returns as views of the input (`Tag.VIEW`)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def as_int(value, op: str) -> int:
    """`value` as a Python int (a symbolic size stays a `torch.SymInt`); tensors
    (value-dependent sizes) are not supported here."""
    if isinstance(value, torch.Tensor) or isinstance(value, bool):
        raise NotYetSupportedError(f"{type(value).__name__} used as an integer", op=op)
    if isinstance(value, torch.SymInt):
        return value
    try:
        return operator.index(value)
    except TypeError:
        raise NotYetSupportedError(f"{value!r} is not an integer", op=op) from None


def _ints(values, op: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        raise NotYetSupportedError("a tensor of sizes or dims", op=op)
    return tuple(as_int(value, op) for value in values)


def _varargs(args: tuple, kwargs: dict, keyword: str, op: str) -> tuple[int, ...]:
    """Sizes or dims given as varargs (`x.view(2, 3)`), one sequence (`x.view((2, 3))`,
    `torch.Size`) or a keyword (`x.view(size=(2, 3))`)."""
    extra = set(kwargs) - {keyword}
    if extra:
        raise NotYetSupportedError(f"unsupported keyword arguments {sorted(extra)}", op=op)
    if keyword in kwargs:
        if args:
            raise NotYetSupportedError(f"{keyword} given both positionally and by keyword", op=op)
        args = (kwargs[keyword],)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return _ints(args[0], op)
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        raise NotYetSupportedError("a tensor of sizes or dims", op=op)
    return _ints(args, op)


def wrap_dim(dim, rank: int, op: str) -> int:
    """A possibly negative dim wrapped into [0, rank); rank 0 accepts -1 and 0, like eager."""
    return canonical_dim(as_int(dim, op), rank, op=op)


def wrap_dims(dims, rank: int, op: str, *, unique: bool = True) -> tuple[int, ...]:
    """Wrapped dims in the given order; a repeated dim is an error, as in eager."""
    if isinstance(dims, torch.Tensor):
        raise NotYetSupportedError("dims given as a tensor", op=op)
    if not isinstance(dims, (tuple, list, torch.Size)):
        dims = (dims,)
    wrapped = tuple(wrap_dim(dim, rank, op) for dim in dims)
    if unique and len(set(wrapped)) != len(wrapped):
        raise FulmenError(f"dims {tuple(dims)} repeat a dimension", op=op)
    return wrapped


def check_not_scalar(a: T, op: str) -> None:
    """Ops that work along a dimension refuse 0-d tensors, as in eager."""
    if a.ndim == 0:
        raise FulmenError(f"{op}() cannot be applied to a 0-dim tensor.", op=op)


def infer_shape(shape: Sequence[int], numel: int, op: str) -> tuple[int, ...]:
    """Replace one -1 in `shape` by the size that makes it hold `numel` elements."""
    shape = list(shape)
    unknown = [i for i, size in enumerate(shape) if size == -1]
    if len(unknown) > 1:
        raise FulmenError("only one dimension can be inferred", op=op)
    if any(size < -1 for size in shape):
        raise FulmenError(f"invalid shape dimension in {tuple(shape)}", op=op)
    if unknown:
        known = math.prod(size for size in shape if size != -1)
        if known == 0 or numel % known:
            raise FulmenError(f"shape '{list(shape)}' is invalid for input of size {numel}", op=op)
        shape[unknown[0]] = numel // known
    if math.prod(shape) != numel:
        raise FulmenError(f"shape '{list(shape)}' is invalid for input of size {numel}", op=op)
    return tuple(shape)


def alias(a: T) -> T:
    """A new value equal to `a` (see NOTE [identity views])."""
    return prims.reshape(a, tuple(a.shape))


def reshape_to(a: T, shape: Sequence[int], op: str = "reshape") -> T:
    """`a` reshaped to `shape` (one -1 allowed)."""
    return prims.reshape(a, infer_shape(shape, a.numel(), op))


def permute_to(a: T, dims: Sequence[int]) -> T:
    """`a` with output dim i taken from input dim `dims[i]` (dims already wrapped)."""
    if a.ndim == 0:
        return alias(a)
    return prims.permute(a, tuple(dims))


def transpose_dims(a: T, dim0, dim1, op: str = "transpose") -> T:
    """`a` with two dimensions swapped."""
    dim0, dim1 = wrap_dim(dim0, a.ndim, op), wrap_dim(dim1, a.ndim, op)
    dims = list(range(a.ndim))
    if a.ndim:
        dims[dim0], dims[dim1] = dims[dim1], dims[dim0]
    return permute_to(a, dims)


def unsqueeze_at(a: T, dim: int) -> T:
    """`a` with a size-1 dimension inserted at wrapped position `dim`."""
    shape = list(a.shape)
    shape.insert(dim, 1)
    return prims.reshape(a, tuple(shape))


def expand_to(a: T, sizes: Sequence[int], op: str = "expand") -> T:
    """Broadcast `a` to `sizes`, where -1 keeps an existing dimension's size."""
    offset = len(sizes) - a.ndim
    if offset < 0:
        raise FulmenError(f"the number of sizes provided ({len(sizes)}) must be greater or equal "
                          f"to the number of dimensions in the tensor ({a.ndim})", op=op)
    shape = []
    for i, size in enumerate(sizes):
        if size == -1:
            if i < offset:
                raise FulmenError("-1 is not allowed in a leading, non-existing dimension", op=op)
            size = a.shape[i - offset]
        elif size < 0:
            raise FulmenError(f"invalid size {size}", op=op)
        elif i >= offset and a.shape[i - offset] not in (1, size):
            raise FulmenError(f"the expanded size of the tensor ({size}) must match the existing "
                              f"size ({a.shape[i - offset]}) at dimension {i}", op=op)
        shape.append(size)
    return prims.broadcast_in_dim(a, tuple(shape), tuple(range(offset, len(shape))))


def clamp_slice(start, end, size: int) -> tuple[int, int]:
    """`start:end` of a dimension of `size`, wrapped and clamped like `Tensor.slice`."""
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


def slice_dim(a: T, dim: int, start: int, end: int, step: int = 1) -> T:
    """`a` sliced along one (wrapped) dim with 0 <= start <= end <= size."""
    starts, ends, steps = [0] * a.ndim, list(a.shape), [1] * a.ndim
    starts[dim], ends[dim], steps[dim] = start, end, step
    return prims.slice_prim(a, tuple(starts), tuple(ends), tuple(steps))


def select_index(a: T, dim: int, index: int, op: str = "select") -> T:
    """`a` indexed at `index` along wrapped `dim` (that dimension is removed)."""
    size = a.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"{op}(): index {index} out of range for tensor of size "
                         f"{list(a.shape)} at dimension {dim}")
    index %= size
    return prims.squeeze(slice_dim(a, dim, index, index + 1), (dim,))


def split_sizes(a: T, dim: int, sizes: Sequence[int]) -> tuple[T, ...]:
    """Consecutive pieces of `a` along wrapped `dim`, of the given sizes."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(slice_dim(a, dim, start, start + size))
        start += size
    return tuple(pieces)


def _tensors_arg(tensors, op: str) -> list[T]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (tuple, list)):
        raise NotYetSupportedError("expects a sequence of tensors", op=op)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise NotYetSupportedError("expects a sequence of tensors", op=op)
    if not tensors:
        raise FulmenError("expected a non-empty list of tensors", op=op)
    return list(tensors)


def cat_tensors(tensors, dim, op: str = "cat") -> T:
    """`torch.cat` semantics: dtypes promote; 1-D empty tensors are skipped (legacy rule)."""
    tensors = _tensors_arg(tensors, op)
    if any(t.device != tensors[0].device for t in tensors):
        raise NotYetSupportedError("tensors on different devices", op=op)
    _, dtype = promote(*tensors, kind=Promotion.NO_OPMATH)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:  # only legacy 1-D empty tensors: dim is not checked
        return prims.cat([to_dtype(t, dtype) for t in tensors], 0)
    rank = kept[0].ndim
    if rank == 0:
        raise FulmenError("zero-dimensional tensor cannot be concatenated", op=op)
    dim = wrap_dim(dim, rank, op)
    for t in kept:
        if t.ndim != rank or any(d != dim and x != y for d, (x, y) in
                                 enumerate(zip(t.shape, kept[0].shape))):
            raise FulmenError(f"sizes of tensors must match except in dimension {dim}", op=op)
    return prims.cat([to_dtype(t, dtype) for t in kept], dim)


# ---------------------------------------------------------------------------------------------
# Views and reshapes
# ---------------------------------------------------------------------------------------------


@torch_op(T.view, tags=VIEW)
def view(self, *shape, **kwargs):
    if "dtype" in kwargs or any(isinstance(s, torch.dtype) for s in shape):
        raise NotYetSupportedError("view(dtype) reinterprets bits", op="view")
    return reshape_to(self, _varargs(shape, kwargs, "size", "view"), "view")


@torch_op(T.reshape, torch.reshape)
def reshape(self, *shape, **kwargs):
    return reshape_to(self, _varargs(shape, kwargs, "shape", "reshape"))


@torch_op(T.view_as, tags=VIEW)
def view_as(self, other):
    return reshape_to(self, tuple(other.shape), "view_as")


@torch_op(T.reshape_as)
def reshape_as(self, other):
    return reshape_to(self, tuple(other.shape), "reshape_as")


@torch_op(torch.flatten, methods=("flatten",))
def flatten(input, start_dim=0, end_dim=-1):
    start = wrap_dim(start_dim, input.ndim, "flatten")
    end = wrap_dim(end_dim, input.ndim, "flatten")
    if input.ndim == 0:
        return prims.reshape(input, (1,))
    if start > end:
        raise FulmenError("flatten() has invalid args: start_dim cannot come after end_dim",
                          op="flatten")
    if start == end:
        return input  # eager returns the input itself
    shape = input.shape
    new_shape = (*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:])
    return prims.reshape(input, new_shape)


@torch_op(torch.unflatten, methods=("unflatten",), tags=VIEW)
def unflatten(input, dim, sizes):
    dim = wrap_dim(dim, input.ndim, "unflatten")
    check_not_scalar(input, "unflatten")
    sizes = _ints(sizes, "unflatten")
    if not sizes:
        raise FulmenError("sizes must be non-empty", op="unflatten")
    sizes = infer_shape(sizes, input.shape[dim], "unflatten")
    return prims.reshape(input, (*input.shape[:dim], *sizes, *input.shape[dim + 1:]))


@torch_op(torch.squeeze, methods=("squeeze",), tags=VIEW)
def squeeze(input, dim=None):
    if dim is None:
        dims = tuple(d for d, size in enumerate(input.shape) if size == 1)
    else:
        dims = wrap_dims(dim, input.ndim, "squeeze")
        dims = tuple(sorted(d for d in dims if input.ndim and input.shape[d] == 1))
    return prims.squeeze(input, dims)


@torch_op(torch.unsqueeze, methods=("unsqueeze",), tags=VIEW)
def unsqueeze(input, dim):
    return unsqueeze_at(input, wrap_dim(dim, input.ndim + 1, "unsqueeze"))


@torch_op(T.expand, tags=VIEW)
def expand(self, *sizes, implicit=False, **kwargs):
    return expand_to(self, _varargs(sizes, kwargs, "size", "expand"))


@torch_op(T.expand_as, tags=VIEW)
def expand_as(self, other):
    return expand_to(self, tuple(other.shape), "expand_as")


@torch_op(T.broadcast_to, torch.broadcast_to, tags=VIEW)
def broadcast_to(self, *size, **kwargs):
    return expand_to(self, _varargs(size, kwargs, "size", "broadcast_to"), "broadcast_to")


@torch_op(T.contiguous)
def contiguous(self, memory_format=torch.contiguous_format):
    """Eager returns the input itself when it is contiguous, else a row-major copy; the copy
    (and a layout known only at run time: NOTE [contiguous of a batch of 1]) is the opaque
    op, which runs eager's `Tensor.contiguous`."""
    if memory_format is not torch.contiguous_format or row_major(self) is not True:
        raise NotYetSupportedError("a copy into a new layout", op="contiguous")
    return self  # eager returns the input itself
