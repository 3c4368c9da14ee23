"""Torch-level joins (`cat`, `stack`), splits (`split`, `chunk`, `tensor_split`, `unbind`),
selection (`narrow`, `select`) and basic indexing (`x[1:, None, ...]`), decomposed into the
shape prims with the helpers of `shape` (argument forms and aliasing as described there).
"""

from __future__ import annotations

import torch

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.shape import (
    VIEW,
    _ints,
    _tensors_arg,
    alias,
    as_int,
    cat_tensors,
    check_not_scalar,
    clamp_slice,
    select_index,
    slice_dim,
    split_sizes,
    unsqueeze_at,
    wrap_dim,
)

T = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Joins
# ---------------------------------------------------------------------------------------------


@torch_op(torch.cat, torch.concat, name="cat")
def cat(tensors, dim=0):
    return cat_tensors(tensors, dim)


@torch_op(torch.concatenate, name="concatenate")
def concatenate_op(tensors, axis=0):
    return cat_tensors(tensors, axis, "concatenate")


@torch_op(torch.stack)
def stack(tensors, dim=0):
    tensors = _tensors_arg(tensors, "stack")
    first = tensors[0]
    if any(t.shape != first.shape for t in tensors):
        raise FulmenError("stack expects each tensor to be equal size", op="stack")
    dim = wrap_dim(dim, first.ndim + 1, "stack")
    return cat_tensors([unsqueeze_at(t, dim) for t in tensors], dim, "stack")


# ---------------------------------------------------------------------------------------------
# Splits and selection
# ---------------------------------------------------------------------------------------------


