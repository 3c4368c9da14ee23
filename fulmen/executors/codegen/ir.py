"""The kernel IR: a loop-level description of one fusion region.

A pointwise `Kernel` runs over an iteration space of rank N (its sizes are kernel arguments).
Every value is computed once per point of that space, in SSA order:

    v0 = load a0          # access 0: a region input seen through a chain of views
    v1 = const 2.0 : f32
    v2 = mul(v0, v1) : f32
    store o0 <- v2

An `Access` is a region input read through a chain of view prims (broadcast, permute, slice,
squeeze, reshape, flip); at run time the chain turns the input's strides into strides over the
iteration space (0 where it broadcasts), so transposed, sliced and broadcast inputs are read in
place. The IR carries dtypes, never sizes or strides: one kernel serves every shape.

`pad` and `cat` (NOTE [pad and cat in pointwise kernels] in `lower.py`) read their operands at
shifted points: an access ending in a `shift` step, loaded only where a mask holds (`Load.mask`,
a bool value; elsewhere the load gives 0 and reads nothing). A mask is itself a load, of an
access of `MASK_INPUT`: a bool vector along one axis that the runtime makes from the call's
sizes (`region.mask_tensor`), so no size enters the kernel's source.

A `RowKernel` is the normalisation schedule (softmax, layer_norm, sums over trailing axes): its
values are row-level (once per point of the kept axes: reductions and what follows from them)
or element-level (once per point of the whole space), and `Reduce` turns the latter into the
former.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ViewStep:
    """One view prim applied to an access: `name` is the prim name, `params` its arguments."""

    name: str
    params: tuple


@dataclass(frozen=True)
class Access:
    """Region input `input` read through `steps` (views ending at the iteration shape)."""

    input: int
    steps: tuple[ViewStep, ...]


MASK_INPUT = -1  # `Access.input` of a mask (`ViewStep("mask", (dim, start, length, shape))`)


@dataclass(frozen=True)
class Load:
    """Access `access` read as `dtype`; with `mask` (a bool value), read only where it holds
    (0 elsewhere)."""

    access: int
    dtype: torch.dtype
    mask: int | None = None


@dataclass(frozen=True)
class Const:
    value: bool | int | float
    dtype: torch.dtype


@dataclass(frozen=True)
class Scalar:
    """Region input `input`, a Python float read at run time (`FloatProxy`), passed to the
    kernel as a double argument and rounded to `dtype` as eager rounds a number operand
    (NOTE [run-time floats as kernel arguments] in `lower.py`)."""

    input: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Op:
    """`name` applied to values `args` (indices of earlier values); `params` are constants such
    as the target dtype of a conversion. `dtype` is the result's dtype."""

    name: str
    args: tuple[int, ...]
    dtype: torch.dtype
    params: tuple = ()


@dataclass(frozen=True)
class Kernel:
    """A pointwise kernel: `values` in SSA order, `outputs` the values stored (one buffer each,
    contiguous, of the iteration shape), `accesses` what the loads read."""

    accesses: tuple[Access, ...]
    access_dtypes: tuple[torch.dtype, ...]
    values: tuple[Load | Const | Scalar | Op, ...]
    outputs: tuple[int, ...]
    scalars: tuple[int, ...] = ()  # the region inputs of the `Scalar` arguments, in order
    # those eager converts with an overflow check (addcdiv's float32 `value`): a finite value
    # past float32's range raises in eager, so the call runs the region's torch fallback
    checked: tuple[int, ...] = ()

    @property
    def output_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.values[v].dtype for v in self.outputs)

    def __str__(self) -> str:
        return _describe(self, [""] * len(self.accesses), [""] * len(self.values))


# --- the normalisation (row) schedule ---------------------------------------------------------


@dataclass(frozen=True)
class Reduce:
    """Reduction `name` (sum, prod, amax, amin) of the element-level value `arg` over the
    reduced axes of a `RowKernel`; the result is a row-level value of `dtype`."""

    name: str
    arg: int
    dtype: torch.dtype


