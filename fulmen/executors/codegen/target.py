"""A rendering target: how kernel IR values are spelled in one dialect of C (CPU C++, CUDA C++).

`Target` holds what renderers of every schedule ask a target: the storage type of each dtype
(how its elements sit in memory) and its compute type, literals, how a stored element is loaded
and stored, how a float16/bfloat16 result is rounded to its dtype (as eager rounds after each
op), inner index expressions, and the spelling of each op (`expr`), from the common spellings of
the op table (`ops.py`) plus this target's `overrides`. A subclass sets the tables and the few
hooks where its dialect differs (`cpu/target.py`, `cuda/target.py`); `spells(name, dtype)` is
what fusibility asks, so a target fuses exactly what it renders.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources

import torch

from fulmen.executors.codegen.ir import ColumnReduce, Const, Op, Reduce
from fulmen.executors.codegen.ops import MATH, OPS, POW_CONSTANT, Unsupported, dtype_class

__all__ = ["DTYPES", "Target", "c_types", "constant_exponent", "header", "live_values",
           "op_reads"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool)  # every dtype a kernel handles


def c_types(*names: str) -> dict[torch.dtype, str]:
    """`{dtype: C type name}` for the dtypes of `DTYPES`, named in that order."""
    return dict(zip(DTYPES, names, strict=True))


@cache
def header(name: str) -> str:
    """The text of the package header `include/<name>` (a prelude rendered kernels start with).

    Example:
        >>> header("cpu.h").splitlines()[1]
        '#include <cmath>'
    """
    return (resources.files("fulmen.executors.codegen") / "include" / name).read_text()


class Target:
    """The dialect of one device type (see the module docstring). Subclasses set the tables
    below and implement the literal hooks and `cast_value`."""

    name = "target"
    device_type = ""
    storage: dict[torch.dtype, str] = {}  # C type of a dtype's elements in memory
    compute: dict[torch.dtype, str] = {}  # C type values of a dtype are computed in
    loads: dict[torch.dtype, str] = {}  # stored element -> compute value, where not the same
    stores: dict[torch.dtype, str] = {}  # compute value -> stored element, where not the same
    rounds: dict[torch.dtype, str] = {}  # compute value rounded to its (low-precision) dtype
    helper = ""  # prefix of the prelude's helpers (`{h}` in spellings)
    math_names: dict[str, str] = {}  # op name -> math function name, where they differ
    overrides: dict[tuple[str, str], str] = {}  # (op, dtype class) -> this target's spelling
    unfusible: frozenset[tuple[str, str]] = frozenset()  # (op, dtype class) not rendered here
    selects = False  # whether its pointwise renderer and runtime take masked loads (pad, cat)
    scalars = False  # whether its pointwise kernels take run-time floats as arguments (`Scalar`)

    def available(self) -> bool:
        """Whether kernels of this target can be built in this process at all."""
        return True

    # --- values ---------------------------------------------------------------------------

    def literal(self, value, dtype: torch.dtype) -> str:
        """A literal of `value` in the compute type of `dtype`."""
        if dtype == torch.bool:
            return "true" if value else "false"
        if dtype.is_floating_point:
            value = float(value)
            if math.isnan(value):
                return self.nan(dtype)
            if math.isinf(value):
                return self.infinity(dtype, value < 0)
            return self.float_literal(value, dtype)
        value = int(value)
        if value == -(2**63):
            return self.int64_min
        return self.int_literal(value, dtype)

    int64_min = ""

    def nan(self, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def infinity(self, dtype: torch.dtype, negative: bool) -> str:
        raise NotImplementedError

    def float_literal(self, value: float, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def int_literal(self, value: int, dtype: torch.dtype) -> str:
        raise NotImplementedError

    def load(self, expr: str, dtype: torch.dtype) -> str:
        """The compute value of the stored element `expr` of `dtype`."""
        return self.loads.get(dtype, "{}").format(expr)

    def store(self, expr: str, dtype: torch.dtype) -> str:
        """The stored element of `dtype` for the compute value `expr`."""
        return self.stores.get(dtype, "{}").format(expr)

    def round(self, expr: str, dtype: torch.dtype) -> str:
        """The compute value `expr` of a `dtype` result, rounded to `dtype` (float16/bfloat16)."""
        return self.rounds.get(dtype, "{}").format(expr)

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        """`expr` as the compute type of `dtype`."""
        raise NotImplementedError

    def value(self, kernel, op: Op, names: list[str]) -> str:
        """The right-hand side computing `op`: its expression cast to the compute type of its
        dtype and rounded to the dtype."""
        return self.round(self.cast(self.expr(kernel, op, names), op.dtype), op.dtype)

    @staticmethod
    def index(kind: int, p: int) -> str:
        """The inner index expression of pointer p of inner-stride class `kind` (1 contiguous:
        j, 0 broadcast: 0, 2 any: j times its stride s<p>)."""
        return {0: "0", 1: "j"}.get(kind, f"j * s{p}")

    # --- op spellings ---------------------------------------------------------------------

    def math(self, name: str, dtype: torch.dtype) -> str:
        """The math-library function computing op `name` on the compute type of `dtype`."""
        raise NotImplementedError

    def template(self, name: str, dtype: torch.dtype) -> str | None:
        """The spelling of op `name` on operands of `dtype` (None: not rendered here)."""
        cls = dtype_class(dtype)
        if (name, cls) in self.unfusible:
            return None
        spelling = self.overrides.get((name, cls))
        if spelling is None:
            op = OPS.get(name)
            spelling = op.spelling(cls) if op is not None else None
        if spelling == MATH:
            fn = self.math(name, dtype)
            spelling = f"{fn}({{a}})" if OPS[name].arity == 1 else f"{fn}({{a}}, {{b}})"
        return spelling

    def spells(self, name: str, dtype: torch.dtype) -> bool:
        """Whether this target renders op `name` on operands of `dtype` (what fusibility asks)."""
        if name == "convert_element_type":
            return True
        return self.template(name, dtype) is not None

    def convert(self, a: str, src: torch.dtype, dst: torch.dtype) -> str:
        """`a` (a value of `src`) converted to `dst` as eager converts on this device."""
        if dst == torch.bool:
            return f"({a} != 0)"
        return self.cast_value(a, src, dst)

    def cast_value(self, a: str, src: torch.dtype, dst: torch.dtype) -> str:
        raise NotImplementedError

    def pow(self, kernel, op: Op, a: str, b: str) -> str | None:
        """A target's own spelling of `pow` for this call, or None for the common one."""
        return None

    def expr(self, kernel, op: Op, names: list[str]) -> str:
        """The expression computing `op` from the values `names`.

        Raises:
            Unsupported: if this target has no spelling of the op for its operands' dtype.
        """
        arg_dtype = kernel.values[op.args[0]].dtype if op.args else op.dtype
        a = names[op.args[0]] if op.args else ""
        b = names[op.args[1]] if len(op.args) > 1 else ""
        name = op.name
        if name == "convert_element_type":
            return self.convert(a, arg_dtype, op.dtype)
        if name == "where":
            return OPS["where"].on_float.format(a=a, b=b, c=names[op.args[2]])
        one = self.literal(1, arg_dtype) if arg_dtype.is_floating_point else "1"
        extra = {}
        if arg_dtype.is_floating_point:
            extra = {"sqrt": self.math("sqrt", arg_dtype), "trunc": self.math("trunc", arg_dtype)}
        if name == "pow" and constant_exponent(kernel, op):
            exponent = float(kernel.values[op.args[1]].value)
            return POW_CONSTANT[exponent].format(a=a, one=one, **extra)
        if name == "pow":
            own = self.pow(kernel, op, a, b)
            if own is not None:
                return own
        template = self.template(name, arg_dtype)
        if template is None:
            raise Unsupported(f"{name} on {arg_dtype} has no {self.name} spelling")
        return template.format(a=a, b=b, one=one, h=self.helper, **extra)


def constant_exponent(kernel, op: Op) -> bool:
    """Whether `op` is a floating pow whose exponent is a constant of `POW_CONSTANT` (rendered
    without pow, and without reading the exponent)."""
    const = kernel.values[op.args[1]]
    return (isinstance(const, Const) and kernel.values[op.args[0]].dtype.is_floating_point
            and float(const.value) in POW_CONSTANT)


def op_reads(kernel, op: Op) -> tuple[int, ...]:
    """The arguments an op's rendering reads (a constant exponent rendered as x * x is none)."""
    if op.name == "pow" and len(op.args) == 2 and constant_exponent(kernel, op):
        return op.args[:1]
    return op.args


def live_values(kernel) -> set[int]:
    """Values the outputs of a kernel (pointwise or row) depend on, as rendered: a constant
    exponent spelled `x * x` is not read. A target that must not declare unused variables
    (NVRTC warns) renders only these."""
    live = set(kernel.outputs)
    for v in range(len(kernel.values) - 1, -1, -1):
        value = kernel.values[v]
        if v not in live:
            continue
        if isinstance(value, Op):
            live.update(op_reads(kernel, value))
        elif isinstance(value, (ColumnReduce, Reduce)):
            live.add(value.arg)
    return live
