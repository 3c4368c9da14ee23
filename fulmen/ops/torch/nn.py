"""Neural-network torch-level ops: matmul and linear, activations (relu, gelu, silu), softmax and
log_softmax, layer_norm, embedding and dropout.

Ops with both a `torch.*` and a `torch.nn.functional.*` spelling of different signatures
(`torch.relu(x)` vs `F.relu(x, inplace=False)`) are two symbols, since the torch executor calls
the canonical callable with the recorded arguments. float16/bfloat16 inputs compute in float32
and convert back, as eager's kernels do. Argument combinations a decomposition does not cover
(or eager rejects) raise `NotYetSupportedError`, so the tracer runs the op whole.

NOTE [mutating arguments]: `inplace=True` and `F.embedding(max_norm=...)` (which renormalises
the weight in place) raise a plain `FulmenError`, not `NotYetSupportedError`: the latter makes
the tracer record the op as an opaque op, whose mutation the trace does not see (dead-code
elimination drops it when its output is unused), which would be a silent wrong answer.

NOTE [stable softmax]: softmax and log_softmax subtract the row maximum before `exp`, like eager;
a row of all `-inf` gives NaN in both.
"""

from __future__ import annotations

import math
import warnings
from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.reductions import compute_dtype, expand_reduced, reduction_dims
from fulmen.ops.torch.utils import exp_saturating, to_dtype
from fulmen.proxies.tensor import row_major

T = torch.Tensor


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _check_inplace(op: str, inplace: bool) -> None:
    if inplace:  # see NOTE [mutating arguments]
        raise FulmenError(
            "inplace=True is not supported yet while tracing",
            op=f"ltorch.{op}",
            hint="use the out-of-place form (inplace=False)",
        )


def _check_floating(op: str, a: torch.Tensor) -> None:
    if not a.dtype.is_floating_point:
        raise _unsupported(op, f"{a.dtype} input (eager needs a floating dtype here)")


# --------------------------------------------------------------------------- matmul, linear


def _check_matmul(op: str, a, b, ranks=None) -> None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise _unsupported(op, "operands must be tensors")
    if a.dtype != b.dtype:
        raise _unsupported(op, f"dtypes differ: {a.dtype} vs {b.dtype} (eager raises)")
    if a.ndim == 0 or b.ndim == 0:
        raise _unsupported(op, "0-d operands (eager raises)")
    if ranks is not None and (a.ndim != ranks or b.ndim != ranks):
        raise _unsupported(op, f"operands must be {ranks}-d (eager raises)")


@torch_op(torch.matmul, methods=("matmul", "__matmul__"))
def matmul(input, other):
    """`torch.matmul` / `a @ b`: matrix products with broadcast batch dims."""
    _check_matmul("matmul", input, other)
    return prims.matmul(input, other)


@torch_op(T.__rmatmul__, name="rmatmul")
def rmatmul(self, other):
    """`other @ self` with `self` a tensor (the reflected `@`)."""
    _check_matmul("rmatmul", other, self)
    return prims.matmul(other, self)


@torch_op(torch.mm, methods=("mm",))
def mm(input, mat2):
    """`torch.mm`: the product of two matrices."""
    _check_matmul("mm", input, mat2, ranks=2)
    return prims.matmul(input, mat2)


@torch_op(torch.bmm, methods=("bmm",))
def bmm(input, mat2):
    """`torch.bmm`: batched matrix products of two 3-d tensors."""
    _check_matmul("bmm", input, mat2, ranks=3)
    if input.shape[0] != mat2.shape[0]:
        raise _unsupported("bmm", "batch sizes differ (eager raises)")
    return prims.matmul(input, mat2)


@torch_op(F.linear)
def linear(input, weight, bias=None):
    """`F.linear`: `input @ weight.T + bias`."""
    tensors = [input, weight] + ([bias] if bias is not None else [])
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise _unsupported("linear", "operands must be tensors")
    if len({t.dtype for t in tensors}) != 1:
        raise _unsupported("linear", "operand dtypes differ (eager raises)")
    return prims.linear(input, weight, bias)


