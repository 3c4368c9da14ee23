"""VJP rules for creation prims and for norms whose decomposed backward is wrong at zero.

Creation prims (`full`, `iota`, `uniform`, `bernoulli`) take no tensor, so they pass no
cotangent on; a rule saying so lets gradients flow through decompositions that build constant
tensors (masks, zero fills, `ignore_index` weights).

The 2-norm's decomposition `sqrt(sum(x * x))` has an infinite derivative at 0, so its
recomputed backward gives NaN for an all-zero input where eager gives 0 (the subgradient).
The rule below is eager's: `grad * x / norm`, with 0 where the norm is 0.

Group norm runs eager's own forward and backward kernels (NOTE [group norm backward]).
"""

from __future__ import annotations

import math

import torch

from fulmen.ops import ltorch, prims
from fulmen.ops.opaque import in_layout_of, opaque_symbol
from fulmen.tracer.layout import _channels_last_like
from fulmen.transforms.autodiff.registry import vjp_rule
from fulmen.transforms.autodiff.rules import _zeros_like, autograd_cotangents


def _no_cotangents(grad, out, *args):
    return (None,) * len(args)


for _prim in (prims.full, prims.iota, prims.uniform, prims.bernoulli):
    vjp_rule(_prim)(_no_cotangents)


def _norm_dims(x, dim) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        return tuple(range(x.ndim))
    return tuple(sorted({d % max(x.ndim, 1) for d in dims})) if x.ndim else ()


def _two_norm_grad(grad, out, x, dim, keepdim):
    """`grad * x / norm` (0 where the norm is 0), for float32/float64 `x`."""
    dims = _norm_dims(x, dim)
    kept = tuple(d for d in range(x.ndim) if d not in dims)
    if keepdim and dims:
        shape = tuple(s for d, s in enumerate(x.shape) if d not in dims)
        grad = prims.reshape(grad, shape)
        out = prims.reshape(out, shape)
    grad_full = prims.broadcast_in_dim(grad, tuple(x.shape), kept)
    norm_full = prims.broadcast_in_dim(out, tuple(x.shape), kept)
    scaled = prims.div(prims.mul(grad_full, x), norm_full)
    return prims.where(prims.eq(norm_full, 0), _zeros_like(scaled), scaled)


def _is_two_norm(x, ord, dtype) -> bool:
    return ord == 2 and dtype is None and x.dtype.is_floating_point and x.dtype.itemsize >= 4


@vjp_rule(ltorch.vector_norm)
def _vector_norm_vjp(grad, out, x, ord, dim, keepdim, dtype, out_):
    if not _is_two_norm(x, ord, dtype) or x.numel() == 0:
        return autograd_cotangents(ltorch.vector_norm, (x, ord, dim, keepdim), grad) + (
            None, None)
    return _two_norm_grad(grad, out, x, dim, keepdim), None, None, None, None, None


@vjp_rule(ltorch.norm)
def _norm_vjp(grad, out, input, p, dim, keepdim, out_, dtype):
    two = p in ("fro", None) or p == 2
    if not two or not _is_two_norm(input, 2, dtype) or input.numel() == 0:
        return autograd_cotangents(ltorch.norm, (input, p, dim, keepdim), grad) + (None, None)
    return _two_norm_grad(grad, out, input, dim, keepdim), None, None, None, None, None


# --- group norm: eager's kernels -------------------------------------------------------------

NATIVE_GROUP_NORM = opaque_symbol(torch.ops.aten.native_group_norm.default)
NATIVE_GROUP_NORM_BACKWARD = opaque_symbol(torch.ops.aten.native_group_norm_backward.default)

IN_LAYOUT_OF = opaque_symbol(in_layout_of)


def _eager_memory_format(input) -> torch.memory_format | None:
    """The layout eager's `group_norm` hands its CPU kernels (`suggest_memory_format`), when
    `input` already has it (else eager copies it first); None otherwise, off the CPU, and for
    rank 5, whose channels-last-3d rule is not written here."""
    if input.ndim == 5 or input.device.type != "cpu":  # CUDA's kernels take row-major only
        return None
    layout = torch.contiguous_format
    if input.ndim == 4 and _channels_last_like(input):
        layout = torch.channels_last
    return layout if input.is_contiguous(memory_format=layout) else None


@vjp_rule(ltorch.group_norm)
def _group_norm_vjp(grad, out, input, groups, weight, bias, eps):
    """NOTE [group norm backward]: the decomposition's backward transposes every prim of the
    normalisation, which with few elements per group (2 channels at 1x1) is a near-cancellation
    rounded otherwise than eager's fused kernel (a conv weight's gradient 3.6e-6 rms from
    float64 where eager's was 9.6e-7). This rule runs eager's kernels: `native_group_norm`
    for the per-group mean and 1/std (as eager's forward computes them), then
    `native_group_norm_backward`, so gradients are eager's bit for bit. The statistics are
    recomputed, not saved by the forward: a forward keeping them (two `(N, groups)` tensors)
    would run the opaque `native_group_norm`, which the rematerialization never recomputes, so
    the group norm's output would be saved too (a conv / GroupNorm / SiLU model saved 1.8x the
    bytes). Symbolic sizes, devices other than the CPU and inputs not already in the layout
    eager's kernels take run torch.autograd on the op (eager's kernels as well). The cotangent
    goes through `in_layout_of` the input, decided at run time: neither its traced layout nor
    the input's need be its layout then (`y.sum().backward()` hands an expanded one, which the
    kernel read as row-major; a fused `relu` of a channels-last tensor is row-major when its
    kernel wrote it, and the kernel read a channels-last cotangent as row-major)."""
    sizes = tuple(input.shape)
    layout = _eager_memory_format(input)
    if not all(type(s) is int for s in sizes) or layout is None:
        return autograd_cotangents(ltorch.group_norm, (input, groups, weight, bias, eps), grad)
    batch, channels, spatial = sizes[0], sizes[1], math.prod(sizes[2:])
    _, mean, rstd = NATIVE_GROUP_NORM(input, weight, bias, batch, channels, spatial, groups,
                                      float(eps))
    grad = IN_LAYOUT_OF(grad, input)  # the kernel reads the input's layout when it runs
    mask = [True, weight is not None, bias is not None]
    grads = NATIVE_GROUP_NORM_BACKWARD(grad, input, mean, rstd, weight, batch, channels,
                                       spatial, groups, mask)
    return (grads[0], None, grads[1], grads[2], None)