@torch_op(torch.split, T.split, tags=VIEW)
def split(tensor, split_size_or_sections, dim=0):
    check_not_scalar(tensor, "split")
    dim = wrap_dim(dim, tensor.ndim, "split")
    length = tensor.shape[dim]
    if isinstance(split_size_or_sections, (list, tuple)):
        return split_with_sizes_of(tensor, split_size_or_sections, dim, "split")
    size = as_int(split_size_or_sections, "split")
    if size < 0 or (size == 0 and length != 0):
        raise FulmenError(f"split_size can only be 0 if dimension size is 0, but got "
                          f"{size}", op="split")
    if size == 0:
        return (slice_dim(tensor, dim, 0, 0),)
    count = max(-(-length // size), 1)
    return split_sizes(tensor, dim, [min(size, length - i * size) for i in range(count)])


def split_with_sizes_of(a: T, sizes, dim: int, op: str) -> tuple[T, ...]:
    sizes = _ints(sizes, op)
    if any(s < 0 for s in sizes) or sum(sizes) != a.shape[dim]:
        raise FulmenError(f"split_with_sizes expects split_sizes to sum exactly to "
                          f"{a.shape[dim]} (input tensor's size at dimension {dim}), but got "
                          f"split_sizes={list(sizes)}", op=op)
    return split_sizes(a, dim, sizes)


@torch_op(torch.split_with_sizes, methods=("split_with_sizes",), tags=VIEW)
def split_with_sizes(input, split_sizes, dim=0):
    check_not_scalar(input, "split_with_sizes")
    dim = wrap_dim(dim, input.ndim, "split_with_sizes")
    return split_with_sizes_of(input, split_sizes, dim, "split_with_sizes")


@torch_op(torch.chunk, methods=("chunk",), tags=VIEW)
def chunk(input, chunks, dim=0):
    check_not_scalar(input, "chunk")
    chunks = as_int(chunks, "chunk")
    if chunks <= 0:
        raise FulmenError(f"chunk expects `chunks` to be greater than 0, got: {chunks}", op="chunk")
    dim = wrap_dim(dim, input.ndim, "chunk")
    length = input.shape[dim]
    size = -(-length // chunks)
    if size == 0:  # an empty dimension: `chunks` empty pieces
        return split_sizes(input, dim, [0] * chunks)
    count = -(-length // size)
    return split_sizes(input, dim, [min(size, length - i * size) for i in range(count)])


@torch_op(torch.tensor_split, methods=("tensor_split",), tags=VIEW)
def tensor_split(input, indices_or_sections, dim=0):
    check_not_scalar(input, "tensor_split")
    dim = wrap_dim(dim, input.ndim, "tensor_split")
    length = input.shape[dim]
    if isinstance(indices_or_sections, (list, tuple)):
        bounds = [0, *_ints(indices_or_sections, "tensor_split"), length]
        pieces = []
        for start, end in zip(bounds, bounds[1:]):
            start, end = clamp_slice(start, end, length)
            pieces.append(slice_dim(input, dim, start, end))
        return tuple(pieces)
    sections = as_int(indices_or_sections, "tensor_split")
    if sections <= 0:
        raise FulmenError(f"number of sections must be larger than 0, got {sections}",
                          op="tensor_split")
    small, extra = length // sections, length % sections  # (divmod refuses symbolic sizes)
    return split_sizes(input, dim, [small + 1 if i < extra else small for i in range(sections)])


@torch_op(torch.unbind, methods=("unbind",), tags=VIEW)
def unbind(input, dim=0):
    if input.ndim == 0:
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    dim = wrap_dim(dim, input.ndim, "unbind")
    return tuple(select_index(input, dim, i, "unbind") for i in range(input.shape[dim]))


@torch_op(torch.narrow, methods=("narrow",), tags=VIEW)
def narrow(input, dim, start, length):
    check_not_scalar(input, "narrow")
    dim = wrap_dim(dim, input.ndim, "narrow")
    start, length = as_int(start, "narrow"), as_int(length, "narrow")
    size = input.shape[dim]
    if not -size <= start <= size:
        raise IndexError(f"start out of range (expected to be in range of [{-size}, {size}], "
                         f"but got {start})")
    start = start + size if start < 0 else start
    if length < 0 or start + length > size:
        raise FulmenError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).",
                          op="narrow")
    return slice_dim(input, dim, start, start + length)


@torch_op(torch.select, methods=("select",), tags=VIEW)
def select(input, dim, index):
    if input.ndim == 0:
        raise IndexError("select() cannot be applied to a 0-dim tensor.")
    dim = wrap_dim(dim, input.ndim, "select")
    return select_index(input, dim, as_int(index, "select"))


# ---------------------------------------------------------------------------------------------
# Basic indexing
# ---------------------------------------------------------------------------------------------


def _index_items(index) -> tuple:
    """The items of a basic index, or `NotYetSupportedError` for advanced indexing."""
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for item in items:
        if item is None or item is Ellipsis:
            out.append(item)
        elif isinstance(item, slice):
            bounds = [item.start, item.stop, item.step]
            out.append(slice(*(None if b is None else as_int(b, "getitem") for b in bounds)))
        elif isinstance(item, (torch.Tensor, bool, list, tuple)):
            raise NotYetSupportedError("advanced (tensor, list or bool) indexing", op="getitem")
        else:
            out.append(as_int(item, "getitem"))
    return tuple(out)


@torch_op(T.__getitem__, name="getitem", tags=VIEW)
def getitem(self, index):
    """`self[index]` for ints, slices, None and Ellipsis; other indices run as the torch op."""
    items = _index_items(index)
    if sum(item is Ellipsis for item in items) > 1:  # torch has its own rule for this
        raise NotYetSupportedError("more than one ellipsis", op="getitem")
    consumed = sum(isinstance(item, (int, slice)) for item in items)
    if consumed > self.ndim:
        raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
    starts, ends, steps = [0] * self.ndim, list(self.shape), [1] * self.ndim
    removed: list[int] = []
    layout: list[int | None] = []  # output dims: an input dim, or None for a new size-1 dim
    dim = 0
    for item in items:
        if item is None:
            layout.append(None)
        elif item is Ellipsis:
            for _ in range(self.ndim - consumed):
                layout.append(dim)
                dim += 1
        elif isinstance(item, int):
            size = self.shape[dim]
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of bounds for dimension {dim} with size "
                                 f"{size}")
            starts[dim] = item % size
            ends[dim] = starts[dim] + 1
            removed.append(dim)
            dim += 1
        else:
            step = 1 if item.step is None else item.step
            if step <= 0:
                raise ValueError("slice step cannot be zero" if step == 0
                                 else "step must be greater than zero")
            starts[dim], ends[dim] = clamp_slice(item.start, item.stop, self.shape[dim])
            steps[dim] = step
            layout.append(dim)
            dim += 1
    layout.extend(range(dim, self.ndim))

    out = self
    if starts != [0] * self.ndim or ends != list(self.shape) or steps != [1] * self.ndim:
        out = prims.slice_prim(out, tuple(starts), tuple(ends), tuple(steps))
    sizes = [(end - start + step - 1) // step for start, end, step in zip(starts, ends, steps)]
    if removed:
        out = prims.squeeze(out, tuple(removed))
    shape = tuple(1 if d is None else sizes[d] for d in layout)
    if tuple(out.shape) != shape:
        out = prims.reshape(out, shape)
    return alias(out) if out is self else out
