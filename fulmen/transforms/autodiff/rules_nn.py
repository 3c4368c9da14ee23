"""VJP rules for creation prims and for norms whose decomposed backward is wrong at zero.

Creation prims (`full`, `iota`, `uniform`, `bernoulli`) take no tensor, so they pass no
cotangent on; a rule saying so lets gradients flow through decompositions that build constant
tensors (masks, zero fills, `ignore_index` weights).

The 2-norm's decomposition `sqrt(sum(x * x))` has an infinite derivative at 0, so its
recomputed backward gives NaN for an all-zero input where eager gives 0 (the subgradient).
The rule below is eager's: `grad * x / norm`, with 0 where the norm is 0.
"""

from __future__ import annotations

from fulmen.ops import ltorch, prims
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
