"""The CPU target: C++17 compiled by the system compiler (`compiler.py`), one OpenMP kernel.

float16/bfloat16 are stored as such and computed in float32; bool elements are bytes (0/1):
GCC 12 vectorises no loop that loads a C++ `bool` ("no vectype"), so every kernel with a mask
input (attention, where, dropout) ran scalar. float exp and erf are the vectorisable
polynomials of the prelude (`include/cpu.h`, which states their ulp bounds); float -> integer
conversions give eager's x86-64 results through the prelude's `f_to_i64`/`f_to_i32` (the plain
C++ cast of an out-of-range value is undefined behaviour). No flag changes IEEE semantics.
"""

from __future__ import annotations

import torch

from fulmen.executors.codegen.target import Target, c_types, header

__all__ = ["CPU", "CppTarget", "PRELUDE"]

PRELUDE = header("cpu.h")

# float -> integer conversions (see f_to_i64 in the prelude)
_FLOAT_TO_INT = {
    torch.int64: "f_to_i64({a})", torch.int32: "f_to_i32({a})",
    torch.int16: "(int16_t)f_to_i32({a})", torch.int8: "(int8_t)f_to_i32({a})",
    torch.uint8: "(uint8_t)f_to_i64({a})",
}  # fmt: skip


class CppTarget(Target):
    """C++ for CPU tensors (see the module docstring)."""

    name = "cpu"
    device_type = "cpu"
    storage = c_types("_Float16", "uint16_t", "float", "double", "int8_t", "int16_t", "int32_t",
                      "int64_t", "uint8_t", "uint8_t")
    compute = {**storage, torch.float16: "float", torch.bfloat16: "float", torch.bool: "bool"}
    loads = {torch.bfloat16: "bf16_load({})", torch.float16: "(float)({})",
             torch.bool: "({} != 0)"}  # fmt: skip
    stores = {torch.bfloat16: "bf16_store({})", torch.float16: "(_Float16)({})",
              torch.bool: "(uint8_t)({})"}  # fmt: skip
    rounds = {torch.bfloat16: "bf16_round({})", torch.float16: "f16_round({})"}
    helper = "f_"
    math_names = {"round": "nearbyint"}
    int64_min = "std::numeric_limits<int64_t>::min()"
    selects = True
    scalars = True

    def nan(self, dtype: torch.dtype) -> str:
        return f"std::numeric_limits<{self.compute[dtype]}>::quiet_NaN()"

    def infinity(self, dtype: torch.dtype, negative: bool) -> str:
        return f"{'-' if negative else ''}std::numeric_limits<{self.compute[dtype]}>::infinity()"

    def float_literal(self, value: float, dtype: torch.dtype) -> str:
        ctype = self.compute[dtype]
        return f"{ctype}({value.hex()})" if ctype == "double" else f"{value.hex()}f"

    def int_literal(self, value: int, dtype: torch.dtype) -> str:
        return f"{self.compute[dtype]}({value}LL)"

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        return f"({self.compute[dtype]})({expr})"

    def math(self, name: str, dtype: torch.dtype) -> str:
        if name in ("exp", "erf", "tanh") and self.compute[dtype] == "float":
            return f"f_{name}"  # the prelude's vectorisable polynomials
        return f"std::{self.math_names.get(name, name)}"

    def cast_value(self, a: str, src: torch.dtype, dst: torch.dtype) -> str:
        if src == torch.bool:  # a select: GCC 12 does not vectorise bool -> float casts
            return f"({a} ? {self.literal(1, dst)} : {self.literal(0, dst)})"
        if src.is_floating_point and dst in _FLOAT_TO_INT:
            return _FLOAT_TO_INT[dst].format(a=a)
        return f"({self.compute[dst]})({a})"


CPU = CppTarget()
