"""Contractions, norms and normalisations: addmm, baddbmm, outer, einsum, conv1d/conv2d,
vector_norm/norm, F.normalize, F.rms_norm and F.group_norm.

Contractions map to the `matmul` and `convolution` prims; einsum is folded pairwise, left to
right, into permutes, reshapes and batched matmuls (repeated indices within one operand and
the sublist form raise `NotYetSupportedError`, so the tracer runs `torch.einsum` whole).
Normalisations compute in float32 for float16/bfloat16 inputs, as eager does.
"""

from __future__ import annotations

import math
from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.reductions import compute_dtype, expand_reduced, reduction_dims, restore_dims
from fulmen.ops.torch.utils import broadcast_to, elementwise, to_dtype

T = torch.Tensor


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _real_number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, (bool, complex))


# --------------------------------------------------------------------------- addmm, baddbmm


def _scaled_sum(op: str, input, product, beta, alpha):
    """`beta * input + alpha * product`; with beta == 0 `input` is ignored (NaN included)."""
    for name, value in (("beta", beta), ("alpha", alpha)):
        if not _real_number(value) or (isinstance(value, float)
                                       and not product.dtype.is_floating_point):
            raise _unsupported(op, f"{name}={value!r}")
    if alpha != 1:
        product = prims.mul(product, alpha)
    if beta == 0:
        return product
    try:
        bias = broadcast_to(input, tuple(product.shape))
    except Exception:
        raise _unsupported(op, "input does not broadcast to the product (eager raises)") from None
    if beta != 1:
        bias = prims.mul(bias, beta)
    return prims.add(bias, product)


def _check_operands(op: str, ranks: int, *tensors) -> None:
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise _unsupported(op, "operands must be tensors")
    if len({t.dtype for t in tensors}) != 1 or not tensors[0].dtype.is_floating_point:
        raise _unsupported(op, "operands must share a floating dtype")
    if any(t.ndim != ranks for t in tensors[1:]):
        raise _unsupported(op, f"mat1/mat2 must be {ranks}-d (eager raises)")


@torch_op(torch.addmm, methods=("addmm",))
def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """`torch.addmm`: `beta * input + alpha * (mat1 @ mat2)`."""
    _check_operands("addmm", 2, input, mat1, mat2)
    if mat1.shape[1] != mat2.shape[0]:
        raise _unsupported("addmm", "inner sizes differ (eager raises)")
    return _scaled_sum("addmm", input, prims.matmul(mat1, mat2), beta, alpha)


@torch_op(torch.baddbmm, methods=("baddbmm",))
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    """`torch.baddbmm`: `beta * input + alpha * (batch1 @ batch2)`, batched."""
    _check_operands("baddbmm", 3, input, batch1, batch2)
    if batch1.shape[0] != batch2.shape[0] or batch1.shape[2] != batch2.shape[1]:
        raise _unsupported("baddbmm", "batch or inner sizes differ (eager raises)")
    return _scaled_sum("baddbmm", input, prims.matmul(batch1, batch2), beta, alpha)


@torch_op(torch.outer, torch.ger, methods=("outer", "ger"))
def outer(input, vec2):
    """`torch.outer`: `out[i, j] = input[i] * vec2[j]` for 1-d tensors."""
    if not (isinstance(vec2, torch.Tensor) and input.ndim == 1 and vec2.ndim == 1):
        raise _unsupported("outer", "needs two 1-d tensors (eager raises)")
    shape = (input.shape[0], vec2.shape[0])
    column = prims.broadcast_in_dim(input, shape, (0,))
    row = prims.broadcast_in_dim(vec2, shape, (1,))
    return elementwise(prims.mul, column, row)


# --------------------------------------------------------------------------- einsum


def _parse_einsum(op: str, equation: str, count: int):
    equation = equation.replace(" ", "")
    if "." in equation:
        raise _unsupported(op, "ellipsis in the equation")
    lhs, arrow, rhs = equation.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != count:
        raise _unsupported(op, f"{len(inputs)} operand terms for {count} operands (eager raises)")
    if not all(term.isalpha() for term in inputs if term) or not (rhs.isalpha() or rhs == ""):
        raise _unsupported(op, f"equation {equation!r}")
    if any(len(set(term)) != len(term) for term in inputs):
        raise _unsupported(op, "a repeated index within one operand (a diagonal)")
    if not arrow:  # implicit output: indices seen once, in alphabetical order
        letters = "".join(inputs)
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(set(rhs)) != len(rhs) or not set(rhs) <= set("".join(inputs)):
        raise _unsupported(op, f"output {rhs!r} (eager raises)")
    return inputs, rhs


