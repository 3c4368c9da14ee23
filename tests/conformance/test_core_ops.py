"""Core-op conformance inside `make test`: a fixed list of op_db entries, forward and backward.

Each entry runs up to 3 float32 CPU samples through `fulmen.jit` (torch executor) against
eager, then, if it supports autograd, compares gradients. The full op_db run is
`make conformance` (`tests/conformance/run_conformance.py`).
"""

import functools

import pytest
from torch.testing._internal.common_methods_invocations import op_db

from tests.conformance.run_conformance import opinfo_name, run_one, seed_outside_ops

CORE_OPS = [
    # elementwise, unary
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "deg2rad",
    "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "lgamma", "log",
    "log10", "log1p", "log2", "logit", "nan_to_num", "neg", "positive", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh", "trunc",
    # elementwise, binary and ternary
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "div.trunc_rounding",
    "true_divide", "remainder", "fmod", "pow", "float_power", "maximum", "minimum", "atan2",
    "copysign", "lerp", "addcmul", "addcdiv", "clamp", "clamp_min", "clamp_max", "where",
    "masked_fill", "hypot", "logaddexp", "xlogy", "eq", "ne", "lt", "le", "gt", "ge", "isnan",
    "isinf", "isfinite", "logical_and", "logical_not", "logical_or",
    # reductions
    "sum", "mean", "prod", "amax", "amin", "max.reduction_with_dim", "min.reduction_with_dim",
    "max.reduction_no_dim", "argmax", "argmin", "var", "std", "var_mean", "std_mean", "all",
    "any", "logsumexp", "norm", "linalg.vector_norm", "cumsum", "cumprod", "topk", "sort",
    "nansum",
    # shape and indexing
    "reshape", "view", "view_as", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
    "transpose", "t", "expand", "expand_as", "broadcast_to", "repeat", "tile", "flip", "roll",
    "movedim", "narrow_copy", "select", "chunk", "split", "split_with_sizes", "unbind", "cat",
    "stack", "hstack", "vstack", "tril", "triu", "gather", "index_select", "scatter",
    "scatter_add", "index_put", "index_add", "take_along_dim", "__getitem__", "diagonal",
    "contiguous", "clone",
    # creation
    "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "arange",
    "linspace", "eye", "zeros", "ones", "full",
    # contractions
    "matmul", "mm", "bmm", "baddbmm", "addmm", "addmv", "outer", "einsum", "mv", "dot",
    # nn
    "nn.functional.linear", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
    "nn.functional.mish", "nn.functional.softplus", "nn.functional.hardtanh",
    "nn.functional.leaky_relu", "nn.functional.elu", "nn.functional.glu", "softmax",
    "log_softmax", "nn.functional.layer_norm", "nn.functional.rms_norm",
    "nn.functional.group_norm", "nn.functional.normalize", "nn.functional.embedding",
    "nn.functional.dropout", "nn.functional.mse_loss", "nn.functional.cross_entropy",
    "nn.functional.nll_loss", "nn.functional.scaled_dot_product_attention",
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.pad.constant",
    "nn.functional.interpolate.nearest", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d",
]  # fmt: skip


@functools.cache
def _infos() -> dict:
    seed_outside_ops()
    return {opinfo_name(info): info for info in op_db}


def test_core_list_is_large_and_known():
    assert len(set(CORE_OPS)) == len(CORE_OPS) >= 150
    unknown = [name for name in CORE_OPS if name not in _infos()]
    assert not unknown, f"not in op_db: {unknown}"


@pytest.mark.parametrize("name", CORE_OPS)
def test_core_op(name):
    info = _infos()[name]
    row = run_one(info, 3, grads=True)
    assert row.forward == "pass", f"{name}: forward {row.forward}: {row.note}"
    assert row.backward in ("pass", "skip", "-"), f"{name}: backward {row.backward}: {row.grad_note}"
