"""Lowering: a fusion region of prims -> a pointwise `Kernel` (see `ir.py`).

`fusible(bsym)` decides which prims may join a region: elementwise prims on CPU tensors of
supported dtypes (with per-op dtype rules: no integer division, whose divide-by-zero would trap
in C++), and the view prims (broadcast_in_dim, permute, slice, squeeze, reshape, flip) applied to
region inputs. `lower(region, outputs)` builds the kernel; it raises `Unsupported` when the
region breaks a rule of the pointwise schedule: every elementwise statement has the same shape
(the iteration space), and view prims only read region inputs or other views of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Number

import torch

from fulmen.core import BoundSymbol, Proxy
from fulmen.executors.codegen.ir import Access, Const, Kernel, Load, Op, ViewStep
from fulmen.transforms.fusion import region_inputs

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
BOOL = frozenset({torch.bool})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | BOOL

_FLOAT_UNARY = [
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf",
    "erfc", "reciprocal",
]  # fmt: skip
_FLOAT_BINARY = ["div", "remainder", "fmod", "floor_div", "trunc_div", "pow", "atan2", "copysign"]

# prim name -> dtypes of its tensor operands this executor computes exactly like torch.
SUPPORTED: dict[str, frozenset] = {
    **{name: FLOATS for name in _FLOAT_UNARY + _FLOAT_BINARY},
    **{name: NUMERIC for name in ("neg", "abs", "floor", "ceil", "round", "trunc", "sign", "sub")},
    **{name: ALL for name in ("logical_not", "isnan", "isinf", "isfinite", "signbit", "add",
                              "mul", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
                              "where", "convert_element_type")},
    **{name: INTS | BOOL for name in ("bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor")},
}  # fmt: skip
VIEWS = frozenset({"broadcast_in_dim", "permute", "slice", "squeeze", "reshape", "flip"})
# reduction prims of the row schedule (see rows.py) -> dtypes they reduce exactly like torch
REDUCTIONS: dict[str, frozenset] = {"sum": NUMERIC, "prod": NUMERIC, "amax": NUMERIC,
                                    "amin": NUMERIC, "var": FLOATS}  # fmt: skip


class Unsupported(Exception):
    """The region (or statement) does not fit the pointwise schedule."""


def _number_fits(value, dtype: torch.dtype) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return dtype != torch.bool and (dtype in FLOATS or -(2**63) <= value < 2**63)
    if isinstance(value, float):
        return dtype in FLOATS
    return False


def cast_scalar(value, dtype: torch.dtype):
    """A Python number as eager's kernels see it in `dtype`: integers wrap around in integer
    dtypes (`int8 + 300` adds 44), floats round to the dtype."""
    if dtype in INTS and isinstance(value, int) and not isinstance(value, bool):
        bits = torch.iinfo(dtype).bits
        value &= (1 << bits) - 1
        if dtype != torch.uint8 and value >= 1 << (bits - 1):
            value -= 1 << bits
        return value
    return torch.tensor(value, dtype=dtype).item()


def number_dtype(name: str, position: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype a Python number operand of prim `name` (at `position`) takes in a kernel whose
    tensor operands have `dtype`: `dtype`, except the exponent of a float32 `pow`, which eager's
    CPU kernel keeps in double (`std::pow(float, double)`: `x ** 2147483647` stays odd, and
    `x ** 5e-324` is not `x ** 0`). Renderers for devices that round it do so themselves."""
    if name == "pow" and position == 1 and dtype == torch.float32:
        return torch.float64
    return dtype


