"""The kernel op table: every op a codegen kernel computes, declared once for every target.

A `KernelOp` names an op of the kernel IR (an elementwise prim, or a reduction of the row
schedule), its arity, the operand dtypes it computes exactly like eager, and its common C
spelling per dtype class ("float", "int", "bool"): a format string over the operands `{a}`,
`{b}`, `{c}`, the constant `{one}` of the operand type, the prefix `{h}` of the target's prelude
helpers, and `{sqrt}`/`{trunc}` (the target's math functions); `MATH` means "the target's math
function of this name". A target (`target.py`) overrides a spelling only where it differs
(CUDA's `fm_isinf`, the CPU's vectorisable `f_exp`) and may declare (op, class) pairs it cannot
render.

Fusibility is derived from this table and the target (`fusible`): a prim joins a region only
when its op is here, its operands have a dtype the op lists, and the region's target spells it
for that dtype class. So anything fused is renderable; `tests/executors/test_codegen_ops.py`
checks that every op has a spelling on each target or is declared unfusible there.

Shared decompositions of the spellings: `POW_CONSTANT` (x ** c for the constants eager
computes without pow), `rsqrt` as one over the target's sqrt, `trunc_div` as the target's trunc
of a quotient.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Number

import torch

from fulmen import config
from fulmen.core import BoundSymbol, Proxy
from fulmen.ops.host_float import FloatProxy

__all__ = ["ALL", "BOOL", "FLOATS", "INTS", "MATH", "NUMERIC", "OPS", "POW_CONSTANT",
           "REDUCTIONS", "SCALAR_OPS", "SELECTS", "VIEWS", "set_scalar_arguments", "WIDE_FLOATS", "KernelOp", "Unsupported", "dtype_class", "fusible"]

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
WIDE_FLOATS = frozenset({torch.float32, torch.float64})
INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
BOOL = frozenset({torch.bool})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | BOOL
MATH = "math"  # spelled as the target's math-library function of the op's name

VIEWS = frozenset({"broadcast_in_dim", "permute", "slice", "squeeze", "reshape", "flip"})
# prims that pick each point from one operand read at a shifted point, or a constant (lower.py)
SELECTS = frozenset({"pad", "cat"})
# opaque torch ops of a tensor and a float read at run time (`FloatProxy`), lowered as eager's
# CPU kernels compute them (lower.py: NOTE [run-time floats as kernel arguments]): the op ->
# the positions of its tensor operands
SCALAR_OPS = {"Tensor_mul": 1, "Tensor_div": 1, "Tensor_add": 1, "Tensor_sub": 1,
              "Tensor_addcdiv": 3}
# whether they are fused (off by default: NOTE [run-time floats as kernel arguments])
_SCALAR_ARGUMENTS = [config.get("FULMEN_CODEGEN_SCALARS") == 1]


def set_scalar_arguments(enabled: bool) -> bool:
    """Whether codegen fuses the ops of `SCALAR_OPS` from now on (traces compiled later; the
    variable `FULMEN_CODEGEN_SCALARS=1` sets it at import); returns the previous setting.

    Example:
        >>> previous = set_scalar_arguments(True)   # jit(opt.step): one kernel per parameter
    """
    previous = _SCALAR_ARGUMENTS[0]
    _SCALAR_ARGUMENTS[0] = bool(enabled)
    return previous


class Unsupported(Exception):
    """A region (or statement, or op) that a schedule or a target cannot handle."""


@dataclass(frozen=True)
class KernelOp:
    """One op of the kernel IR (see the module docstring). `arity` 0 marks a reduction of the
    row schedule (rendered by each target's row renderer, not spelled)."""

    name: str
    arity: int
    dtypes: frozenset
    on_float: str | None = None
    on_int: str | None = None
    on_bool: str | None = None

    def spelling(self, cls: str) -> str | None:
        """The common spelling for operands of dtype class `cls`, or None."""
        return getattr(self, f"on_{cls}")


def _op(name, arity, dtypes, on_float=None, on_int=None, on_bool=None) -> tuple[str, KernelOp]:
    return name, KernelOp(name, arity, dtypes, on_float, on_int, on_bool)


_FLOAT_MATH = ["exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "sin", "cos",
               "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
               "erf", "erfc"]  # fmt: skip
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}

