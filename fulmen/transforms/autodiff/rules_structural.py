"""VJP rules of shape, reduction, indexing and contraction prims."""

from __future__ import annotations

import math

import torch

from fulmen.ops import prims
from fulmen.ops.opaque import opaque_symbol
from fulmen.proxies.tensor import known_same_shape
from fulmen.transforms.autodiff.registry import vjp_rule
from fulmen.transforms.autodiff.rules import _zeros_like, autograd_cotangents, autograd_rule

# --- shape ------------------------------------------------------------------------------------


@vjp_rule(prims.broadcast_in_dim)
def _broadcast_in_dim_vjp(grad, out, a, shape, broadcast_dims):
    """Sum over the new dims and over the dims that were expanded from size 1; a new dim of
    size 1 is only dropped by the reshape (a keepdim view: no sum over one element, which a
    row kernel would have to take as a reduction of another shape)."""
    kept = set(broadcast_dims)
    reduced = [d for d in range(len(shape)) if d not in kept and not _is_one(shape[d])]
    reduced += [d for size, d in zip(a.shape, broadcast_dims) if _expanded(size, shape[d])]
    summed = prims.sum(grad, tuple(sorted(reduced))) if reduced else grad
    if known_same_shape(tuple(summed.shape), tuple(a.shape)):  # a bias's gradient: no reshape
        return summed, None, None
    return prims.reshape(summed, tuple(a.shape)), None, None


def _is_one(size) -> bool:
    """Whether `size` is 1 for every value of its symbols (no guard: a symbolic new dim is
    summed over, which is right for a size 1 too)."""
    return known_same_shape((size,), (1,))


def _expanded(size, target) -> bool:
    """Whether a dim of size `size` was expanded to `target`, asked with as few guards as
    symbolic sizes allow: a size known equal to the target was not, and a literal 1 is summed
    over whatever the target (a sum over a dim of size 1 changes nothing)."""
    if known_same_shape((size,), (target,)):
        return False
    if isinstance(size, int):
        return size == 1 and not (isinstance(target, int) and target == 1)
    return size == 1 and target != 1


@vjp_rule(opaque_symbol(torch.Tensor.contiguous))
def _contiguous_vjp(grad, out, a, *memory_format):
    """A copy into a new layout passes its cotangent on unchanged (the forward runs
    `Tensor.contiguous` itself, not under torch.autograd with a kept graph)."""
    return (grad, *(None for _ in memory_format))


@vjp_rule(prims.reshape)
def _reshape_vjp(grad, out, a, shape):
    return prims.reshape(grad, tuple(a.shape)), None


@vjp_rule(prims.squeeze)
def _squeeze_vjp(grad, out, a, dims):
    return prims.reshape(grad, tuple(a.shape)), None


@vjp_rule(prims.permute)
def _permute_vjp(grad, out, a, dims):
    inverse = [0] * len(dims)
    for position, dim in enumerate(dims):
        inverse[dim] = position
    return prims.permute(grad, tuple(inverse)), None


@vjp_rule(prims.slice_prim)
def _slice_vjp(grad, out, a, starts, ends, steps):
    """Scatter back with zeros: interior padding for the step, edge padding around."""
    config = []
    for size, start, step, taken in zip(a.shape, starts, steps, grad.shape):
        if taken == 0:
            return _zeros_like(a), None, None, None
        last = start + (taken - 1) * step
        config.append((start, size - last - 1, step - 1))
    return prims.pad(grad, 0.0, tuple(config)), None, None, None


@vjp_rule(prims.pad)
def _pad_vjp(grad, out, a, value, config):
    """Without interior padding, eager's `constant_pad_nd(grad, -pad)`: a new dense tensor (a
    slice of `grad` would give `torch.autograd.grad` a strided view of the padded gradient).
    Else undo cropping (negative padding) with zeros, then take every (interior+1)-th element."""
    if not any(interior for _, _, interior in config):
        return prims.pad(grad, 0.0, tuple((-low, -high, 0) for low, high, _ in config)), None, None
    regrow = tuple((max(-low, 0), max(-high, 0), 0) for low, high, _ in config)
    if any(low or high for low, high, _ in regrow):
        grad = prims.pad(grad, 0.0, regrow)
    starts = [max(low, 0) for low, _, _ in config]
    steps = [interior + 1 for _, _, interior in config]
    ends = [start + (size - 1) * step + 1 if size else start
            for start, size, step in zip(starts, a.shape, steps)]
    return prims.slice_prim(grad, starts, ends, steps), None, None