def fusible(bsym: BoundSymbol) -> bool:
    """Whether the codegen executor can put `bsym` into a fusion region."""
    sym = bsym.sym
    if not sym.is_prim or bsym.kwargs:
        return False
    tensors = [a for a in bsym.args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return False
    if sym.name in REDUCTIONS:
        return _fusible_reduction(bsym)
    return pointwise_fusible(bsym)


def pointwise_fusible(bsym: BoundSymbol) -> bool:
    """The device-independent part: a view of a supported dtype, or an elementwise prim whose
    operands have a supported dtype and whose numbers fit it (CPU and CUDA share this)."""
    sym = bsym.sym
    if any(isinstance(a, torch.Tensor) and not isinstance(a, Proxy) for a in bsym.args):
        return False  # a constant tensor baked into the trace: no kernel argument for it
    if sym.name in VIEWS:
        return isinstance(bsym.args[0], torch.Tensor) and bsym.args[0].dtype in ALL
    allowed = SUPPORTED.get(sym.name)
    if allowed is None:
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
    if dtype not in allowed:
        return False
    for arg in operands:
        if not isinstance(arg, torch.Tensor):
            if not isinstance(arg, Number) or not _number_fits(arg, dtype):
                return False
    return True


def _fusible_reduction(bsym: BoundSymbol) -> bool:
    """Reductions over a non-empty set of axes that includes the last one (the row schedule:
    rows are the kept axes), and sums over any axes (a sum over leading axes becomes a column
    sum of the row schedule)."""
    a, dims = bsym.args[0], bsym.args[1]
    if not isinstance(a, Proxy) or a.ndim == 0 or a.dtype not in REDUCTIONS[bsym.sym.name]:
        return False
    dims = {d % a.ndim for d in dims}
    if not dims or (a.ndim - 1 not in dims and bsym.sym.name != "sum"):
        return False
    return bsym.sym.name != "var" or isinstance(bsym.args[2], Number)


@dataclass(frozen=True)
class LoweredRegion:
    """A kernel plus how to call it: the iteration shape, and for each region output either
    `("kernel", k)` (the kernel's k-th output) or `("view", access)` (a view of an input)."""

    kernel: Kernel
    shape: tuple[int, ...]
    inputs: tuple
    outputs: tuple[tuple, ...]


def fits_pointwise(region: list[BoundSymbol]) -> bool:
    """Whether `lower(region, ..., check_only=True)` accepts the region, without building the
    kernel (the partitioner asks this for every candidate merge): every computing statement
    has one shape, and views read only region inputs or other views."""
    shape = None
    computed: set[str] = set()
    for bsym in region:
        if bsym.sym.name in VIEWS:
            if bsym.args[0].name in computed:
                return False
            continue
        out = bsym.output
        if shape is None:
            shape = out.shape
        elif out.shape != shape:
            return False
        computed.add(out.name)
    return True


def lower(region: list[BoundSymbol], outputs: list, check_only: bool = False) -> LoweredRegion:
    """Lower `region` (statements in trace order) computing `outputs`. With `check_only`, a
    region of views only is accepted (it may still merge with its consumers).

    Raises:
        Unsupported: if the region does not fit the pointwise schedule.
    """
    inputs = region_inputs(region)
    input_index = {proxy.name: i for i, proxy in enumerate(inputs)}
    env: dict[str, tuple] = {}
    accesses: list[Access] = []
    access_dtypes: list[torch.dtype] = []
    values: list = []
    loads: dict[Access, int] = {}
    shape: tuple[int, ...] | None = None

    def view_of(proxy) -> tuple:
        if proxy.name in env:
            return env[proxy.name]
        return ("view", Access(input_index[proxy.name], ()), proxy.dtype)

    def operand(arg, dtype) -> int:
        if not isinstance(arg, torch.Tensor):
            value = cast_scalar(arg, dtype)
            values.append(Const(value, dtype))
            return len(values) - 1
        kind = view_of(arg)
        if kind[0] == "value":
            return kind[1]
        access = kind[1]
        if access not in loads:
            accesses.append(access)
            access_dtypes.append(arg.dtype)
            values.append(Load(len(accesses) - 1, arg.dtype))
            loads[access] = len(values) - 1
        return loads[access]

    for bsym in region:
        name = bsym.sym.name
        if name in VIEWS:
            kind = view_of(bsym.args[0])
            if kind[0] != "view":
                raise Unsupported(f"{name} of a computed value")
            step = ViewStep(name, tuple(_freeze(a) for a in bsym.args[1:]))
            access = Access(kind[1].input, kind[1].steps + (step,))
            env[bsym.output.name] = ("view", access, bsym.output.dtype)
            continue
        out = bsym.output
        if shape is None:
            shape = tuple(out.shape)
        elif tuple(out.shape) != shape:
            raise Unsupported(f"{name} on shape {tuple(out.shape)} in a {shape} kernel")
        if name == "convert_element_type":
            args = (operand(bsym.args[0], bsym.args[0].dtype),)
        elif name == "where":
            dtype = out.dtype
            args = (operand(bsym.args[0], torch.bool), operand(bsym.args[1], dtype),
                    operand(bsym.args[2], dtype))
        else:
            dtype = next(a.dtype for a in bsym.args if isinstance(a, torch.Tensor))
            args = tuple(operand(arg, number_dtype(name, i, dtype))
                         for i, arg in enumerate(bsym.args))
        values.append(Op(name, args, out.dtype))
        env[out.name] = ("value", len(values) - 1)
    if shape is None:
        if check_only:
            return None
        raise Unsupported("no computation")
    kernel_outputs: list[int] = []
    plan = []
    for proxy in outputs:
        kind = env[proxy.name]
        if kind[0] == "value":
            if kind[1] in kernel_outputs:
                raise Unsupported("one value returned twice")
            plan.append(("kernel", len(kernel_outputs)))
            kernel_outputs.append(kind[1])
        else:
            plan.append(("view", kind[1]))
    kernel = Kernel(tuple(accesses), tuple(access_dtypes), tuple(values), tuple(kernel_outputs))
    return LoweredRegion(kernel, shape, tuple(inputs), tuple(plan))


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value
