"""The CUDA target: CUDA C++ compiled by NVRTC (`nvrtc.py`).

float16/bfloat16 are stored as `__half`/`__nv_bfloat16` (their headers are included only by
kernels that touch them: `needs_headers`) and computed in float32, rounded to their dtype after
each op as eager does. Literals avoid the host headers NVRTC lacks (`FM_INF_F`, bit casts for
NaN). Conversions follow eager's CUDA casts: the hardware's saturating float -> integer
conversion, uint8 through int64 as c10 does. The prelude is `include/cuda.h` (helpers `fm_*`).
"""

from __future__ import annotations

import torch

from fulmen.executors.codegen.cuda import nvrtc
from fulmen.executors.codegen.ir import Op
from fulmen.executors.codegen.target import Target, c_types, header

__all__ = ["CUDA", "CudaTarget", "needs_headers", "prelude"]


class CudaTarget(Target):
    """CUDA C++ for CUDA tensors (see the module docstring)."""

    name = "cuda"
    device_type = "cuda"
    storage = c_types("__half", "__nv_bfloat16", "float", "double", "signed char", "short", "int",
                      "long long", "unsigned char", "bool")
    compute = {**storage, torch.float16: "float", torch.bfloat16: "float"}
    loads = {torch.float16: "__half2float({})", torch.bfloat16: "__bfloat162float({})"}
    stores = {torch.float16: "__float2half_rn({})", torch.bfloat16: "__float2bfloat16_rn({})"}
    rounds = {torch.float16: "fm_f16_round({})", torch.bfloat16: "fm_bf16_round({})"}
    helper = "fm_"
    math_names = {"abs": "fabs", "round": "rint"}
    overrides = {("isinf", "float"): "fm_isinf({a})", ("isfinite", "float"): "fm_isfinite({a})"}
    int64_min = "(-9223372036854775807LL - 1LL)"

    def available(self) -> bool:
        return nvrtc.available()

    def nan(self, dtype: torch.dtype) -> str:
        if dtype == torch.float64:
            return "__longlong_as_double(0x7ff8000000000000LL)"
        return "__int_as_float(0x7fc00000)"

    def infinity(self, dtype: torch.dtype, negative: bool) -> str:
        name = "FM_INF_D" if dtype == torch.float64 else "FM_INF_F"
        return f"({'-' if negative else ''}{name})"

    def float_literal(self, value: float, dtype: torch.dtype) -> str:
        return f"({value.hex()})" if dtype == torch.float64 else f"({value.hex()}f)"

    def int_literal(self, value: int, dtype: torch.dtype) -> str:
        return f"(({self.compute[dtype]}){value}LL)"

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        return f"(({self.compute[dtype]}){expr})"

    def math(self, name: str, dtype: torch.dtype) -> str:
        name = self.math_names.get(name, name)
        return name if dtype == torch.float64 else f"{name}f"

    def cast_value(self, a: str, src: torch.dtype, dst: torch.dtype) -> str:
        if dst == torch.uint8 and src.is_floating_point:
            return f"((unsigned char)(long long){a})"  # through int64, as c10's cast to uint8
        return f"(({self.compute[dst]}){a})"

    def pow(self, kernel, op: Op, a: str, b: str) -> str | None:
        base = kernel.values[op.args[0]].dtype
        if kernel.values[op.args[1]].dtype != base:
            # a float64 number exponent of a float32 base (`lower.number_dtype`): eager's CUDA
            # kernel reads the exponent as the base's type, unlike its CPU kernel
            return f"{self.math('pow', base)}({a}, ({self.compute[base]}){b})"
        return None


CUDA = CudaTarget()


def needs_headers(kernel) -> tuple[bool, bool]:
    """Whether `kernel` touches float16, bfloat16 (and so includes their headers)."""
    dtypes = {v.dtype for v in kernel.values} | set(kernel.access_dtypes)
    dtypes |= {op.params[0] for op in kernel.values if isinstance(op, Op) and op.params
               and isinstance(op.params[0], torch.dtype)}
    return torch.float16 in dtypes, torch.bfloat16 in dtypes


def prelude(half: bool, bfloat: bool) -> str:
    """The helpers every kernel uses, plus the float16/bfloat16 headers when asked for."""
    return ((header("cuda_half.h") if half else "") + (header("cuda_bfloat.h") if bfloat else "")
            + header("cuda.h"))