def _sum_out(a, term: str, keep: set[str]):
    """Sum `a` (indexed by `term`) over its indices not in `keep`."""
    dims = tuple(d for d, c in enumerate(term) if c not in keep)
    if not dims:
        return a, term
    return prims.sum(a, dims), "".join(c for c in term if c in keep)


def _contract(a, a_term: str, b, b_term: str, keep: set[str]):
    """Contract two operands: shared indices not in `keep` are summed by a batched matmul."""
    batch = [c for c in a_term if c in b_term and c in keep]
    summed = [c for c in a_term if c in b_term and c not in keep]
    left = [c for c in a_term if c not in b_term]
    right = [c for c in b_term if c not in a_term]
    size = {**dict(zip(a_term, a.shape)), **dict(zip(b_term, b.shape))}
    for c in batch + summed:
        if a.shape[a_term.index(c)] != b.shape[b_term.index(c)]:
            raise _unsupported("einsum", f"index {c!r} has different sizes (broadcasting)")

    def arrange(t, term, order, groups):
        t = prims.permute(t, tuple(term.index(c) for c in order))
        return prims.reshape(t, tuple(math.prod(size[c] for c in g) for g in groups))

    a3 = arrange(a, a_term, batch + left + summed, (batch, left, summed))
    b3 = arrange(b, b_term, batch + summed + right, (batch, summed, right))
    out = prims.matmul(a3, b3)
    term = "".join(batch + left + right)
    return prims.reshape(out, tuple(size[c] for c in term)), term


@torch_op(torch.einsum)
def einsum(*args):
    """`torch.einsum(equation, *operands)` with explicit or implicit output, contracted left to
    right. Operands share one floating dtype."""
    if not args or not isinstance(args[0], str):
        raise _unsupported("einsum", "the sublist form")
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands or not all(isinstance(t, torch.Tensor) for t in operands):
        raise _unsupported("einsum", "operands must be tensors")
    if len({t.dtype for t in operands}) != 1 or not operands[0].dtype.is_floating_point:
        raise _unsupported("einsum", "operands must share a floating dtype")
    terms, rhs = _parse_einsum("einsum", args[0], len(operands))
    for term, t in zip(terms, operands):
        if len(term) != t.ndim:
            raise _unsupported("einsum", f"term {term!r} for a rank-{t.ndim} operand")
    needed_later = [set(rhs).union(*terms[i + 1:]) for i in range(len(terms))]
    out, out_term = _sum_out(operands[0], terms[0], needed_later[0])
    for index in range(1, len(operands)):
        b, b_term = _sum_out(operands[index], terms[index],
                             needed_later[index] | set(out_term))
        keep = needed_later[index]
        out, out_term = _contract(out, out_term, b, b_term, keep)
    out, out_term = _sum_out(out, out_term, set(rhs))
    if out_term != rhs:
        out = prims.permute(out, tuple(out_term.index(c) for c in rhs))
    elif len(operands) == 1 and out is operands[0]:
        out = prims.reshape(out, tuple(out.shape))  # eager returns a new tensor
    return out


# --------------------------------------------------------------------------- convolution


def _expand_arg(op: str, name: str, value, count: int) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * count
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        if len(value) == 1:
            return tuple(value) * count
        if len(value) == count:
            return tuple(value)
    raise _unsupported(op, f"{name}={value!r}")


def _conv(op: str, spatial: int, input, weight, bias, stride, padding, dilation, groups):
    if not isinstance(weight, torch.Tensor) or weight.ndim != spatial + 2:
        raise _unsupported(op, f"weight must be {spatial + 2}-d (eager raises)")
    if input.ndim not in (spatial + 1, spatial + 2):
        raise _unsupported(op, f"input must be {spatial + 1}-d or {spatial + 2}-d")
    if isinstance(padding, str) or not isinstance(groups, int) or groups < 1:
        raise _unsupported(op, f"padding={padding!r} / groups={groups!r}")
    tensors = [input, weight] + ([bias] if bias is not None else [])
    if len({t.dtype for t in tensors}) != 1 or not input.dtype.is_floating_point:
        raise _unsupported(op, "operands must share a floating dtype")
    stride = _expand_arg(op, "stride", stride, spatial)
    padding = _expand_arg(op, "padding", padding, spatial)
    dilation = _expand_arg(op, "dilation", dilation, spatial)
    unbatched = input.ndim == spatial + 1
    if unbatched:
        input = prims.reshape(input, (1, *input.shape))
    if input.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        raise _unsupported(op, "channels do not match groups (eager raises)")
    out = prims.convolution(input, weight, bias, stride, padding, dilation, False,
                            (0,) * spatial, groups)
    if unbatched:
        out = prims.reshape(out, tuple(out.shape[1:]))
    return out


