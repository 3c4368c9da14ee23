"""Lowering: a fusion region of prims -> a pointwise `Kernel` (see `ir.py`).

Which prims may join a region is `ops.fusible` (the op table and the region's target).
`lower(region, outputs)` builds the kernel; it raises `Unsupported` when the
region breaks a rule of the pointwise schedule: every elementwise statement has the same shape
(the iteration space), and view prims only read region inputs or other views of them. Sizes
are compared as `sizes.same` does: a comparison of symbolic sizes that depends on the call
raises `Unsupported` (the region stays unfused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.codegen.ir import Access, Const, Kernel, Load, Op, ViewStep
from fulmen.executors.codegen.ops import INTS, VIEWS, Unsupported
from fulmen.executors.codegen.sizes import freeze, same_shape
from fulmen.transforms.fusion import region_inputs

__all__ = ["LoweredRegion", "Unsupported", "cast_scalar", "fits_pointwise", "lower",
           "number_dtype"]


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


@dataclass(frozen=True)
class LoweredRegion:
    """A kernel plus how to call it: the iteration shape, and for each region output either
    `("kernel", k)` (the kernel's k-th output) or `("view", access)` (a view of an input).
    Symbolic sizes in the shape and the accesses are `sizes.SymSize`s (`sizes.concrete`
    gives the region of one call)."""

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
        else:
            try:
                if not same_shape(out.shape, shape):
                    return False
            except Unsupported:
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
            step = ViewStep(name, freeze(bsym.args[1:]))
            access = Access(kind[1].input, kind[1].steps + (step,))
            env[bsym.output.name] = ("view", access, bsym.output.dtype)
            continue
        out = bsym.output
        if shape is None:
            shape = tuple(out.shape)
        elif not same_shape(tuple(out.shape), shape):
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
    return LoweredRegion(kernel, freeze(shape), tuple(inputs), tuple(plan))
