"""VJP rules of the prims (and the generic rule for opaque ops).

Each rule returns one cotangent per argument, None for arguments that get none (numbers,
integer tensors, shapes). Rules are written with prims on operands whose shapes and dtypes
already agree, so no promotion or broadcasting happens here.
"""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Symbol
from fulmen.core.proxy import ObjectProxy
from fulmen.ops import prims
from fulmen.ops.torch_autograd import (
    AUTOGRAD_BACKWARD,
    AUTOGRAD_FORWARD,
    AUTOGRAD_VJP,
    _differentiable,
    _per_argument,
    _primal_leaves,
)
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import size_hints
from fulmen.transforms.autodiff.registry import vjp_rule


def accumulate(existing, grad):
    """`existing + grad`, or `grad` when there is nothing yet."""
    return grad if existing is None else prims.add(existing, grad)


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _zeros_like(a):
    return prims.full(tuple(a.shape), 0, a.dtype, a.device)


def _for_tensor(value, grad):
    """`grad` if `value` is a tensor (numbers get no cotangent)."""
    return grad if _is_tensor(value) else None


def _first_tensor(*values):
    return next(v for v in values if _is_tensor(v))


# --- elementwise, unary ---------------------------------------------------------------------


def _unary(prim, derivative):
    """Register `grad * derivative(a, out)` as the rule of a unary prim."""

    def rule(grad, out, a):
        return (prims.mul(grad, derivative(a, out)),)

    rule.__name__ = f"_{prim.name}_vjp"
    vjp_rule(prim)(rule)


def _square(a):
    return prims.mul(a, a) if _is_tensor(a) else a * a


_unary(prims.exp, lambda a, out: out)
_unary(prims.exp2, lambda a, out: prims.mul(out, math.log(2.0)))
_unary(prims.expm1, lambda a, out: prims.add(out, 1))
_unary(prims.log, lambda a, out: prims.reciprocal(a))
_unary(prims.log1p, lambda a, out: prims.reciprocal(prims.add(a, 1)))
_unary(prims.log2, lambda a, out: prims.reciprocal(prims.mul(a, math.log(2.0))))
_unary(prims.log10, lambda a, out: prims.reciprocal(prims.mul(a, math.log(10.0))))
_unary(prims.sqrt, lambda a, out: prims.div(0.5, out))
_unary(prims.rsqrt, lambda a, out: prims.mul(prims.mul(_square(out), out), -0.5))
_unary(prims.sin, lambda a, out: prims.cos(a))
_unary(prims.cos, lambda a, out: prims.neg(prims.sin(a)))
_unary(prims.tan, lambda a, out: prims.add(_square(out), 1))
_unary(prims.asin, lambda a, out: prims.rsqrt(prims.sub(1, _square(a))))
_unary(prims.acos, lambda a, out: prims.neg(prims.rsqrt(prims.sub(1, _square(a)))))
_unary(prims.atan, lambda a, out: prims.reciprocal(prims.add(_square(a), 1)))
_unary(prims.sinh, lambda a, out: prims.cosh(a))
_unary(prims.cosh, lambda a, out: prims.sinh(a))
_unary(prims.tanh, lambda a, out: prims.sub(1, _square(out)))
_unary(prims.asinh, lambda a, out: prims.rsqrt(prims.add(_square(a), 1)))
_unary(prims.acosh, lambda a, out: prims.rsqrt(prims.sub(_square(a), 1)))
_unary(prims.atanh, lambda a, out: prims.reciprocal(prims.sub(1, _square(a))))
_unary(prims.erf, lambda a, out: prims.mul(prims.exp(prims.neg(_square(a))), 2 / math.sqrt(math.pi)))
_unary(prims.erfc, lambda a, out: prims.mul(prims.exp(prims.neg(_square(a))), -2 / math.sqrt(math.pi)))
_unary(prims.erfinv, lambda a, out: prims.mul(prims.exp(_square(out)), math.sqrt(math.pi) / 2))
_unary(prims.lgamma, lambda a, out: prims.digamma(a))
_unary(prims.reciprocal, lambda a, out: prims.neg(_square(out)))
_unary(prims.abs, lambda a, out: prims.sign(a))


@vjp_rule(prims.neg)
def _neg_vjp(grad, out, a):
    return (prims.neg(grad),)


def _zero_rule(grad, out, *args):
    return tuple(_zeros_like(a) if _is_tensor(a) else None for a in args)


for _prim in (prims.floor, prims.ceil, prims.round, prims.trunc, prims.sign, prims.floor_div,
              prims.trunc_div):
    vjp_rule(_prim)(_zero_rule)