OPS: dict[str, KernelOp] = dict([
    *[_op(name, 1, FLOATS, MATH) for name in _FLOAT_MATH],
    _op("rsqrt", 1, FLOATS, "({one} / {sqrt}({a}))"),
    _op("reciprocal", 1, FLOATS, "({one} / {a})"),
    _op("neg", 1, NUMERIC, "(-{a})", "(-{a})"),
    _op("abs", 1, NUMERIC, MATH, "({a} < 0 ? -{a} : {a})"),
    *[_op(name, 1, NUMERIC, MATH, "{a}") for name in ("floor", "ceil", "round", "trunc")],
    _op("sign", 1, NUMERIC, "{h}sign({a})", "{h}sign({a})"),
    _op("logical_not", 1, ALL, "({a} == 0)", "({a} == 0)", "(!{a})"),
    _op("isnan", 1, ALL, "({a} != {a})", "false", "false"),
    _op("isinf", 1, ALL, MATH, "false", "false"),
    _op("isfinite", 1, ALL, MATH, "true", "true"),
    _op("signbit", 1, ALL, "{h}signbit({a})", "({a} < 0)", "false"),
    _op("bitwise_not", 1, INTS | BOOL, None, "(~{a})", "(!{a})"),
    _op("add", 2, ALL, "({a} + {b})", "({a} + {b})", "({a} || {b})"),
    _op("sub", 2, NUMERIC, "({a} - {b})", "({a} - {b})"),
    _op("mul", 2, ALL, "({a} * {b})", "({a} * {b})", "({a} && {b})"),
    _op("div", 2, FLOATS, "({a} / {b})"),
    _op("remainder", 2, FLOATS, "{h}remainder({a}, {b})"),
    _op("fmod", 2, FLOATS, MATH),
    # rounded divisions of float16/bfloat16 run on torch: eager rounds every intermediate of a
    # tensor-tensor quotient to the reduced dtype but computes one by a Python number in float32
    _op("floor_div", 2, WIDE_FLOATS, "{h}floor_div({a}, {b})"),
    _op("trunc_div", 2, WIDE_FLOATS, "{trunc}({a} / {b})"),
    _op("pow", 2, FLOATS, MATH),
    _op("atan2", 2, FLOATS, MATH),
    _op("copysign", 2, FLOATS, MATH),
    _op("maximum", 2, ALL, "{h}max({a}, {b})", "{h}max({a}, {b})", "({a} || {b})"),
    _op("minimum", 2, ALL, "{h}min({a}, {b})", "{h}min({a}, {b})", "({a} && {b})"),
    *[_op(name, 2, INTS | BOOL, None, f"({{a}} {sym} {{b}})", f"({{a}} {sym} {{b}})")
      for name, sym in (("bitwise_and", "&"), ("bitwise_or", "|"), ("bitwise_xor", "^"))],
    *[_op(name, 2, ALL, *[f"({{a}} {sym} {{b}})"] * 3) for name, sym in _COMPARISONS.items()],
    *[_op("where", 3, ALL, *["({a} ? {b} : {c})"] * 3)],  # class of the selected values
    _op("convert_element_type", 1, ALL),  # spelled by each target's `convert`
    # reductions of the row schedule (`rows.py`), rendered by each target's row renderer
    *[_op(name, 0, NUMERIC) for name in ("sum", "prod", "amax", "amin")],
    _op("var", 0, FLOATS),  # lowered to float64 sums
])  # fmt: skip

# reduction prims of the row schedule -> dtypes they reduce exactly like torch
REDUCTIONS: dict[str, frozenset] = {name: op.dtypes for name, op in OPS.items() if not op.arity}
# torch computes x ** c for these constant exponents without pow (`{sqrt}`: the target's)
POW_CONSTANT = {2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", 0.5: "{sqrt}({a})",
                -0.5: "({one} / {sqrt}({a}))", -1.0: "({one} / {a})",
                -2.0: "({one} / ({a} * {a}))", 1.0: "{a}"}  # fmt: skip


def dtype_class(dtype: torch.dtype) -> str:
    """"float", "int" or "bool": which spelling of an op operands of `dtype` use."""
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _number_fits(value, dtype: torch.dtype) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return dtype != torch.bool and (dtype in FLOATS or -(2**63) <= value < 2**63)
    if isinstance(value, float):
        return dtype in FLOATS
    return False


