"""Lowering: a fusion region of prims -> a pointwise `Kernel` (see `ir.py`).

Which prims may join a region is `ops.fusible` (the op table and the region's target).
`lower(region, outputs)` builds the kernel; it raises `Unsupported` when the
region breaks a rule of the pointwise schedule: every elementwise statement has the same shape
(the iteration space) or feeds a `pad`/`cat` (NOTE below), and view prims only read region
inputs or other views of them. Sizes are compared as `sizes.same` does: a comparison of
symbolic sizes that depends on the call raises `Unsupported` (the region stays unfused).

NOTE [pad and cat in pointwise kernels]: the outputs of `pad` and `cat` have the iteration
shape; each point takes one operand's value at a shifted point, or pad's constant. An operand
is computed where it is read: its statements (elementwise, on its own smaller shape: "lazy"
values, never computed at the iteration shape) are lowered again for that operand, every load
through the access plus a `shift` step (the operand's offset in the output) and masked by where
the operand lies (a mask access, `ir.MASK_INPUT`), so nothing is read outside an input; a
`where` on the mask picks the operand's value. `cat((a, b), d)` is `where(in_a, a', b')`,
`pad(a, v)` is `where(in_a, a', v)`. Rotary embeddings' `cat((-x2, x1))` and its backward's
pads then fuse with the multiplies around them. Refused: a pad or cat inside another one's
operand, a lazy value leaving the region, views of pad or cat outputs (views read inputs only).

NOTE [values numbered once]: a region often computes one value twice: a backward recomputes a
forward value next to its own formula of the same subexpression (a SwiGLU gate's `silu` and
`silu_backward` share `1 + exp(-x)`). An op with the same name, operands and dtype as an
earlier one, and a constant with the same value and dtype, is the earlier value (the ops are
pure: nothing random lowers), so the kernel computes it once, wherever the C++ compiler would
not have proved the two equal.

NOTE [run-time floats as kernel arguments]: a float read at run time (`FloatProxy`, an LR
scheduler's rate, Adam's bias corrections) reaches the trace in opaque torch ops
(`torch.Tensor.div(t, f)`, `addcdiv(..., value=f)`: NOTE [floats read at run time]). The CPU
target fuses those of `ops.SCALAR_OPS` on float32/float64 tensors as eager's CPU kernels
compute them: the float is a region input and a kernel argument (`ir.Scalar`), a double
rounded once to the tensors' dtype (as TensorIterator casts a wrapped number to the common
dtype), then `t * s`, `t / s` (a quotient, not a product by the reciprocal), `t + s`, `t - s`,
and `self + s * t1 / t2` (addcdiv), `self + s * t1 * t2` (addcmul) in that order. The value is
not in the kernel's source, its plan key or any guard: a new rate each step runs the same
kernel (`cpu/runtime.py` writes it into the call's argument block). Off by default
(`ops.set_scalar_arguments`, `FULMEN_CODEGEN_SCALARS=1`): the ops themselves are eager's bit
for bit, but fusing them makes the regions of an optimizer step large enough to take in the
statements around them (Adam's `lerp`, `addcmul`, `sqrt`), whose kernel spellings differ
from eager's vectorised ones by an ulp (eager's `lerp`/`addcmul` use fused multiply-adds, its
float32 `sqrt` is not correctly rounded on this CPU), where today a small model's step runs
them on torch and equals eager bit for bit (tests/tracer/test_host_floats.py and others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.codegen.ir import (
    MASK_INPUT,
    Access,
    Const,
    Kernel,
    Load,
    Op,
    Scalar,
    ViewStep,
)
from fulmen.executors.codegen.ops import INTS, SCALAR_OPS, SELECTS, VIEWS, Unsupported
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
    # rounding through a tensor costs ~10 µs, and lowering asks again for every candidate
    # region (the partitioner's checks): answers are kept by the number as written (type and
    # repr, so 0.0 and -0.0, 1 and 1.0 and True stay apart) and the dtype
    key = (dtype, type(value), repr(value))
    found = _CAST.get(key)
    if found is None:
        if len(_CAST) >= 4096:
            _CAST.clear()
        found = _CAST[key] = torch.tensor(value, dtype=dtype, device="cpu").item()
    return found


_CAST: dict[tuple, object] = {}


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


def _iteration_shape(region: list[BoundSymbol]):
    """The shape every computing statement has, except lazy ones: that of the pad/cat outputs
    (which must agree), else of the first computing statement; None if there is none.

    Raises:
        Unsupported: pad/cat outputs of different shapes.
    """
    shape = None
    for bsym in region:
        if _selects(bsym):
            if shape is not None and not same_shape(tuple(bsym.output.shape), shape):
                raise Unsupported("pad or cat outputs of different shapes")
            shape = tuple(bsym.output.shape)
    if shape is None:
        shape = next((tuple(b.output.shape) for b in region if b.sym.name not in VIEWS), None)
    return shape


def _selects(bsym: BoundSymbol) -> bool:
    """Whether `bsym` picks each point from one of several places (a pad, a cat of two or
    more tensors with elements along its dim); a cat of one such tensor is a copy of it,
    lowered as an elementwise identity (`torch.cat((q_roped, q[..., 16:]))` with nothing past
    16; the empty piece stays an operand of the cat, so its gradient, empty, still reaches
    what it was computed from, as in eager)."""
    return bsym.sym.name == "pad" or (bsym.sym.name == "cat" and len(_filled(bsym)) > 1)


def _filled(bsym: BoundSymbol) -> list:
    """The pieces of a cat with elements along its dim (each, when none has)."""
    tensors, dim = bsym.args
    filled = [t for t in tensors if not (type(t.shape[dim]) is int and t.shape[dim] == 0)]
    return filled or list(tensors)


def fits_pointwise(region: list[BoundSymbol], escapes=None) -> bool:
    """Whether `lower(region, ..., check_only=True)` accepts the region, without building the
    kernel (the partitioner asks this for every candidate merge): every computing statement
    has one shape or is lazy (of another shape, reading a lazy value, or a view of a computed
    value of that shape) and read here, each pad/cat has that shape and reads no other one,
    and views read inputs, computed values of that shape or views of them.
    Lazy values must end in a pad or cat; one also read outside the region makes `lower`
    refuse it: `escapes(name)`, when given (the partitioner's), tells whether a value is read
    outside the region."""
    computed: set[str] = set()
    lazy: set[str] = set()
    views: set[str] = set()  # the lazy values that are views of computed values
    selected: set[str] = set()  # values that are, or read, a pad/cat output
    read: set[str] = set()
    try:
        shape = _iteration_shape(region)
        for bsym in region:
            name, out = bsym.sym.name, bsym.output
            inputs = bsym.input_names
            read |= inputs
            if name in VIEWS:
                if inputs & (selected | (lazy - views)):
                    return False  # a view of a pad/cat output or of a lazy computed value
                if inputs & (computed | views):
                    lazy.add(out.name)
                    views.add(out.name)
                continue
            if _selects(bsym):
                if inputs & selected or not same_shape(tuple(out.shape), shape):
                    return False  # a pad or cat inside another's operand
                selected.add(out.name)
                computed.add(out.name)
                continue
            if inputs & selected:
                selected.add(out.name)
            if inputs & lazy or not same_shape(tuple(out.shape), shape):
                lazy.add(out.name)
            else:
                computed.add(out.name)
    except Unsupported:
        return False
    if escapes is not None and any(escapes(name) for name in lazy):
        return False  # `lower` would refuse a lazy value leaving the region
    return lazy <= read  # a lazy value no statement here reads would leave the region


@dataclass(frozen=True)
class _Place:
    """Where a lazy value is read: the view steps its accesses end with (views of it, then
    the `shift` of a pad/cat operand), and the mask (None: every point lies inside)."""

    steps: tuple[ViewStep, ...]
    mask: int | None


def lower(region: list[BoundSymbol], outputs: list, check_only: bool = False) -> LoweredRegion:
    """Lower `region` (statements in trace order) computing `outputs`. With `check_only`, a
    region of views only is accepted (it may still merge with its consumers).

    Raises:
        Unsupported: if the region does not fit the pointwise schedule.
    """
    inputs = region_inputs(region)
    input_index = {proxy.name: i for i, proxy in enumerate(inputs)}
    env: dict[str, tuple] = {}
    producers: dict[str, BoundSymbol] = {}
    accesses: list[Access] = []
    access_dtypes: list[torch.dtype] = []
    values: list = []
    loads: dict[tuple, int] = {}
    built: dict[tuple, int] = {}
    numbered: dict[tuple, int] = {}  # NOTE [values numbered once]
    scalars: list[int] = []  # region inputs passed as `Scalar` arguments
    checked: list[int] = []  # those converted with an overflow check (`Kernel.checked`)
    shape = _iteration_shape(region)

    def view_of(proxy) -> tuple:
        if proxy.name in env:
            return env[proxy.name]
        return ("view", Access(input_index[proxy.name], ()), proxy.dtype)

    def load(access: Access, dtype: torch.dtype, mask: int | None = None) -> int:
        key = (access, mask)
        if key not in loads:
            accesses.append(access)
            access_dtypes.append(dtype)
            values.append(Load(len(accesses) - 1, dtype, mask))
            loads[key] = len(values) - 1
        return loads[key]

    def operand(arg, dtype, place: _Place | None = None) -> int:
        if not isinstance(arg, torch.Tensor):
            value = cast_scalar(arg, dtype)
            return numbered_value(("const", type(value), repr(value), dtype), Const(value, dtype))
        kind = view_of(arg)
        if kind[0] == "view":
            if place is None:
                return load(kind[1], arg.dtype)
            access = kind[1]
            return load(Access(access.input, access.steps + place.steps), arg.dtype,
                        place.mask)
        if kind[0] == "value" and place is None:
            return kind[1]
        if place is None:
            raise Unsupported("a lazy value read at the iteration shape")
        if kind[0] == "lazyview":  # a view of a computed value: computed through the view
            _, base, steps = kind
            return build(producers[base], _Place(steps + place.steps, place.mask))
        return build(producers[arg.name], place)

    def build(bsym: BoundSymbol, place: _Place | None) -> int:
        key = (bsym.output.name, place)
        if key in built:
            return built[key]
        name, out = bsym.sym.name, bsym.output
        if name == "cat" and not _selects(bsym):  # one piece: a copy of it
            built[key] = operand(_filled(bsym)[0], out.dtype, place)
            return built[key]
        if name in SELECTS:
            if place is not None:
                raise Unsupported("a pad or cat inside another one's operand")
            built[key] = select(bsym)
            return built[key]
        if name in SCALAR_OPS:
            built[key] = scalar_op(bsym, place)
            return built[key]
        if name == "convert_element_type":
            args = (operand(bsym.args[0], bsym.args[0].dtype, place),)
        elif name == "where":
            dtype = out.dtype
            args = (operand(bsym.args[0], torch.bool, place),
                    operand(bsym.args[1], dtype, place), operand(bsym.args[2], dtype, place))
        else:
            dtype = next(a.dtype for a in bsym.args if isinstance(a, torch.Tensor))
            args = tuple(operand(arg, number_dtype(name, i, dtype), place)
                         for i, arg in enumerate(bsym.args))
        built[key] = numbered_value((name, args, out.dtype), Op(name, args, out.dtype))
        return built[key]

    def scalar_op(bsym: BoundSymbol, place: _Place | None) -> int:
        """An op of `SCALAR_OPS` (NOTE [run-time floats as kernel arguments])."""
        name, dtype = bsym.sym.name, bsym.output.dtype
        ntensors = SCALAR_OPS[name]
        tensors = [operand(a, dtype, place) for a in bsym.args[:ntensors]]
        number = bsym.args[1] if ntensors == 1 else bsym.kwargs["value"]
        index = input_index[number.name]
        if index not in scalars:
            scalars.append(index)
        s = numbered_value(("scalar", index, dtype), Scalar(index, dtype))

        def op(op_name: str, a: int, b: int) -> int:
            return numbered_value((op_name, (a, b), dtype), Op(op_name, (a, b), dtype))

        if ntensors == 1:
            return op(name.removeprefix("Tensor_"), tensors[0], s)
        if dtype == torch.float32 and index not in checked:
            checked.append(index)  # `value.to<float>()` raises on overflow
        second = "div" if name == "Tensor_addcdiv" else "mul"
        return op("add", tensors[0], op(second, op("mul", s, tensors[1]), tensors[2]))

    def numbered_value(key: tuple, value) -> int:
        if key not in numbered:
            values.append(value)
            numbered[key] = len(values) - 1
        return numbered[key]

    def mask(dim: int, start, length) -> int:
        step = ViewStep("mask", freeze((dim, start, length, shape)))
        return load(Access(MASK_INPUT, (step,)), torch.bool)

    def where(cond: int, a: int, b: int, dtype: torch.dtype) -> int:
        values.append(Op("where", (cond, a, b), dtype))
        return len(values) - 1

    def select(bsym: BoundSymbol) -> int:
        dtype = bsym.output.dtype
        if bsym.sym.name == "pad":
            a, fill, config = bsym.args
            masks = [mask(d, lo, a.shape[d]) for d, (lo, hi, _) in enumerate(config)
                     if not _known_le(lo, 0) or not _known_le(hi, 0)]
            inside = masks[0] if masks else None  # None: crops only, every point reads a
            for other in masks[1:]:
                values.append(Op("mul", (inside, other), torch.bool))
                inside = len(values) - 1
            offsets = freeze(tuple(lo for lo, _, _ in config))
            place = _Place((ViewStep("shift", (offsets, freeze(shape))),), inside)
            if inside is None:
                return operand(a, dtype, place)
            return where(inside, operand(a, dtype, place), operand(fill, dtype), dtype)
        tensors, dim = bsym.args
        dim %= len(shape)
        start, picks = 0, []
        for tensor in tensors:
            offsets = [0] * len(shape)
            offsets[dim] = start
            inside = mask(dim, start, tensor.shape[dim])
            place = _Place((ViewStep("shift", freeze((tuple(offsets), shape))),), inside)
            picks.append((inside, operand(tensor, dtype, place)))
            start = start + tensor.shape[dim]
        result = picks[-1][1]
        for inside, value in reversed(picks[:-1]):
            result = where(inside, value, result, dtype)
        return result

    for bsym in region:
        name = bsym.sym.name
        if name in VIEWS:
            kind = view_of(bsym.args[0])
            step = ViewStep(name, freeze(bsym.args[1:]))
            if kind[0] == "view":
                access = Access(kind[1].input, kind[1].steps + (step,))
                env[bsym.output.name] = ("view", access, bsym.output.dtype)
            elif kind[0] == "lazyview":
                env[bsym.output.name] = ("lazyview", kind[1], kind[2] + (step,))
            elif kind[0] == "value":  # computed again through the view where a pad/cat reads
                env[bsym.output.name] = ("lazyview", bsym.args[0].name, (step,))
            else:
                raise Unsupported(f"{name} of a lazy computed value")
            continue
        out = bsym.output
        producers[out.name] = bsym
        reads_lazy = any(env.get(n, ("",))[0] in ("lazy", "lazyview") for n in bsym.input_names)
        if not _selects(bsym) and (reads_lazy or not same_shape(tuple(out.shape), shape)):
            env[out.name] = ("lazy",)  # computed where a pad or cat reads it
            continue
        if not same_shape(tuple(out.shape), shape):
            raise Unsupported(f"{name} on shape {tuple(out.shape)} in a {shape} kernel")
        env[out.name] = ("value", build(bsym, None))
    if shape is None:
        if check_only:
            return None
        raise Unsupported("no computation")
    read = set().union(*(bsym.input_names for bsym in region))
    if any(kind[0] in ("lazy", "lazyview") and name not in read for name, kind in env.items()):
        raise Unsupported("a lazy value no statement of the region reads")
    kernel_outputs: list[int] = []
    plan = []
    for proxy in outputs:
        kind = env[proxy.name]
        if kind[0] in ("lazy", "lazyview"):
            raise Unsupported(f"the lazy value {proxy.name} leaves the kernel")
        if kind[0] == "view" and _copies(kind[1], inputs[kind[1].input].shape, proxy, shape):
            copied = load(kind[1], proxy.dtype)
            if copied not in kernel_outputs:  # NOTE [a copying view is a kernel output]
                kind = ("value", copied)
        if kind[0] == "value":
            if kind[1] in kernel_outputs:
                raise Unsupported("one value returned twice")
            plan.append(("kernel", len(kernel_outputs)))
            kernel_outputs.append(kind[1])
        else:
            plan.append(("view", kind[1]))
    kernel = Kernel(tuple(accesses), tuple(access_dtypes), tuple(values), tuple(kernel_outputs),
                    tuple(scalars), tuple(checked))
    return LoweredRegion(kernel, freeze(shape), tuple(inputs), tuple(plan))


def _copies(access: Access, sizes, proxy, shape) -> bool:
    """Whether an escaping view of an input (of sizes `sizes`), of the iteration `shape`, is a
    copy in every call: a reshape that merges a dimension a broadcast expanded (stride 0) with
    one it did not. Sizes not all known (symbolic), or a reshape whose copying depends on the
    input's strides: False (the view is taken as before).

    NOTE [a copying view is a kernel output]: a region output that views an input runs its
    chain of view ops after the kernel (`region.view_output`), in torch, on every call. For
    grouped-query attention's repeat of the keys and values (`v[:, :, None].expand(...)
    .reshape(b, heads, t, d)`, as HF and litgpt write `repeat_interleave`) the final reshape
    copies: 5 torch ops and a strided copy per call (25-50 us of host time in each rotary
    region of tiny Llama, forward and backward). The kernel iterates over that shape anyway,
    so it loads through the view and stores the copy."""
    if not same_shape(tuple(proxy.shape), shape) or not _ints(sizes) or 0 in sizes:
        return False
    sizes, expanded = list(sizes), [False] * len(sizes)
    for step in access.steps:
        params = step.params
        if step.name == "broadcast_in_dim":
            new, dims = params
            if not _ints(new):
                return False
            flags = [new[d] != 1 for d in range(len(new))]  # new dims: expanded unless 1
            for i, d in enumerate(dims):
                flags[d] = expanded[i] or (sizes[i] == 1 and new[d] != 1)
            sizes, expanded = list(new), flags
        elif step.name == "permute":
            sizes, expanded = [sizes[d] for d in params[0]], [expanded[d] for d in params[0]]
        elif step.name == "squeeze":
            keep = [d for d in range(len(sizes)) if d not in params[0]]
            sizes, expanded = [sizes[d] for d in keep], [expanded[d] for d in keep]
        elif step.name == "slice":
            starts, ends, strides = params
            if not _ints((*starts, *ends, *strides)):
                return False
            sizes = [-(-(e - b) // k) for b, e, k in zip(starts, ends, strides)]
        elif step.name == "reshape":
            groups = _reshape_groups(sizes, params[0])
            if groups is None:
                return False
            flags = [False] * len(params[0])
            for group, out_dims in groups:
                big = [expanded[d] for d in group if sizes[d] != 1]
                if any(big) and not all(big):
                    return True
                for d in out_dims:
                    flags[d] = any(big) and params[0][d] != 1
            sizes, expanded = list(params[0]), flags
    return False


def _ints(values) -> bool:
    return all(type(v) is int for v in values)


def _reshape_groups(sizes: list[int], new) -> list[tuple[list[int], list[int]]] | None:
    """`(dims of sizes, dims of new)` per run of dims a reshape maps onto each other (equal
    products; trailing dims of size 1 join the last run); None for sizes not all known or a
    size 0."""
    if not _ints(new) or 0 in new or math.prod(sizes) != math.prod(new):
        return None
    groups, i, j = [], 0, 0
    while i < len(sizes) and j < len(new):
        group, out_dims, have, want = [i], [j], sizes[i], new[j]
        i, j = i + 1, j + 1
        while have != want:
            if have < want:
                have, i = have * sizes[i], i + 1
                group.append(i - 1)
            else:
                want, j = want * new[j], j + 1
                out_dims.append(j - 1)
        groups.append((group, out_dims))
    if groups:
        groups[-1][0].extend(range(i, len(sizes)))
        groups[-1][1].extend(range(j, len(new)))
    return groups


def _known_le(size, bound: int) -> bool:
    """Whether `size` (an int or SymInt) is known to be at most `bound` (no guard added)."""
    if isinstance(size, int):
        return size <= bound
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size <= bound)