@vjp_rule(prims.cat)
def _cat_vjp(grad, out, tensors, dim):
    pieces, offset = [], 0
    for tensor in tensors:
        starts = [0] * grad.ndim
        ends = list(grad.shape)
        starts[dim], ends[dim] = offset, offset + tensor.shape[dim]
        pieces.append(prims.slice_prim(grad, starts, ends, [1] * grad.ndim))
        offset += tensor.shape[dim]
    return pieces, None


@vjp_rule(prims.flip)
def _flip_vjp(grad, out, a, dims):
    return prims.flip(grad, dims), None


# --- reductions -------------------------------------------------------------------------------


def _unreduce(grad, a, dims):
    """Broadcast a reduced cotangent back to `a`'s shape."""
    kept = [d for d in range(a.ndim) if d not in set(dims)]
    return prims.broadcast_in_dim(grad, tuple(a.shape), tuple(kept))


@vjp_rule(prims.sum)
def _sum_vjp(grad, out, a, dims):
    return _unreduce(grad, a, dims), None


def _extremum_rule(grad, out, a, dims):
    """The gradient is shared evenly by the elements equal to the extremum (as torch amax)."""
    hit = prims.eq(a, _unreduce(out, a, dims))
    hit = prims.convert_element_type(hit, grad.dtype)
    count = prims.sum(hit, tuple(dims))
    return prims.mul(_unreduce(prims.div(grad, count), a, dims), hit), None


vjp_rule(prims.amax)(_extremum_rule)
vjp_rule(prims.amin)(_extremum_rule)


@vjp_rule(prims.var)
def _var_vjp(grad, out, a, dims, correction):
    count = 1
    for d in dims:
        count *= a.shape[d]
    mean = prims.div(prims.sum(a, tuple(dims)), count)
    centered = prims.sub(a, _unreduce(mean, a, dims))
    scale = prims.div(prims.mul(grad, 2.0), float(max(count - correction, 0)))
    return prims.mul(centered, _unreduce(scale, a, dims)), None, None


autograd_rule(prims.prod)  # zeros in the input make the closed form delicate

# --- indexing ---------------------------------------------------------------------------------


@vjp_rule(prims.take_along_dim)
def _take_along_dim_vjp(grad, out, a, index, dim):
    return prims.scatter_add(_zeros_like(a), dim, index, grad), None, None


@vjp_rule(prims.scatter_add)
def _scatter_add_vjp(grad, out, a, dim, index, src):
    return grad, None, None, prims.take_along_dim(grad, index, dim)


@vjp_rule(prims.embedding)
def _embedding_vjp(grad, out, indices, weight):
    rows = prims.reshape(indices, (indices.numel(),))
    values = prims.reshape(grad, (indices.numel(), weight.shape[-1]))
    return None, prims.index_put(_zeros_like(weight), (rows,), values, True)


autograd_rule(prims.index_select)
autograd_rule(prims.index_put)

# --- contractions -----------------------------------------------------------------------------


def _transpose_last(t):
    dims = list(range(t.ndim))
    dims[-1], dims[-2] = dims[-2], dims[-1]
    return prims.permute(t, tuple(dims))


def _matmul_2d_weight_vjp(grad, a, w):
    """grad/a/w for out = a @ w with w 2-D and a at least 2-D: dw sums over batch dims."""
    grad_a = prims.matmul(grad, _transpose_last(w))
    rows = math.prod(a.shape[:-1])
    a2 = prims.reshape(a, (rows, a.shape[-1]))
    g2 = prims.reshape(grad, (rows, grad.shape[-1]))
    grad_w = prims.matmul(_transpose_last(a2), g2)
    return grad_a, grad_w


@vjp_rule(prims.matmul)
def _matmul_vjp(grad, out, a, b):
    if a.ndim >= 2 and b.ndim == 2:
        return _matmul_2d_weight_vjp(grad, a, b)
    if a.ndim == b.ndim and a.ndim > 2 and a.shape[:-2] == b.shape[:-2]:
        return prims.matmul(grad, _transpose_last(b)), prims.matmul(_transpose_last(a), grad)
    return autograd_cotangents(prims.matmul, (a, b), grad)


autograd_rule(prims.convolution)


@vjp_rule(prims.linear)
def _linear_vjp(grad, out, a, weight, bias):
    grad_a = prims.matmul(grad, weight)
    rows = math.prod(a.shape[:-1])
    a2 = prims.reshape(a, (rows, a.shape[-1]))
    g2 = prims.reshape(grad, (rows, grad.shape[-1]))
    grad_w = prims.matmul(_transpose_last(g2), a2)
    grad_bias = None if bias is None else prims.sum(g2, (0,))
    return grad_a, grad_w, grad_bias