@vjp_rule(prims.convert_element_type)
def _convert_element_type_vjp(grad, out, a, dtype):
    return prims.convert_element_type(grad, a.dtype), None


# --- elementwise, binary ----------------------------------------------------------------------


@vjp_rule(prims.add)
def _add_vjp(grad, out, a, b):
    return _for_tensor(a, grad), _for_tensor(b, grad)


@vjp_rule(prims.sub)
def _sub_vjp(grad, out, a, b):
    return _for_tensor(a, grad), _for_tensor(b, prims.neg(grad)) if _is_tensor(b) else None


@vjp_rule(prims.mul)
def _mul_vjp(grad, out, a, b):
    return (prims.mul(grad, b) if _is_tensor(a) else None,
            prims.mul(grad, a) if _is_tensor(b) else None)


@vjp_rule(prims.div)
def _div_vjp(grad, out, a, b):
    grad_a = prims.div(grad, b) if _is_tensor(a) else None
    grad_b = prims.neg(prims.div(prims.mul(grad, out), b)) if _is_tensor(b) else None
    return grad_a, grad_b


@vjp_rule(prims.pow)
def _pow_vjp(grad, out, a, b):
    """As torch: d/da = b * a**(b-1), zero where b == 0; d/db = a**b * log(a), zero where
    a == 0 and b >= 0."""
    grad_a = grad_b = None
    if _is_tensor(a):
        exponent = prims.sub(b, 1) if _is_tensor(b) else b - 1
        derivative = prims.mul(b, prims.pow(a, exponent))
        if _is_tensor(b):
            derivative = prims.where(prims.eq(b, 0), _zeros_like(derivative), derivative)
        elif b == 0:
            derivative = _zeros_like(a)
        grad_a = prims.mul(grad, derivative)
    if _is_tensor(b):
        if _is_tensor(a):
            log_a = prims.log(a)
            zero_base = prims.bitwise_and(prims.eq(a, 0), prims.ge(b, 0))
        else:
            log_a = math.log(a) if a > 0 else (-math.inf if a == 0 else math.nan)
            zero_base = prims.ge(b, 0) if a == 0 else None
        derivative = prims.mul(out, log_a)
        if zero_base is not None:
            derivative = prims.where(zero_base, _zeros_like(derivative), derivative)
        grad_b = prims.mul(grad, derivative)
    return grad_a, grad_b


def _selection_rule(prim, loses):
    """maximum/minimum as eager: an operand gets the gradient unless it `loses` to the other
    (so a NaN on either side sends it to both), halved on ties."""

    def rule(grad, out, a, b):
        t = _first_tensor(a, b)
        a_t = a if _is_tensor(a) else prims.full(tuple(t.shape), a, t.dtype, t.device)
        b_t = b if _is_tensor(b) else prims.full(tuple(t.shape), b, t.dtype, t.device)
        shared = prims.where(prims.eq(a_t, b_t), prims.div(grad, 2), grad)
        grad_a = prims.where(loses(a_t, b_t), 0.0, shared)
        grad_b = prims.where(loses(b_t, a_t), 0.0, shared)
        return _for_tensor(a, grad_a), _for_tensor(b, grad_b)

    rule.__name__ = f"_{prim.name}_vjp"
    vjp_rule(prim)(rule)


_selection_rule(prims.maximum, prims.lt)
_selection_rule(prims.minimum, prims.gt)


@vjp_rule(prims.atan2)
def _atan2_vjp(grad, out, a, b):
    """As eager's atan2_backward: `grad * b * r` and `grad * -a * r` with r = 1 / (a^2 + b^2),
    and r = 0 where a^2 + b^2 is 0 (the origin's subgradient is 0, not NaN)."""
    denominator = prims.add(_square(a), _square(b))
    recip = prims.where(prims.eq(denominator, 0), 0.0, prims.reciprocal(denominator))
    grad_a = prims.mul(prims.mul(grad, b), recip)
    grad_b = prims.mul(prims.mul(grad, prims.neg(a)), recip)
    return _for_tensor(a, grad_a), _for_tensor(b, grad_b)


@vjp_rule(prims.remainder)
def _remainder_vjp(grad, out, a, b):
    grad_b = prims.mul(prims.neg(grad), prims.floor_div(a, b)) if _is_tensor(b) else None
    return _for_tensor(a, grad), grad_b


@vjp_rule(prims.fmod)
def _fmod_vjp(grad, out, a, b):
    grad_b = prims.mul(prims.neg(grad), prims.trunc_div(a, b)) if _is_tensor(b) else None
    return _for_tensor(a, grad), grad_b


