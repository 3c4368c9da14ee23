"""Elementwise torch-level ops: arithmetic, math, comparisons, `where`, `clamp`, conversions."""

from __future__ import annotations

import torch

from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.utils import Promotion, elementwise, is_number

T = torch.Tensor


@torch_op(torch.add, methods=("add", "__add__", "__radd__"))
def add(input, other, *, alpha=1):
    if alpha != 1:
        other = mul(other, alpha) if isinstance(other, torch.Tensor) else other * alpha
    return elementwise(prims.add, input, other)


@torch_op(torch.sub, torch.subtract, methods=("sub", "subtract", "__sub__"))
def sub(input, other, *, alpha=1):
    if alpha != 1:
        other = mul(other, alpha) if isinstance(other, torch.Tensor) else other * alpha
    return elementwise(prims.sub, input, other)


@torch_op(torch.mul, torch.multiply, methods=("mul", "multiply", "__mul__", "__rmul__"))
def mul(input, other):
    return elementwise(prims.mul, input, other)


@torch_op(torch.div, torch.divide, torch.true_divide,
          methods=("div", "divide", "true_divide", "__truediv__"))
def div(input, other, *, rounding_mode=None):
    if rounding_mode is None:
        return elementwise(prims.div, input, other, kind=Promotion.INT_TO_FLOAT)
    prim = {"trunc": prims.trunc_div, "floor": prims.floor_div}[rounding_mode]
    return elementwise(prim, input, other)
