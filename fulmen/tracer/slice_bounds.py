"""Slices bounded by 0-d integer tensors (`x[:n]` with `n = mask.sum(1).max()`): eager reads
such a bound with `__index__`; the tracer reads it the same way, a value the trace guards (a
graph break), so the indexing itself is traced with a Python int."""

from __future__ import annotations

import operator

import torch

from fulmen.proxies import TensorProxy

T = torch.Tensor

INDEXING = (T.__getitem__, T.__setitem__)


def _index_tensor(bound) -> bool:
    """Whether a slice bound is an integer (or bool) tensor of one element (0-d, or `[n]`),
    which eager reads with `__index__`."""
    return isinstance(bound, TensorProxy) and all(size == 1 for size in bound.shape) \
        and not bound.dtype.is_floating_point and not bound.dtype.is_complex


def tensor_bounded(index) -> bool:
    """Whether a basic index has a slice bounded by a 0-d integer tensor (`x[:n]`)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, slice) and any(map(_index_tensor, (item.start, item.stop,
                                                                   item.step)))
               for item in items)


def bounds_read(index):
    """`index` with each 0-d integer tensor bounding a slice read as eager reads it,
    `operator.index(n)` (a value the trace guards: a graph break)."""
    def item_read(item):
        if not isinstance(item, slice):
            return item
        return slice(*(operator.index(b) if _index_tensor(b) else b
                       for b in (item.start, item.stop, item.step)))

    return tuple(map(item_read, index)) if isinstance(index, tuple) else item_read(index)


__all__ = ["INDEXING", "bounds_read", "tensor_bounded"]