@vjp_rule(prims.copysign)
def _copysign_vjp(grad, out, a, b):
    """As torch: grad * out / a (0 where a == 0) for a; nothing flows to the sign source."""
    ratio = prims.div(out, a)
    ratio = prims.where(prims.eq(a, 0), _zeros_like(ratio), ratio)
    return prims.mul(grad, ratio), _zeros_like(b) if _is_tensor(b) else None


@vjp_rule(prims.where)
def _where_vjp(grad, out, pred, a, b):
    """The cotangent where each side was taken, 0 elsewhere (a number: a fused kernel needs no
    zero tensor, and the torch executor allocates none)."""
    return (None,
            prims.where(pred, grad, 0.0) if _is_tensor(a) else None,
            prims.where(pred, 0.0, grad) if _is_tensor(b) else None)


# --- opaque ops and rules that defer to torch.autograd ----------------------------------------


def differentiable_outputs(bsym: BoundSymbol, requires: set[str]) -> set[str]:
    """Names of `bsym`'s outputs that eager's autograd would make differentiable when the
    inputs named in `requires` require grad (asked of PyTorch on meta tensors)."""
    primals = [p for p in _primal_leaves(bsym.args, bsym.kwargs) if p.name in requires]
    wanted = {id(p) for p in primals}

    def meta(leaf):
        if isinstance(leaf, torch.Tensor):
            # symbolic sizes: their values (whether an output needs grad never depends on them)
            tensor = torch.empty_strided(size_hints(leaf.shape), size_hints(leaf.stride()),
                                         dtype=leaf.dtype, device="meta")
            return tensor.requires_grad_(id(leaf) in wanted)
        return leaf

    args, kwargs = pytree.tree_map(meta, (bsym.args, bsym.kwargs))
    try:
        with torch._C.DisableTorchFunction(), torch.enable_grad():
            outputs = bsym.sym.torch_fn(*args, **kwargs)
    except Exception:  # no meta support under autograd: assume every floating output is
        return {p.name for p in bsym.proxy_outputs if _differentiable(p)}
    flags = [getattr(o, "requires_grad", False) for o in pytree.tree_leaves(outputs)]
    proxies = pytree.tree_leaves(bsym.output)
    return {p.name for p, flag in zip(proxies, flags) if flag and isinstance(p, TensorProxy)}


def autograd_forward(bsym: BoundSymbol, graph: ObjectProxy, requires: set[str]) -> BoundSymbol:
    """`bsym` rewritten to also keep its autograd graph in `graph` (same outputs, same source);
    only the arguments named in `requires` are differentiated."""
    mask = tuple(p.name in requires for p in _primal_leaves(bsym.args, bsym.kwargs))
    return BoundSymbol(AUTOGRAD_FORWARD, (bsym.sym, bsym.args, bsym.kwargs, mask), {},
                       (bsym.output, graph), (), bsym.source)


def graph_vjp(bsym: BoundSymbol, graph: ObjectProxy, requires: set[str], cotangent):
    """Cotangents for the arguments of an op run by `autograd_forward`, from its kept graph;
    one entry per argument (positional, then keyword), like a rule."""
    primals = [p for p in _primal_leaves(bsym.args, bsym.kwargs) if p.name in requires]
    specs = tuple((tuple(p.shape), p.dtype, p.device) for p in primals)
    grads = AUTOGRAD_BACKWARD(graph, specs, cotangent)
    return _per_argument(list(bsym.args) + list(bsym.kwargs.values()), primals, grads)


def opaque_vjp(bsym: BoundSymbol, cotangent):
    """Cotangents for `bsym`'s arguments by running torch.autograd on its torch callable alone.

    Returns one entry per argument (positional, then keyword), like a rule.
    """
    primals = _primal_leaves(bsym.args, bsym.kwargs)
    grads = AUTOGRAD_VJP(bsym.sym, bsym.args, bsym.kwargs, cotangent)
    return _per_argument(list(bsym.args) + list(bsym.kwargs.values()), primals, grads)


def autograd_cotangents(fn: Symbol, args: tuple, grad) -> tuple:
    """One cotangent per entry of `args` for `fn(*args)`, computed by torch.autograd."""
    primals = _primal_leaves(args, {})
    grads = AUTOGRAD_VJP(fn, args, {}, grad)
    return tuple(_per_argument(list(args), primals, grads))


def autograd_rule(prim: Symbol):
    """Register a rule for `prim` that runs torch.autograd on the prim's implementation."""

    def rule(grad, out, *args):
        return autograd_cotangents(prim, args, grad)

    rule.__name__ = f"_{prim.name}_vjp"
    vjp_rule(prim)(rule)


autograd_rule(prims.digamma)  # needs polygamma, which is not a prim