@dataclass(frozen=True)
class ColumnReduce:
    """Sum of the element-level value `arg` over the kept axes of a `RowKernel` (the reduced
    axes survive: a LayerNorm weight gradient). Only stored, never used by other values."""

    name: str
    arg: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Count:
    """The number of elements reduced per row, as a row-level value of `dtype`."""

    dtype: torch.dtype


@dataclass(frozen=True)
class RowKernel:
    """A normalisation-schedule kernel over an iteration space split into kept (outer) axes,
    one row per point, and reduced (inner) axes. Per row: reductions in dependency order (one
    inner loop per stage), row-level values between them, then one inner loop computing and
    storing the element-level outputs, then the row-level outputs.

    `rows[v]` says whether value v is row-level (computed once per row) or element-level;
    `access_rows[a]` whether access a reads a tensor of the kept shape (once per row) or of the
    full shape. `outputs` are stored contiguously: row-level ones with the kept shape,
    `ColumnReduce` ones with the reduced shape.
    """

    accesses: tuple[Access, ...]
    access_dtypes: tuple[torch.dtype, ...]
    access_rows: tuple[bool, ...]
    values: tuple[Load | Const | Op | Reduce | ColumnReduce | Count, ...]
    rows: tuple[bool, ...]
    outputs: tuple[int, ...]

    @property
    def output_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.values[v].dtype for v in self.outputs)

    @property
    def output_rows(self) -> tuple[bool, ...]:
        return tuple(self.rows[v] for v in self.outputs)

    @property
    def output_columns(self) -> tuple[bool, ...]:
        return tuple(isinstance(self.values[v], ColumnReduce) for v in self.outputs)

    def __str__(self) -> str:
        return _describe(self, [" [row]" if row else "" for row in self.access_rows],
                         ["row " if row else "" for row in self.rows])


def _describe(kernel, access_notes: list[str], value_notes: list[str]) -> str:
    """The text of a kernel: its accesses (each followed by its note), its values in SSA order
    (each preceded by its note) and its stores."""
    lines = [f"a{i} = {'mask' if acc.input == MASK_INPUT else f'input{acc.input}'}" + "".join(f".{s.name}{s.params}" for s in acc.steps)
             + note for i, (acc, note) in enumerate(zip(kernel.accesses, access_notes))]
    for i, (value, where) in enumerate(zip(kernel.values, value_notes)):
        if isinstance(value, Load):
            text = f"load a{value.access}"
            if value.mask is not None:
                text += f" if v{value.mask}"
        elif isinstance(value, Const):
            text = f"const {value.value!r}"
        elif isinstance(value, Scalar):
            text = f"scalar input{value.input}"
        elif isinstance(value, Count):
            text = "count"
        elif isinstance(value, Reduce):
            text = f"reduce_{value.name}(v{value.arg})"
        elif isinstance(value, ColumnReduce):
            text = f"column_{value.name}(v{value.arg})"
        else:
            args = ", ".join(f"v{a}" for a in value.args)
            text = f"{value.name}({args}{''.join(f', {p}' for p in value.params)})"
        lines.append(f"{where}v{i} = {text} : {value.dtype}")
    lines += [f"store o{k} <- v{v}" for k, v in enumerate(kernel.outputs)]
    return "\n".join(lines)


def row_stages(kernel: RowKernel) -> list[int]:
    """The stage of each value of a row kernel: 0 before any reduction, s + 1 for a reduction
    of a stage-s value, the latest stage of its arguments for an op."""
    stages: list[int] = []
    for value in kernel.values:
        if isinstance(value, Reduce):
            stages.append(stages[value.arg] + 1)
        elif isinstance(value, Op):
            stages.append(max((stages[a] for a in value.args), default=0))
        else:
            stages.append(0)
    return stages


def element_closure(kernel: RowKernel, targets, leaves=frozenset(),
                    args_of=lambda op: op.args) -> list[int]:
    """Element-level values the targets need, in SSA order, not looking past `leaves`;
    `args_of(op)` gives the arguments an op's rendering reads."""
    need: set[int] = set()
    stack = list(targets)
    while stack:
        v = stack.pop()
        if v in need or kernel.rows[v]:
            continue
        need.add(v)
        value = kernel.values[v]
        if isinstance(value, Op) and v not in leaves:
            stack.extend(args_of(value))
    return sorted(need)