# --------------------------------------------------------------------------- activations


def _relu(op: str, a):
    if a.dtype == torch.bool:
        raise _unsupported(op, "bool input (eager raises)")
    if not a.dtype.is_floating_point:
        return prims.maximum(a, 0)
    # NOTE [relu at zero]: not `maximum(a, 0)` alone, whose tie rule gives half the cotangent
    # at exactly 0 under prim-level autodiff (`decompose_to_prims` before the split), where
    # eager's `threshold_backward` gives none (an fp16 batch norm of three values can make an
    # exact 0). At or below 0, `maximum(a, 0) * 0`: eager's value (+0, -0.0 kept) with no
    # gradient; above 0 and NaN, `a` itself (NaN propagates, its gradient passes as eager's).
    return prims.where(prims.le(a, 0), prims.mul(prims.maximum(a, 0), 0), a)


@torch_op(torch.relu, methods=("relu",))
def relu(input):
    """`torch.relu`: `max(x, 0)`, NaN propagating."""
    return _relu("relu", input)


@torch_op(F.relu, name="functional_relu")
def functional_relu(input, inplace=False):
    """`F.relu`; `inplace=True` is not supported yet."""
    _check_inplace("functional_relu", inplace)
    return _relu("functional_relu", input)


@torch_op(F.gelu)
def gelu(input, approximate="none"):
    """`F.gelu`: `x/2 * (1 + erf(x/sqrt(2)))`, or the tanh approximation
    `x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))` with `approximate="tanh"`."""
    _check_floating("gelu", input)
    x = to_dtype(input, compute_dtype(input.dtype))
    if approximate == "none":
        inner = prims.erf(prims.mul(x, math.sqrt(0.5)))
    elif approximate == "tanh":
        cube = prims.mul(prims.mul(x, x), x)
        inner = prims.mul(prims.add(x, prims.mul(cube, 0.044715)), math.sqrt(2 / math.pi))
        inner = prims.tanh(inner)
    else:
        raise _unsupported("gelu", f"approximate={approximate!r} (eager raises)")
    out = prims.mul(prims.mul(x, 0.5), prims.add(inner, 1))
    return to_dtype(out, input.dtype)


@torch_op(torch.ops.aten.gelu_backward.default)
def gelu_backward(grad_output, input, approximate="none"):
    """The gradient of `F.gelu` (`aten.gelu_backward`, what gelu's VJP rule calls): with
    approximate="none", `g * (cdf(x) + x * pdf(x))`, cdf(x) = (1 + erf(x/sqrt(2)))/2 and
    pdf(x) = exp(-x^2/2)/sqrt(2 pi); with "tanh", the derivative of the tanh form. Computed in
    float32 for half inputs, as eager's kernel. The torch executor runs eager's fused kernel; a
    fusion executor fuses these prims (with the gelu recomputed for the backward, if any)."""
    _check_floating("gelu_backward", input)
    dtype = compute_dtype(input.dtype)
    x, g = to_dtype(input, dtype), to_dtype(grad_output, dtype)
    if approximate == "none":
        cdf = prims.mul(prims.add(prims.erf(prims.mul(x, math.sqrt(0.5))), 1), 0.5)
        pdf = prims.mul(prims.exp(prims.mul(prims.mul(x, x), -0.5)), 1 / math.sqrt(2 * math.pi))
        slope = prims.add(cdf, prims.mul(x, pdf))
    elif approximate == "tanh":
        beta, kappa = math.sqrt(2 / math.pi), 0.044715
        square = prims.mul(x, x)
        inner = prims.mul(prims.add(x, prims.mul(prims.mul(square, x), kappa)), beta)
        tanh = prims.tanh(inner)
        left = prims.mul(x, 0.5)
        right = prims.add(tanh, 1)
        tanh_slope = prims.sub(1, prims.mul(tanh, tanh))
        inner_slope = prims.mul(prims.add(prims.mul(square, 3 * kappa), 1), beta)
        slope = prims.add(prims.mul(right, 0.5),
                          prims.mul(prims.mul(left, tanh_slope), inner_slope))
    else:
        raise _unsupported("gelu_backward", f"approximate={approximate!r} (eager raises)")
    return to_dtype(prims.mul(g, slope), grad_output.dtype)