@torch_op(F.conv1d)
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """`F.conv1d` (numeric padding; 'same'/'valid' strings run whole)."""
    return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


@torch_op(F.conv2d)
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """`F.conv2d` (numeric padding; 'same'/'valid' strings run whole)."""
    return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


# --------------------------------------------------------------------------- norms


def _vector_norm(op: str, x, ord, dims, keepdim: bool, dtype):
    """The `ord`-norm of `x` over `dims` (float32 compute for half inputs)."""
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise _unsupported(op, f"dtype={dtype!r}")
        x = to_dtype(x, dtype)
    if not x.dtype.is_floating_point:
        raise _unsupported(op, f"{x.dtype} input (floating inputs are decomposed)")
    if not _real_number(ord):
        raise _unsupported(op, f"ord={ord!r}")
    ord = float(ord)
    reduced_empty = any(x.shape[d] == 0 for d in dims) or (x.ndim == 0 and x.numel() == 0)
    if reduced_empty and ord < 0:
        raise _unsupported(op, "a negative order over an empty dimension (eager raises)")
    if reduced_empty and math.isinf(ord):
        raise _unsupported(op, "an infinite order over an empty dimension (eager raises)")
    out_dtype = x.dtype
    x = to_dtype(x, compute_dtype(x.dtype))
    magnitude = prims.abs(x)
    if ord == math.inf:
        out = prims.amax(magnitude, dims)
    elif ord == -math.inf:
        out = prims.amin(magnitude, dims)
    elif ord == 0:
        out = prims.sum(prims.convert_element_type(prims.ne(x, 0), x.dtype), dims)
    elif ord == 1:
        out = prims.sum(magnitude, dims)
    elif ord == 2:
        out = prims.sqrt(prims.sum(prims.mul(x, x), dims))
    else:
        out = prims.pow(prims.sum(prims.pow(magnitude, ord), dims), 1.0 / ord)
    out = to_dtype(out, out_dtype)
    return restore_dims(out, x.shape, dims) if keepdim else out


@torch_op(torch.linalg.vector_norm)
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    """`torch.linalg.vector_norm`: `sum(|x|^ord)^(1/ord)` over `dim` (all dims by default);
    `ord` may be `inf`, `-inf` or 0 (the count of non-zeros)."""
    if out is not None:
        raise _unsupported("vector_norm", "out=")
    dims = reduction_dims(x, dim, op="vector_norm")
    return _vector_norm("vector_norm", x, ord, dims, keepdim, dtype)


@torch_op(torch.norm, methods=("norm",))
def norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """`torch.norm`: the vector `p`-norm over `dim` ('fro' is the 2-norm); 'nuc' and matrix
    norms of other orders run whole."""
    if out is not None:
        raise _unsupported("norm", "out=")
    if p == "fro" or p is None:
        if dim is not None and not isinstance(dim, int) and len(dim) > 2:
            raise _unsupported("norm", "'fro' over more than two dims (eager raises)")
        p = 2
    if isinstance(p, str):
        raise _unsupported("norm", f"p={p!r}")
    dims = reduction_dims(input, dim, op="norm")
    return _vector_norm("norm", input, p, dims, keepdim, dtype)


@torch_op(F.normalize)
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """`F.normalize`: `x / max(||x||_p, eps)` along `dim`."""
    if out is not None or not _real_number(eps):
        raise _unsupported("normalize", "out= or a non-number eps")
    if not _real_number(p) or not input.dtype.is_floating_point:
        raise _unsupported("normalize", f"p={p!r} or a non-floating input")
    norm_ = vector_norm(input, p, dim, True)
    denom = broadcast_to(prims.maximum(norm_, float(eps)), tuple(input.shape))
    return elementwise(prims.div, input, denom)


