"""Contraction, neural-network and creation prims.

Shape rules of `matmul`, `linear`, `convolution` and `embedding` are PyTorch's own: their meta
functions run PyTorch's meta kernels. Creation prims take an explicit dtype and device. RNG prims
draw from torch's global generator, so eager and traced programs see the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Number

import torch

from fulmen.ops.meta import run_meta
from fulmen.ops.prims.base import check, prim
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape

__all__ = [
    "matmul", "linear", "convolution", "embedding", "full", "iota", "uniform", "bernoulli",
]  # fmt: skip


@prim("matmul", tags=["matmul"])
def matmul(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    """`torch.matmul` semantics: vector/matrix products with broadcast batch dims."""
    check(a.dtype == b.dtype, "matmul", f"dtypes differ: {a.dtype} vs {b.dtype}")
    rank_a, rank_b = len(a.shape), len(b.shape)
    if (rank_a >= 2 and (rank_b == 2 or rank_a == rank_b) and a.device == b.device
            and known_same_shape(a.shape[:-2], b.shape[:-2] if rank_b > 2 else a.shape[:-2])
            and a.shape[-1] == b.shape[-2]):
        # batches of matrices times a matrix, or batches of the same shape: a contiguous
        # (..., n, m) whatever the operands' layouts (PyTorch's meta kernel and CPU kernel
        # alike, checked for every order of their dims), described directly:
        # with symbolic sizes the meta kernel runs on fake tensors (~0.1 s a call); sizes that
        # do not fit get the meta kernel's error
        out = TensorProxy.like(a, shape=(*a.shape[:-1], b.shape[-1]))
        out._fulmen_exact_strides = True
        return out
    return run_meta(torch.matmul, a, b)


@prim("linear", tags=["matmul"])
def linear(a: TensorProxy, weight: TensorProxy, bias: TensorProxy | None) -> TensorProxy:
    """`a @ weight.T + bias`, weight of shape (out, in): shape a.shape[:-1] + (out,).

    The common case (2-D weight, no bias or a bias of shape (out,)) is described directly;
    others run PyTorch's meta kernel (whose Python decomposition of addmm imports
    torch._dynamo, about a second, on first use)."""
    if (len(a.shape) >= 1 and len(weight.shape) == 2
            and (bias is None or tuple(bias.shape) == (weight.shape[0],))):
        check(a.dtype == weight.dtype and (bias is None or bias.dtype == a.dtype), "linear",
              f"dtypes differ: input {a.dtype}, weight {weight.dtype}"
              + (f", bias {bias.dtype}" if bias is not None else ""))
        check(a.shape[-1] == weight.shape[1], "linear",
              f"input has {a.shape[-1]} features but weight {tuple(weight.shape)} expects "
              f"{weight.shape[1]}")
        check(a.device == weight.device and (bias is None or bias.device == a.device),
              "linear", "tensors on different devices")
        return TensorProxy.like(a, shape=(*a.shape[:-1], weight.shape[0]))
    return run_meta(torch.nn.functional.linear, a, weight, bias)


@prim("convolution", tags=["matmul"])
def convolution(a, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """N-d convolution with `torch.convolution`'s arguments."""
    return run_meta(torch.convolution, a, weight, bias, stride, padding, dilation, transposed,
                    output_padding, groups)


@prim("embedding", tags=["gather"])
def embedding(indices: TensorProxy, weight: TensorProxy) -> TensorProxy:
    """Rows of `weight` (num, dim) picked by integer `indices`: shape indices.shape + (dim,)."""
    check(not indices.dtype.is_floating_point, "embedding", "indices must be integers")
    return TensorProxy.like(weight, shape=(*indices.shape, weight.shape[-1]))


@prim("full", tags=["creation"])
def full(shape: Sequence[int], fill_value: Number, dtype: torch.dtype, device: torch.device) -> TensorProxy:
    """A tensor of `shape` filled with `fill_value`."""
    return TensorProxy(None, tuple(shape), dtype, device)


@prim("iota", tags=["creation"])
def iota(length: int, start: Number, step: Number, dtype: torch.dtype, device: torch.device) -> TensorProxy:
    """`[start, start + step, ...]`, `length` elements."""
    check(length >= 0, "iota", f"negative length {length}")
    return TensorProxy(None, (length,), dtype, device)


@prim("uniform", tags=["creation", "random"])
def uniform(shape: Sequence[int], low: Number, high: Number, dtype: torch.dtype,
            device: torch.device) -> TensorProxy:
    """Uniform samples in [low, high) from torch's global generator."""
    return TensorProxy(None, tuple(shape), dtype, device)


@prim("bernoulli", tags=["creation", "random"])
def bernoulli(shape: Sequence[int], p: float, dtype: torch.dtype, device: torch.device,
              strides: Sequence[int] | None = None) -> TensorProxy:
    """Samples of 1 (probability `p`) and 0, drawn from torch's global generator exactly as
    `torch.empty_strided(shape, strides).bernoulli_(p)` draws them, in memory order (so dropout
    matches eager under a seed: eager draws its mask into `empty_like(input)`, which keeps a
    permuted input's strides); `strides` None: contiguous."""
    check(0.0 <= p <= 1.0, "bernoulli", f"probability {p} outside [0, 1]")
    return TensorProxy(None, tuple(shape), dtype, device, strides=strides)