def fusible(bsym: BoundSymbol, target) -> bool:
    """Whether `bsym` may join a fusion region rendered by `target` (a `target.Target`, or None
    when its device has none): a view of a supported dtype, an elementwise prim of the table
    whose operands have a dtype it lists, whose numbers fit it and which `target` spells, or a
    reduction the row schedule takes.

    Example:
        >>> fusible(bsym, CPU)   # bsym: t1 = prims.exp(t0) on a float32 CPU tensor
        True
    """
    sym = bsym.sym
    if target is not None and sym.name in SCALAR_OPS and not sym.is_prim:
        return target.scalars and _SCALAR_ARGUMENTS[0] and _fusible_scalar_op(bsym)
    if target is None or not sym.is_prim or bsym.kwargs:
        return False
    if any(isinstance(a, torch.Tensor) and not isinstance(a, Proxy) for a in bsym.args):
        return False  # a constant tensor baked into the trace: no kernel argument for it
    if sym.name in REDUCTIONS:
        return _fusible_reduction(bsym)
    if sym.name in VIEWS:
        return isinstance(bsym.args[0], torch.Tensor) and bsym.args[0].dtype in ALL
    if sym.name in SELECTS:
        return target.selects and _fusible_select(bsym)
    op = OPS.get(sym.name)
    if op is None or not op.arity:
        return False
    operands = bsym.args[1:] if sym.name == "where" else bsym.args
    if sym.name == "convert_element_type":
        operands = bsym.args[:1]
        if bsym.args[1] not in ALL:
            return False
    value_tensors = [a for a in operands if isinstance(a, torch.Tensor)]
    if not value_tensors:
        return False
    dtype = value_tensors[0].dtype
    if dtype not in op.dtypes:
        return False
    for arg in operands:
        if not isinstance(arg, torch.Tensor):
            if not isinstance(arg, Number) or not _number_fits(arg, dtype):
                return False
    return target.spells(op.name, dtype)


def _fusible_reduction(bsym: BoundSymbol) -> bool:
    """Reductions over a non-empty set of axes that includes the last one (the row schedule:
    rows are the kept axes), and sums over any axes (a sum over leading axes becomes a column
    sum of the row schedule)."""
    a, dims = bsym.args[0], bsym.args[1]
    if not isinstance(a, Proxy) or not a.shape or a.dtype not in REDUCTIONS[bsym.sym.name]:
        return False
    dims = {d % len(a.shape) for d in dims}
    if not dims or (len(a.shape) - 1 not in dims and bsym.sym.name != "sum"):
        return False
    return bsym.sym.name != "var" or isinstance(bsym.args[2], Number)


def _fusible_select(bsym: BoundSymbol) -> bool:
    """`pad` without interior padding, of a value that fits the tensor's dtype, and `cat`, of
    tensors (proxies) of a dtype kernels handle."""
    if bsym.sym.name == "pad":
        a, value, config = bsym.args
        return (isinstance(a, Proxy) and a.dtype in ALL and isinstance(value, Number)
                and _number_fits(value, a.dtype) and all(not c[2] for c in config))
    tensors = bsym.args[0]
    return (isinstance(tensors, (list, tuple)) and len(tensors) > 0
            and all(isinstance(t, Proxy) and t.dtype in ALL for t in tensors))


def _fusible_scalar_op(bsym: BoundSymbol) -> bool:
    """An opaque op of `SCALAR_OPS` (no decomposition) whose tensors are float32/float64, of
    one static shape, that of its output, and whose number is a float read at run time
    (`tensor * lr`; `addcdiv`/`addcmul` with `value=` one): eager computes it in the tensors'
    dtype with the float rounded to it. float16/bfloat16 (computed in float32 by eager),
    integer tensors (promoted to a float result), broadcasting and alpha= stay on torch."""
    if bsym.subsymbols:
        return False
    ntensors = SCALAR_OPS[bsym.sym.name]
    tensors, rest = bsym.args[:ntensors], bsym.args[ntensors:]
    if ntensors == 1:
        number, kwargs_ok = (rest[0] if len(rest) == 1 else None), not bsym.kwargs
    else:
        number, kwargs_ok = bsym.kwargs.get("value"), not rest and set(bsym.kwargs) == {"value"}
    out = bsym.output
    if not kwargs_ok or not isinstance(number, FloatProxy) or not isinstance(out, Proxy) \
            or not isinstance(out, torch.Tensor):
        return False
    shape = tuple(out.shape)
    return out.dtype in WIDE_FLOATS and all(type(s) is int for s in shape) and all(
        isinstance(t, Proxy) and isinstance(t, torch.Tensor) and t.dtype == out.dtype
        and tuple(t.shape) == shape for t in tensors)