# --------------------------------------------------------------------------- rms_norm, group_norm


def _check_normalized_shape(op: str, input, normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, (tuple, list, torch.Size)) or not all(
            isinstance(size, int) for size in normalized_shape):
        raise _unsupported(op, f"normalized_shape={normalized_shape!r}")
    shape = tuple(normalized_shape)
    if not shape or len(shape) > input.ndim or tuple(input.shape[-len(shape):]) != shape:
        raise _unsupported(op, f"normalized_shape {shape} does not match the input (eager raises)")
    return shape


@torch_op(F.rms_norm)
def rms_norm(input, normalized_shape, weight=None, eps=None):
    """`F.rms_norm`: `x / sqrt(mean(x^2) + eps) * weight` over the trailing `normalized_shape`
    dims. As eager's kernel (torch 2.13): `eps` defaults to the machine epsilon of the
    computation's dtype (float32's for half inputs; bfloat16's 2^-7 changed small rows), and
    half inputs compute in float32, the weight included, and round once (rounding before the
    weight was a half-precision ulp off eager's)."""
    shape = _check_normalized_shape("rms_norm", input, normalized_shape)
    if not input.dtype.is_floating_point:
        raise _unsupported("rms_norm", f"{input.dtype} input")
    if eps is None:
        eps = torch.finfo(compute_dtype(input.dtype)).eps
    if not _real_number(eps):
        raise _unsupported("rms_norm", f"eps={eps!r}")
    if weight is not None and (not isinstance(weight, torch.Tensor)
                               or tuple(weight.shape) != shape or weight.dtype != input.dtype):
        raise _unsupported("rms_norm", "weight must have the normalized shape and input dtype")
    if input.numel() == 0:
        return prims.full(tuple(input.shape), 0.0, input.dtype, input.device)
    dims = tuple(range(input.ndim - len(shape), input.ndim))
    x = to_dtype(input, compute_dtype(input.dtype))
    mean_square = prims.div(prims.sum(prims.mul(x, x), dims), math.prod(shape))
    rstd = prims.rsqrt(prims.add(mean_square, float(eps)))
    out = prims.mul(x, expand_reduced(rstd, x.shape, dims))
    if weight is not None:
        out = prims.mul(out, prims.broadcast_in_dim(to_dtype(weight, x.dtype), tuple(x.shape),
                                                    dims))
    return to_dtype(out, input.dtype)


@torch_op(F.group_norm)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-05):
    """`F.group_norm`: channels (dim 1) split into `num_groups` groups, each normalised over
    its channels and all trailing dims (biased variance), then `* weight[c] + bias[c]`."""
    if input.ndim < 2 or not isinstance(num_groups, int) or num_groups < 1:
        raise _unsupported("group_norm", "needs an (N, C, ...) input and a positive num_groups")
    batch, channels = input.shape[0], input.shape[1]
    if channels % num_groups or not input.dtype.is_floating_point or not _real_number(eps):
        raise _unsupported("group_norm", "channels not divisible by groups, or a non-float input")
    for param in (weight, bias):
        if param is not None and (not isinstance(param, torch.Tensor)
                                  or tuple(param.shape) != (channels,)
                                  or param.dtype != input.dtype):
            raise _unsupported("group_norm", "weight/bias must be (C,) of the input dtype")
    if input.numel() == 0:
        raise _unsupported("group_norm", "an empty input")
    x = to_dtype(input, compute_dtype(input.dtype))
    grouped = prims.reshape(x, (batch, num_groups, input.numel() // (batch * num_groups)))
    count = grouped.shape[2]
    mean = prims.div(prims.sum(grouped, (2,)), count)
    centered = prims.sub(grouped, expand_reduced(mean, grouped.shape, (2,)))
    var = prims.div(prims.sum(prims.mul(centered, centered), (2,)), count)
    rstd = prims.rsqrt(prims.add(var, float(eps)))
    out = prims.reshape(prims.mul(centered, expand_reduced(rstd, grouped.shape, (2,))),
                        tuple(x.shape))
    if weight is not None:
        out = prims.mul(out, prims.broadcast_in_dim(to_dtype(weight, x.dtype), tuple(x.shape),
                                                    (1,)))
    if bias is not None:
        out = prims.add(out, prims.broadcast_in_dim(to_dtype(bias, x.dtype), tuple(x.shape),
                                                    (1,)))
    return to_dtype(out, input.dtype)