@torch_op(F.silu)
def silu(input, inplace=False):
    """`F.silu`: `x * sigmoid(x)`, computed as `x / (1 + exp(-x))` (`exp` saturating: NOTE
    [exp past overflow] in utils.py)."""
    _check_inplace("silu", inplace)
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        raise _unsupported("silu", f"{input.dtype} input (eager needs floating or complex)")
    x = to_dtype(input, compute_dtype(input.dtype))
    out = prims.div(x, prims.add(exp_saturating(prims.neg(x)), 1))
    return to_dtype(out, input.dtype)


@torch_op(torch.ops.aten.silu_backward.default)
def silu_backward(grad_output, input):
    """The gradient of `F.silu` (`aten.silu_backward`, what silu's VJP rule calls), as eager's
    CPU kernel computes it: with s = 1 / (1 + exp(-x)), `g * s * (1 + x * (1 - s))`, in
    float32 for half inputs. The torch executor runs eager's kernel; a fusion executor fuses
    these prims with the silu the backward recomputes (a SwiGLU MLP's gate)."""
    _check_floating("silu_backward", input)
    dtype = compute_dtype(input.dtype)
    x, g = to_dtype(input, dtype), to_dtype(grad_output, dtype)
    sigmoid = prims.reciprocal(prims.add(exp_saturating(prims.neg(x)), 1))
    slope = prims.add(prims.mul(x, prims.sub(1, sigmoid)), 1)
    return to_dtype(prims.mul(prims.mul(g, sigmoid), slope), grad_output.dtype)


# --------------------------------------------------------------------------- softmax


