"""Lowering a region with reductions to the normalisation (row) schedule: a `RowKernel`.

All reductions of the region reduce the same full shape S over the same axes R (which include
the last axis: see `ops.fusible`); the kept shape K is S without R. Every elementwise
statement then has shape S (an element-level value, computed per element of a row) or shape K
(a row-level value, computed once per row). A row-level value reaches element-level statements
through views that only add or drop size-1 and reduced axes (`broadcast_in_dim(mean, S, kept)`,
keepdim reshapes); such a view escaping the region is returned as a view of the row output.

    amax -> sub -> exp -> sum -> div          softmax: two reduction stages, one output pass
    sum -> div -> sub -> mul -> sum -> rsqrt  layer_norm: mean, then the variance, then outputs

A sum over exactly the kept axes (a LayerNorm weight or bias gradient) is a column sum: each
thread adds its rows into float64 partials, summed into the output after the rows. A region of
column sums only takes the summed axes as its rows.

`var` lowers to two float64 sums (mean, then squared deviations), as eager accumulates it.
`lower_any` picks this schedule for regions with a reduction and `lower.lower` otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.codegen.ir import (
    Access,
    ColumnReduce,
    Const,
    Count,
    Load,
    Op,
    Reduce,
    RowKernel,
    ViewStep,
)
from fulmen.executors.codegen.lower import cast_scalar, lower, number_dtype
from fulmen.executors.codegen.ops import REDUCTIONS, SCALAR_OPS, SELECTS, VIEWS, Unsupported
from fulmen.executors.codegen.sizes import freeze, same, same_shape
from fulmen.transforms.fusion import region_inputs

__all__ = ["LoweredRows", "RowChecks", "lower_any", "lower_rows"]


@dataclass(frozen=True)
class LoweredRows:
    """A `RowKernel` plus how to call it: the full shape, the reduced axes, the region inputs,
    and per region output `("kernel", k)`, `("view", access)` (a view of an input) or
    `("rowview", k, access)` (kernel output k seen through `access.steps`)."""

    kernel: RowKernel
    shape: tuple[int, ...]
    reduced: tuple[int, ...]
    inputs: tuple
    outputs: tuple[tuple, ...]


def lower_any(region: list[BoundSymbol], outputs: list, check_only: bool = False):
    """`lower_rows` for a region with a reduction, else the pointwise `lower`.

    Raises:
        Unsupported: if the region fits neither schedule.
    """
    if any(bsym.sym.name in REDUCTIONS for bsym in region):
        return lower_rows(region, outputs, check_only)
    return lower(region, outputs, check_only)


def _row_view(map_: tuple, in_shape: tuple, name: str, params: tuple) -> tuple:
    """Where each axis of a view (prim `name`, its arguments `params`) of a row-level value
    comes from: an axis of S or None (an axis along which the value does not vary). Raises
    Unsupported for views that move data."""
    if name == "broadcast_in_dim":
        shape, dims = params[:2]
        new = [None] * len(shape)
        for i, d in enumerate(dims):
            new[d] = map_[i] if same(in_shape[i], shape[d]) else None
        return tuple(new)
    if name == "permute":
        return tuple(map_[p] for p in params[0])
    if name == "squeeze":
        return tuple(m for d, m in enumerate(map_) if d not in params[0])
    if name == "reshape":
        big = [(size, m) for size, m in zip(in_shape, map_) if not same(size, 1)]
        shape = params[0]
        if not same_shape([size for size, _ in big], [s for s in shape if not same(s, 1)]):
            raise Unsupported("reshape of a row value that moves data")
        it = iter(big)
        return tuple(next(it)[1] if not same(size, 1) else None for size in shape)
    raise Unsupported(f"{name} of a row value")


def lower_rows(region: list[BoundSymbol], outputs: list, check_only: bool = False) -> LoweredRows:
    """Lower a region with reductions (statements in trace order) computing `outputs`.

    Raises:
        Unsupported: if the region does not fit the row schedule.
    """
    return _row_lowering(region, outputs).finish()


class RowChecks:
    """Whether regions with reductions lower to the row schedule, for the partition that grows
    them by merging regions (`CodegenExecutor.can_fuse_region`).

    NOTE [growing row regions]: the partition asks of every merge it tries whether the merged
    region lowers; lowering each candidate whole made the checks quadratic in a region's size
    (a sixth of a tiny HF Llama training step's compile). The lowering of a region that fits
    is kept (`_Lowering`), and a region made of a kept one (its base: the largest kept region
    among its statements) and more statements is checked by lowering those alone, after the
    base's, when that gives the whole lowering's answer: no statement of the base reads a
    value the others compute (each then sees the same operands as in trace order), and the
    schedule stays the base's (the first reduction, and the first reducing along the last
    axis, are the base's; each further reduction is checked as the whole lowering checks it).
    A refused extension is rolled back (a lowering only appends), so the base stays kept for
    the partition's next question about it: a refusal no longer costs the next check a whole
    lowering. A kept lowering is held with its statements, so the ids in its key stay theirs;
    an extension that fits replaces its base (the partition then merges the two regions).
    The answer only steers the partition: a fused region is lowered whole (`fuse`)."""

    LIMIT = 64

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[list, frozenset, _Lowering]] = {}
        self._lock = threading.Lock()

    def fits(self, region: list[BoundSymbol]) -> bool:
        ids = frozenset(map(id, region))
        with self._lock:  # the base is taken out while it is extended
            key = max((key for key, (_, held, _) in self._kept.items() if held <= ids),
                      key=len, default=None)
            kept = None if key is None else self._kept.pop(key)
        lowering = None
        if kept is not None and _extends(kept[2], kept[1], region):
            lowering, mark = kept[2], kept[2].mark()
            try:
                for bsym in region:
                    if id(bsym) not in kept[1]:
                        lowering.extend(bsym)
            except Unsupported:
                lowering.rollback(mark)
                self._keep(key, kept)
                return False
        else:
            if kept is not None:
                self._keep(key, kept)
            try:
                lowering = _row_lowering(region, [])
            except Unsupported:
                return False
        self._keep(tuple(map(id, region)), (list(region), ids, lowering))
        return True

    def _keep(self, key: tuple, kept: tuple) -> None:
        with self._lock:
            if len(self._kept) >= self.LIMIT:
                self._kept.clear()
            self._kept[key] = kept


def _extends(lowering: _Lowering, held: frozenset, region: list[BoundSymbol]) -> bool:
    """Whether lowering the statements of `region` not in `held` (the ids of `lowering`'s
    statements) after `lowering` answers as lowering `region` whole (NOTE [growing row
    regions])."""
    produced: set[str] = set()
    for bsym in region:
        if id(bsym) not in held:
            produced |= bsym.output_names
    reductions = [bsym for bsym in region if bsym.sym.name in REDUCTIONS]
    first_rowwise = next((bsym for bsym in reductions if lowering.rowwise(bsym)), None)
    return (reductions[0] is lowering.first and first_rowwise is lowering.first_rowwise
            and not any(bsym.input_names & produced for bsym in region if id(bsym) in held))


def _row_lowering(region: list[BoundSymbol], outputs: list):
    """The region lowered statement by statement (a `_Lowering`). Raises Unsupported."""
    reductions = [bsym for bsym in region if bsym.sym.name in REDUCTIONS]
    shape = tuple(reductions[0].args[0].shape)

    def axes(bsym) -> tuple[int, ...]:
        return tuple(sorted({d % len(shape) for d in bsym.args[1]}))

    def is_rowwise(bsym) -> bool:
        return len(shape) - 1 in axes(bsym)

    rowwise = [bsym for bsym in reductions if is_rowwise(bsym)]
    if rowwise:
        reduced = axes(rowwise[0])
    else:  # column sums only: rows run over the summed axes
        reduced = tuple(d for d in range(len(shape)) if d not in axes(reductions[0]))
    kept = tuple(d for d in range(len(shape)) if d not in reduced)
    if not reduced:
        raise Unsupported("a reduction over every axis but no row")
    for bsym in reductions:
        if not same_shape(tuple(bsym.args[0].shape), shape):
            raise Unsupported("reductions of different shapes")
        if axes(bsym) not in (reduced, kept):
            raise Unsupported("reductions over different axes")
    kept_shape = tuple(shape[d] for d in kept)
    # the kept shape with the reduced axes as size 1 (keepdim): a row-level value in S's rank
    keep_shape = tuple(1 if d in reduced else shape[d] for d in range(len(shape)))
    keep_map = tuple(None if d in reduced else d for d in range(len(shape)))
    keep_view = ViewStep("broadcast_in_dim", freeze((keep_shape, kept)))
    inputs = list(region_inputs(region))
    escaping = {proxy.name for proxy in outputs}
    input_index = {proxy.name: i for i, proxy in enumerate(inputs)}
    env: dict[str, tuple] = {}
    accesses: list[Access] = []
    access_dtypes: list[torch.dtype] = []
    access_rows: list[bool] = []
    values: list = []
    rows: list[bool] = []
    loads: dict[tuple, int] = {}

    def add(value, row: bool) -> int:
        values.append(value)
        rows.append(row)
        return len(values) - 1

    def view_of(proxy) -> tuple:
        if proxy.name in env:
            return env[proxy.name]
        return ("view", Access(input_index[proxy.name], ()))

    def fits_element(map_: tuple) -> bool:
        return all(m == d or (m is None and (d in reduced or same(shape[d], 1)))
                   for d, m in enumerate(map_))

    def fits_row(map_: tuple) -> bool:
        return all(m == d or (m is None and same(shape[d], 1)) for m, d in zip(map_, kept))

    def fits_keep(map_: tuple) -> bool:
        return len(map_) == len(shape) and all(
            m is None if d in reduced else m == d or (m is None and same(shape[d], 1))
            for d, m in enumerate(map_))

    def keep_operand(arg, dtype) -> int:
        """An operand of a row-level statement in keepdim form: a constant or a row value
        seen in keepdim form (loads of keepdim-shaped inputs are not row accesses)."""
        if not isinstance(arg, torch.Tensor):
            return add(Const(cast_scalar(arg, dtype), dtype), True)
        kind = view_of(arg)
        if kind[0] != "row" or not fits_keep(kind[2]):
            raise Unsupported("a keepdim-shaped statement reading other than a row value")
        return kind[1]

    def operand(arg, dtype, row: bool) -> int:
        if not isinstance(arg, torch.Tensor):
            return add(Const(cast_scalar(arg, dtype), dtype), True)
        kind = view_of(arg)
        if kind[0] == "column":
            raise Unsupported("a column sum used inside its kernel")
        if kind[0] == "value":
            if rows[kind[1]] != row:
                raise Unsupported("a value used at the wrong level")
            return kind[1]
        if kind[0] == "row":
            if len(kind[2]) != (len(kept) if row else len(shape)):
                raise Unsupported("row value of the wrong rank")
            if not (fits_row(kind[2]) if row else fits_element(kind[2])):
                raise Unsupported("row value broadcast along a kept axis")
            return kind[1]
        key = (kind[1], row)
        if key not in loads:
            accesses.append(kind[1])
            access_dtypes.append(arg.dtype)
            access_rows.append(row)
            loads[key] = add(Load(len(accesses) - 1, arg.dtype), row)
        return loads[key]

    def statement(bsym) -> None:
        name = bsym.sym.name
        out = bsym.output
        if name in SELECTS or name in SCALAR_OPS:  # pointwise kernels only (lower.py)
            raise Unsupported(f"{name} in a row kernel")
        if name in VIEWS:
            kind = view_of(bsym.args[0])
            if kind[0] == "column":
                raise Unsupported("a view of a column sum")
            step = ViewStep(name, freeze(bsym.args[1:]))
            if kind[0] == "view":
                env[out.name] = ("view", Access(kind[1].input, kind[1].steps + (step,)))
            elif kind[0] == "row":
                map_ = _row_view(kind[2], tuple(bsym.args[0].shape), name, bsym.args[1:])
                env[out.name] = ("row", kind[1], map_, kind[3] + (step,))
            elif rows[kind[1]]:
                map_ = _row_view(kept, tuple(bsym.args[0].shape), name, bsym.args[1:])
                env[out.name] = ("row", kind[1], map_, (step,))
            else:
                raise Unsupported(f"{name} of a computed element value")
            return
        if name in REDUCTIONS:
            arg = operand(bsym.args[0], bsym.args[0].dtype, row=False)
            if tuple(sorted({d % len(shape) for d in bsym.args[1]})) == kept:
                if not out.dtype.is_floating_point:
                    raise Unsupported("an integer column sum")  # float64 partials
                env[out.name] = ("column", add(ColumnReduce(name, arg, out.dtype), False))
                return
            if name == "var":
                index = _lower_var(add, arg, bsym.args[0].dtype, bsym.args[2], out.dtype)
            else:
                index = add(Reduce(name, arg, out.dtype), True)
            env[out.name] = ("value", index)
            return
        out_shape = tuple(out.shape)
        if same_shape(out_shape, shape) and out.name not in escaping \
                and (seen := _one_row_view(bsym, view_of)) is not None and fits_element(seen[2]):
            # every operand is one row value seen through the same view (log_softmax's log of
            # the broadcast row sum): computed once per row, seen through that view (a region
            # output stays an element-level value: a contiguous tensor, as eager's)
            args = tuple(add(Const(cast_scalar(arg, dtype), dtype), True)
                         if not isinstance(arg, torch.Tensor) else view_of(arg)[1]
                         for arg, dtype in zip(bsym.args, _operand_dtypes(bsym)))
            env[out.name] = ("row", add(Op(name, args, out.dtype), True), seen[2], seen[3])
            return
        if same_shape(out_shape, shape):
            row = False
        elif same_shape(out_shape, kept_shape):
            row = True
        elif same_shape(out_shape, keep_shape):  # a row-level statement in keepdim form
            # (RMSNorm's rsqrt(mean + eps) on `mean(-1, keepdim=True)`): once per row, a view
            args = tuple(keep_operand(arg, dtype)
                         for arg, dtype in zip(bsym.args, _operand_dtypes(bsym)))
            index = add(Op(name, args, out.dtype), True)
            env[out.name] = ("row", index, keep_map, (keep_view,))
            return
        else:
            raise Unsupported(f"{name} on shape {out_shape} in a {shape} row kernel")
        if name == "convert_element_type":
            args = (operand(bsym.args[0], bsym.args[0].dtype, row),)
        elif name == "where":
            args = (operand(bsym.args[0], torch.bool, row), operand(bsym.args[1], out.dtype, row),
                    operand(bsym.args[2], out.dtype, row))
        else:
            dtype = next(a.dtype for a in bsym.args if isinstance(a, torch.Tensor))
            args = tuple(operand(arg, number_dtype(name, i, dtype), row)
                         for i, arg in enumerate(bsym.args))
        env[out.name] = ("value", add(Op(name, args, out.dtype), row))

    def extend(bsym) -> None:
        if bsym.sym.name in REDUCTIONS:  # as the whole region's reductions are checked
            if not same_shape(tuple(bsym.args[0].shape), shape):
                raise Unsupported("reductions of different shapes")
            if axes(bsym) not in (reduced, kept):
                raise Unsupported("reductions over different axes")
        for proxy in bsym.read_proxies:  # new inputs, as region_inputs
            if proxy.name not in env and proxy.name not in input_index:
                input_index[proxy.name] = len(inputs)
                inputs.append(proxy)
        statement(bsym)

    # what extending appends to (lists) and adds to (dicts, never changing a key's value)
    grown = (inputs, input_index, env, accesses, access_dtypes, access_rows, values, rows, loads)

    def mark() -> tuple[int, ...]:
        return tuple(map(len, grown))

    def rollback(lengths: tuple[int, ...]) -> None:
        for part, length in zip(grown, lengths):
            if isinstance(part, dict):
                while len(part) > length:
                    part.popitem()  # the last added first: dicts keep insertion order
            else:
                del part[length:]

    for bsym in region:
        statement(bsym)

    def finish() -> LoweredRows:
        kernel_outputs: list[int] = []
        plan = []

        def kernel_output(index: int) -> int:
            if index not in kernel_outputs:
                kernel_outputs.append(index)
            return kernel_outputs.index(index)

        for proxy in outputs:
            kind = env[proxy.name]
            if kind[0] in ("value", "column"):
                plan.append(("kernel", kernel_output(kind[1])))
            elif kind[0] == "row":
                plan.append(("rowview", kernel_output(kind[1]), Access(0, kind[3])))
            else:
                plan.append(("view", kind[1]))
        kernel = RowKernel(tuple(accesses), tuple(access_dtypes), tuple(access_rows), tuple(values),
                           tuple(rows), tuple(kernel_outputs))
        return LoweredRows(kernel, freeze(shape), reduced, tuple(inputs), tuple(plan))

    return _Lowering(extend, finish, mark, rollback, reductions[0],
                     rowwise[0] if rowwise else None, is_rowwise)


@dataclass(frozen=True)
class _Lowering:
    """A region lowered statement by statement: `extend(bsym)` lowers one more statement after
    them, `finish()` builds the `LoweredRows` (both raise Unsupported); `mark()` and
    `rollback(mark)` undo extensions. `first` and `first_rowwise` are the reductions that set
    the schedule (the first one; the first reducing along the last axis, or None), and
    `rowwise(bsym)` says whether a reduction reduces along the last axis of the schedule's
    shape."""

    extend: Callable
    finish: Callable
    mark: Callable
    rollback: Callable
    first: BoundSymbol
    first_rowwise: BoundSymbol | None
    rowwise: Callable


def _operand_dtypes(bsym: BoundSymbol) -> tuple:
    """The dtype each operand of an elementwise statement takes in the kernel (numbers cast
    to it); `convert_element_type` has one operand (its second argument is the dtype)."""
    name, out = bsym.sym.name, bsym.output
    if name == "where":
        return (torch.bool, out.dtype, out.dtype)
    if name == "convert_element_type":
        return (bsym.args[0].dtype,)
    dtype = next(a.dtype for a in bsym.args if isinstance(a, torch.Tensor))
    return tuple(number_dtype(name, i, dtype) for i in range(len(bsym.args)))


def _one_row_view(bsym: BoundSymbol, view_of) -> tuple | None:
    """The ("row", value, map, steps) view all tensor operands of `bsym` share (each a row
    value seen through views with one map), or None."""
    seen = None
    for arg in bsym.args[:len(_operand_dtypes(bsym))]:
        if not isinstance(arg, torch.Tensor):
            continue
        kind = view_of(arg)
        if kind[0] != "row" or (seen is not None and kind[2] != seen[2]):
            return None
        seen = seen or kind
    return seen


def _lower_var(add, x: int, dtype: torch.dtype, correction, out_dtype: torch.dtype) -> int:
    """var(x) = sum((x - mean)^2) / max(0, n - correction), in float64 (two passes)."""
    f64 = torch.float64
    if dtype != f64:
        x = add(Op("convert_element_type", (x,), f64), False)
    n = add(Count(f64), True)
    mean = add(Op("div", (add(Reduce("sum", x, f64), True), n), f64), True)
    dev = add(Op("sub", (x, mean), f64), False)
    m2 = add(Reduce("sum", add(Op("mul", (dev, dev), f64), False), f64), True)
    denom = add(Op("sub", (n, add(Const(float(correction), f64), True)), f64), True)
    denom = add(Op("maximum", (denom, add(Const(0.0, f64), True)), f64), True)
    result = add(Op("div", (m2, denom), f64), True)
    if out_dtype != f64:
        result = add(Op("convert_element_type", (result,), out_dtype), True)
    return result

