"""Reduction prims over a set of dimensions. The reduced dims are removed (no keepdim here);
`sum`/`prod` keep the input dtype (torch-level ops choose the accumulation dtype first)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fulmen.ops.prims.base import canonical_dims, check, prim
from fulmen.proxies import TensorProxy

__all__ = ["sum", "prod", "amax", "amin", "var", "argmax", "argmin"]


def _reduced(op: str, a: TensorProxy, dims: Sequence[int], dtype=None) -> TensorProxy:
    dims = canonical_dims(op, dims, len(a.shape))
    shape = [size for d, size in enumerate(a.shape) if d not in dims]
    return TensorProxy.like(a, shape=shape, dtype=dtype)


@prim("sum", tags=["reduction"])
def sum(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:  # noqa: A001
    """Sum over `dims`."""
    return _reduced("sum", a, dims)


@prim("prod", tags=["reduction"])
def prod(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Product over `dims`."""
    return _reduced("prod", a, dims)


@prim("amax", tags=["reduction"])
def amax(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Maximum over `dims` (NaN propagates)."""
    check(all(a.shape[d] > 0 for d in dims), "amax", "cannot reduce an empty dimension")
    return _reduced("amax", a, dims)


@prim("amin", tags=["reduction"])
def amin(a: TensorProxy, dims: Sequence[int]) -> TensorProxy:
    """Minimum over `dims` (NaN propagates)."""
    check(all(a.shape[d] > 0 for d in dims), "amin", "cannot reduce an empty dimension")
    return _reduced("amin", a, dims)


@prim("var", tags=["reduction"])
def var(a: TensorProxy, dims: Sequence[int], correction: float) -> TensorProxy:
    """Variance over `dims` with Bessel-style `correction` (1 = unbiased); real result dtype."""
    real = a.dtype.to_real() if a.dtype.is_complex else a.dtype
    return _reduced("var", a, dims, dtype=real)


@prim("argmax", tags=["reduction", "index"])
def argmax(a: TensorProxy, dim: int) -> TensorProxy:
    """Index (int64) of the first maximum along `dim`."""
    return _reduced("argmax", a, (dim,), dtype=torch.int64)


@prim("argmin", tags=["reduction", "index"])
def argmin(a: TensorProxy, dim: int) -> TensorProxy:
    """Index (int64) of the first minimum along `dim`."""
    return _reduced("argmin", a, (dim,), dtype=torch.int64)