def _softmax(op: str, a, dim, dtype, *, log: bool):
    """Stable (log-)softmax along `dim`; see NOTE [stable softmax]."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise _unsupported(op, f"dim={dim!r}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise _unsupported(op, f"dtype={dtype!r}")
        a = to_dtype(a, dtype)
    _check_floating(op, a)
    dims = reduction_dims(a, dim, op=op)
    if a.numel() == 0:  # nothing to normalise (and amax cannot reduce an empty dim)
        return prims.full(tuple(a.shape), 0.0, a.dtype, a.device)
    x = to_dtype(a, compute_dtype(a.dtype))
    top = expand_reduced(prims.amax(x, dims), x.shape, dims)
    shifted = prims.sub(x, top)
    exps = prims.exp(shifted)
    if log:
        total = expand_reduced(prims.sum(exps, dims), x.shape, dims)
        out = prims.sub(shifted, prims.log(total))
    else:  # times the reciprocal of the sum, as eager's CPU kernel: one division per row
        total = prims.reciprocal(prims.sum(exps, dims))
        out = prims.mul(exps, expand_reduced(total, x.shape, dims))
    return to_dtype(out, a.dtype)


def _implicit_softmax_dim(name: str, ndim: int, stacklevel: int) -> int:
    """The dim `F.softmax(x)` picks when none is given (deprecated in eager, with a warning)."""
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. "
        "Change the call to include dim=X as an argument.",
        stacklevel=stacklevel,
    )
    return 0 if ndim in (0, 1, 3) else 1


@torch_op(torch.softmax, torch.special.softmax, methods=("softmax",))
def softmax(input, dim, dtype=None):
    """`torch.softmax`: `exp(x - max) * (1 / sum(exp(x - max)))` along `dim`, after converting
    to `dtype` if given."""
    return _softmax("softmax", input, dim, dtype, log=False)


@torch_op(torch.log_softmax, torch.special.log_softmax, methods=("log_softmax",))
def log_softmax(input, dim, dtype=None):
    """`torch.log_softmax`: `(x - max) - log(sum(exp(x - max)))` along `dim`."""
    return _softmax("log_softmax", input, dim, dtype, log=True)


@torch_op(F.softmax, name="functional_softmax")
def functional_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """`F.softmax` (a missing `dim` is chosen as eager does, with its deprecation warning)."""
    if dim is None:
        dim = _implicit_softmax_dim("softmax", input.ndim, _stacklevel)
    return _softmax("functional_softmax", input, dim, dtype, log=False)


@torch_op(F.log_softmax, name="functional_log_softmax")
def functional_log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """`F.log_softmax` (a missing `dim` is chosen as eager does)."""
    if dim is None:
        dim = _implicit_softmax_dim("log_softmax", input.ndim, _stacklevel)
    return _softmax("functional_log_softmax", input, dim, dtype, log=True)


# --------------------------------------------------------------------------- layer_norm


@torch_op(F.layer_norm)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05):
    """`F.layer_norm` over the trailing `normalized_shape` dims: `(x - mean) / sqrt(var + eps)`
    (biased variance), times `weight`, plus `bias`. Half inputs compute in float32."""
    if not isinstance(normalized_shape, (tuple, list, torch.Size)) or not all(
        isinstance(size, int) for size in normalized_shape
    ):
        raise _unsupported(
            "layer_norm", f"normalized_shape={normalized_shape!r} (eager wants a sequence of ints)"
        )
    normalized_shape = tuple(normalized_shape)
    count = len(normalized_shape)
    if count == 0 or count > input.ndim or tuple(input.shape[-count:]) != normalized_shape:
        raise _unsupported(
            "layer_norm",
            f"normalized_shape {normalized_shape} does not match "
            f"the input's trailing dims {tuple(input.shape)} (eager raises)",
        )
    _check_floating("layer_norm", input)
    if not isinstance(eps, Number) or isinstance(eps, complex):
        raise _unsupported("layer_norm", f"eps={eps!r}")
    for param in (weight, bias):
        if param is None:
            continue
        if not isinstance(param, torch.Tensor) or tuple(param.shape) != normalized_shape:
            raise _unsupported("layer_norm", "weight/bias must have the normalized shape")
        if param.dtype != input.dtype:
            raise _unsupported("layer_norm", "mixed input/weight dtypes")

    dims = tuple(range(input.ndim - count, input.ndim))
    if input.numel() == 0:
        return prims.full(tuple(input.shape), 0.0, input.dtype, input.device)
    elements = math.prod(normalized_shape)
    x = to_dtype(input, compute_dtype(input.dtype))
    mean = prims.div(prims.sum(x, dims), elements)
    centered = prims.sub(x, expand_reduced(mean, x.shape, dims))
    var = prims.div(prims.sum(prims.mul(centered, centered), dims), elements)
    if input.device.type == "cpu" and (elements <= 8 or elements % 8 == 0):
        # eager's CPU kernel merges the moments of 8 vector lanes (AVX2), and merging an empty
        # lane makes the variance NaN where the square of the row mean overflows (a row
        # [1e20, 1]); the centred sum gives inf there, so an output of 0. Measured for rows of
        # up to 8 elements and multiples of 8 (other lengths leave no lane empty at the end).
        var = prims.where(prims.isinf(prims.mul(mean, mean)), math.nan, var)
    rstd = prims.rsqrt(prims.add(var, eps))
    out = prims.mul(centered, expand_reduced(rstd, x.shape, dims))
    if weight is not None:
        w = to_dtype(weight, x.dtype)
        out = prims.mul(out, prims.broadcast_in_dim(w, tuple(x.shape), dims))
    if bias is not None:
        b = to_dtype(bias, x.dtype)
        out = prims.add(out, prims.broadcast_in_dim(b, tuple(x.shape), dims))
    return to_dtype(out, input.dtype)


# --------------------------------------------------------------------------- embedding, dropout


@torch_op(F.embedding)
def embedding(
    input,
    weight,
    padding_idx=None,
    max_norm=None,
    norm_type=2.0,
    scale_grad_by_freq=False,
    sparse=False,
):
    """`F.embedding`: rows of `weight` picked by `input`. `padding_idx`, `scale_grad_by_freq`
    and `sparse` only affect gradients; `max_norm` renormalises `weight` in place and is not
    supported yet."""
    if max_norm is not None:  # see NOTE [mutating arguments]
        raise FulmenError(
            "max_norm (which renormalises the weight in place) is not supported yet while tracing",
            op="ltorch.embedding",
            hint="renormalise the weight outside the compiled function",
        )
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise _unsupported("embedding", "weight must be a 2-d tensor (eager raises)")
    if input.dtype not in (torch.int32, torch.int64):
        raise _unsupported("embedding", f"{input.dtype} indices (eager needs int32/int64)")
    if padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        raise _unsupported("embedding", "padding_idx out of range (eager raises)")
    return prims.embedding(input, weight)


def _dropout(op: str, a, p, training: bool):
    if isinstance(p, torch.Tensor) or not 0.0 <= p <= 1.0:
        raise _unsupported(op, f"dropout probability {p!r} (eager raises)")
    if not training or p == 0 or a.numel() == 0:
        return a  # eager returns the input tensor itself
    if p == 1:
        return prims.mul(a, 0.0)
    # As eager's CPU kernel: a mask from `bernoulli_(1 - p)`, scaled by 1 / (1 - p), times the
    # input, in the input's dtype. The mask is an ordinary value, so backward reuses it.
    keep = 1.0 - float(p)
    mask = prims.bernoulli(tuple(a.shape), keep, a.dtype, a.device, _like_strides(a))
    return prims.mul(a, prims.div(mask, keep))


def _like_strides(a) -> tuple[int, ...] | None:
    """The strides of eager's `torch.empty_like(a)` (a permuted dense input keeps its own), or
    None where that is contiguous. With symbolic sizes: `a`'s own strides where it is known to
    be non-overlapping and dense without being row-major (the transposed output of an
    attention block, whose dropout mask eager draws in that memory order); None (row-major)
    otherwise, which differs from eager's draw only for an input with gaps or overlaps."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    with torch._C.DisableTorchFunctionSubclass():  # fulmen's own read, not the user's
        shape, strides = tuple(a.shape), tuple(a.stride())
        if not all(type(n) is int for n in (*shape, *strides)):  # (asks no guard)
            # row-major first: PyTorch's density check asks whether a batch of 1 traced with
            # a symbol is 1, which specialises it (GPT-2's dropout on `(s0, s1, 32)` hidden
            # states pinned the batch: a length x batch training sweep compiled 3 times)
            if row_major(a) is not False:
                return None
            return strides if is_non_overlapping_and_dense_or_false(a) else None
    like = torch.empty_like(torch.empty_strided(shape, strides, dtype=a.dtype, device="meta"))
    return None if like.is_contiguous() else tuple(like.stride())


@torch_op(F.dropout)
def dropout(input, p=0.5, training=True, inplace=False):
    """`F.dropout`: the input itself when not training or `p == 0`; otherwise the input times a
    scaled `prims.bernoulli` mask drawn from torch's global generator exactly as eager does."""
    _check_inplace("dropout", inplace)
    return _dropout("dropout", input, p, training)


@torch_op(torch.dropout, name="torch_dropout")
def torch_dropout(input, p, train):
    """`torch.dropout(input, p, train)`: as `F.dropout`."""
    return _dropout("torch_dropout", input, p, train)
