"""Shape prims: broadcast, reshape, permute, slice, pad, cat, flip, and gather-style indexing.

Semantics follow XLA/Thunder: `broadcast_in_dim` maps input dims to output dims explicitly;
`slice` takes per-dimension start, end and step; `pad` takes (low, high, interior) per dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Number

import torch

from fulmen.core.symbol import Tag
from fulmen.ops.meta import run_meta
from fulmen.ops.prims.base import canonical_dims, check, prim
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape, strides_of

__all__ = [
    "broadcast_in_dim", "reshape", "permute", "slice_prim", "pad", "cat", "flip",
    "index_select", "take_along_dim", "scatter_add", "index_put", "squeeze",
]  # fmt: skip


@prim("broadcast_in_dim", tags=[Tag.SHAPE, Tag.VIEW])
def broadcast_in_dim(a: TensorProxy, shape: Sequence[int], broadcast_dims: Sequence[int]) -> TensorProxy:
    """Broadcast `a` to `shape`; input dim i becomes output dim `broadcast_dims[i]` and must have
    size 1 or the output's size there."""
    shape, dims = tuple(shape), tuple(broadcast_dims)
    check(len(dims) == len(a.shape), "broadcast_in_dim", f"{len(dims)} dims given for rank {len(a.shape)}")
    check(list(dims) == sorted(dims), "broadcast_in_dim", f"broadcast_dims {dims} must increase")
    for size, dim in zip(a.shape, dims):
        check(0 <= dim < len(shape), "broadcast_in_dim", f"dim {dim} out of range")
        # known-equal sizes first: `size in (1, n)` asks `s0 == 1` (a guard) about a size
        # that is the output's own
        check(known_same_shape((size,), (shape[dim],)) or size == 1 or size == shape[dim],
              "broadcast_in_dim", f"cannot broadcast {tuple(a.shape)} to {shape}")
    return TensorProxy.like(a, shape=shape)


@prim("reshape", tags=["shape"])
def reshape(a: TensorProxy, shape: Sequence[int]) -> TensorProxy:
    """`a` with a new shape of the same number of elements (no -1 here)."""
    shape = tuple(shape)
    check(all(size >= 0 for size in shape), "reshape", lambda: f"invalid shape {shape}")
    check(math.prod(shape) == a.numel(), "reshape",
          lambda: f"cannot reshape {tuple(a.shape)} to {shape}")
    return TensorProxy.like(a, shape=shape)


@prim("squeeze", tags=[Tag.SHAPE, Tag.VIEW])
def squeeze(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Remove the given size-1 dimensions."""
    dims = canonical_dims("squeeze", dims, a.ndim)
    check(all(a.shape[d] == 1 for d in dims), "squeeze",
          lambda: f"dims {dims} are not all of size 1")
    return TensorProxy.like(a, shape=[s for d, s in enumerate(a.shape) if d not in dims])


@prim("permute", tags=[Tag.SHAPE, Tag.VIEW])
def permute(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Reorder dimensions: output dim i is input dim `dims[i]`.

    The output reports eager's (permuted) strides, so `x.transpose(1, 2).is_contiguous()` is
    False and the user's `.contiguous()` before a `.view` is a real copy, as in eager."""
    dims = canonical_dims("permute", dims, len(a.shape))
    check(len(dims) == len(a.shape), "permute", f"permutation {dims} for rank {len(a.shape)}")
    return TensorProxy(None, [a.shape[d] for d in dims], a.dtype, a.device,
                       strides=[strides_of(a)[d] for d in dims])


@prim("slice", tags=[Tag.SHAPE, Tag.VIEW])
def slice_prim(a: TensorProxy, starts: Sequence[int], ends: Sequence[int], steps: Sequence[int]) -> TensorProxy:
    """Per-dimension `a[start:end:step]` with 0 <= start <= end <= size and step >= 1."""
    check(len(starts) == len(ends) == len(steps) == len(a.shape), "slice",
          "one start/end/step per dim")
    shape = []
    for size, start, end, step in zip(a.shape, starts, ends, steps):
        if not (0 <= start <= end <= size and step >= 1):
            check(False, "slice", f"bad slice {start}:{end}:{step} of {size}")
        shape.append((end - start + step - 1) // step)
    return TensorProxy.like(a, shape=shape)


@prim("pad", tags=["shape"])
def pad(a: TensorProxy, value: Number, config: Sequence[tuple[int, int, int]]) -> TensorProxy:
    """Pad each dim with `(low, high, interior)` elements of `value`; negative low/high crop."""
    check(len(config) == a.ndim, "pad", "one (low, high, interior) per dim")
    shape = []
    for size, (low, high, interior) in zip(a.shape, config):
        check(interior >= 0, "pad", "interior padding must be >= 0")
        inner = size + max(size - 1, 0) * interior
        shape.append(low + inner + high)
        check(shape[-1] >= 0, "pad", lambda: f"padding {config} makes a negative size")
    return TensorProxy.like(a, shape=shape)


@prim("cat", tags=["shape"])
def cat(tensors: Sequence[TensorProxy], dim: int) -> TensorProxy:
    """Concatenate along `dim`; tensors share dtype, device and all other sizes."""
    check(len(tensors) > 0, "cat", "needs at least one tensor")
    first = tensors[0]
    size = 0
    for tensor in tensors:
        check(len(tensor.shape) == len(first.shape) and tensor.dtype == first.dtype, "cat", "rank/dtype differ")
        for d, (x, y) in enumerate(zip(tensor.shape, first.shape)):
            check(d == dim or x == y, "cat", f"sizes differ at dim {d}")
        size += tensor.shape[dim]
    shape = list(first.shape)
    shape[dim] = size
    return TensorProxy.like(first, shape=shape)


@prim("flip", tags=["shape"])
def flip(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Reverse the order of elements along `dims`."""
    canonical_dims("flip", dims, a.ndim)
    return TensorProxy.like(a)


@prim("index_select", tags=["gather"])
def index_select(a: TensorProxy, dim: int, index: TensorProxy) -> TensorProxy:
    """Rows of `a` along `dim` picked by the 1-D integer tensor `index`."""
    check(index.dtype in (torch.int64, torch.int32), "index_select", "index must be int32/int64")
    return run_meta(torch.index_select, a, dim, index)


@prim("take_along_dim", tags=["gather"])
def take_along_dim(a: TensorProxy, index: TensorProxy, dim: int) -> TensorProxy:
    """`torch.gather(a, dim, index)`: out[i][j] = a[index[i][j]][j] for dim 0, and so on."""
    return run_meta(torch.gather, a, dim, index)


@prim("scatter_add", tags=["scatter"])
def scatter_add(a: TensorProxy, dim: int, index: TensorProxy, src: TensorProxy) -> TensorProxy:
    """A copy of `a` with `src` added at `index` along `dim` (out of place)."""
    return run_meta(torch.scatter_add, a, dim, index, src)


@prim("index_put", tags=["scatter"])
def index_put(a: TensorProxy, indices: Sequence[TensorProxy | None], values: TensorProxy,
              accumulate: bool) -> TensorProxy:
    """A copy of `a` with `values` written (or added) at advanced `indices` (out of place)."""
    return run_meta(torch.index_put, a, tuple(indices), values, accumulate)
