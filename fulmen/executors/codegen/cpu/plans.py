"""Call plans of the CPU runtime (`fulmen.executors.codegen.cpu.runtime`): what a call of one
fused region's kernel needs for inputs of one key (`Plan`), the table of plans shared by every
live region of one signature (`plan_table`, NOTE [a plan's signature is the whole lowered
region]), and the small helpers plans are made with (`Copy`, `long_inner`, `contiguous`,
`kept_key`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import weakref
from collections import deque

import torch

from fulmen.executors.codegen.cpu.pool import CPU, MIN_BYTES, empty
from fulmen.executors.codegen.region import RegionCallable, copy_base
from fulmen.executors.codegen.sizes import freeze


class _PlanTable(dict):
    """The call plans of one region signature (`plan_table`), by plan key."""

    __slots__ = ("__weakref__",)


# the plan tables of the live regions, by signature: a table lives as long as a region using it
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def plan_table(region: RegionCallable, source: str) -> dict:
    """The table of call plans `region` shares with every live region of the same signature
    (`_signature`): such regions make the same plan for the same inputs, down to the kernel
    (compiled from the same source), so a plan one of them made serves them all: the layers of
    tiny HF Llama repeat their regions, and a sweep over shapes made each plan once per layer.
    Each region runs a shared plan with its own kernel (`plan.layout`'s, as its compile
    policy gives it: `_kernel_for`), so when it compiles and whether it waits stay its own."""
    signature = _signature(region, source)
    try:
        table = _TABLES.get(signature)
    except TypeError:  # an unhashable parameter: a table of its own
        return _PlanTable()
    if table is None:
        table = _TABLES[signature] = _PlanTable()
    return table


def _signature(region: RegionCallable, source: str) -> tuple:
    """What a plan of `region` is made from, besides the call's inputs (its plan key): the
    region made concrete for the call (`bind`: every field of the lowered region, each
    `SymSize` by the value the binder reads), the input types `accepts` checks, and the
    kernel's source (`source`, its common layout: constants that compare equal but are not,
    such as -0.0 and 0.0, print apart).

    NOTE [a plan's signature is the whole lowered region]: the signature holds every field of
    the lowered region (its dataclass fields, so a field added later is in it too), with the
    region's input proxies, whose names differ between regions, described by their type and
    frozen sizes, and the binder's source (which input size gives each symbol). A signature
    naming chosen fields missed `LoweredRows.reduced`: a column sum over axes (0, 2) and one
    over (2,) have equal kernels, sources and shapes, and the second ran the first's plans."""
    lowered = region.lowered
    fields = tuple((field.name, _inputs(lowered.inputs) if field.name == "inputs"
                    else getattr(lowered, field.name)) for field in dataclasses.fields(lowered))
    binder = region.binder
    return (type(region), type(lowered), fields, source, region.input_types,
            None if binder is None else binder.source)


def _inputs(proxies) -> tuple:
    """The region inputs as a plan signature holds them: their types and sizes (each symbolic
    one as its `SymSize`), not their names (their dtypes and devices are `input_types`)."""
    return tuple((type(proxy), freeze(tuple(proxy.shape)) if isinstance(proxy, torch.Tensor)
                  else None) for proxy in proxies)


class Plan:
    """All a call of one kernel needs for inputs of one key (sizes, strides, dtypes, threads),
    made once (`FusedRegion._call_plan`), so that a call only allocates its outputs, writes
    its pointers into a block of the kernel's arguments and calls it (NOTE [one-argument
    entry] in `compiler.py`).

    `reads` are (source, byte offset) per access: a source indexes the call's inputs, then
    `masks` (the plan's own tensors), then one base per `Copy` in `copies`, made anew by each
    call. `news` allocate the outputs. `fn` is the kernel compiled for `layout` (the
    pointers' inner-stride classes). A block holds the sizes and strides, written once, and
    the pointers (then the run-time floats: `nscalars`) of one call: blocks not in use wait in `free`, and a call takes one from it
    (or makes one), so calls on several threads (the GIL is released while a kernel runs)
    never share a block."""

    __slots__ = ("fn", "layout", "reads", "masks", "copies", "extra", "news", "start", "header",
                 "block_type", "free", "direct", "views", "check", "uses")

    def __init__(self, fn, layout, sizes, rows, pointers, arg, nthreads, out_specs, direct, views,
                 ninputs: int, nscalars: int = 0) -> None:
        self.fn, self.layout, self.direct, self.views = fn, layout, direct, views
        self.check = None  # C++ check of the inputs' metadata (NOTE [the last plan])
        self.uses = 0  # table hits until the check is made (NOTE [a check for reuse])
        masks = [where for where, _ in pointers if isinstance(where, torch.Tensor)]
        copies = [where for where, _ in pointers if isinstance(where, Copy)]
        reads = []
        for where, offset in pointers:
            if isinstance(where, int):
                source = where
            elif isinstance(where, torch.Tensor):
                source = ninputs + next(m for m, mask in enumerate(masks) if mask is where)
            else:
                source = ninputs + len(masks) + copies.index(where)
            reads.append((source, offset))
        self.reads, self.masks, self.copies = tuple(reads), tuple(masks), tuple(copies)
        self.extra = bool(masks or copies)
        self.news = tuple(_allocator(shape, dtype) for shape, dtype in out_specs)
        flat = [s for row in rows for s in row]
        self.start = 4 + len(sizes) + len(flat)
        self.header = (len(sizes), arg, nthreads, self.start, *sizes, *flat)
        self.block_type = ctypes.c_int64 * (self.start + len(pointers) + len(out_specs)
                                            + nscalars)  # a run-time float's bits each
        self.free = deque((self.block(),))

    def block(self):
        """A new block of the kernel's arguments, its pointers not yet written."""
        return self.block_type(*self.header)


def _allocator(shape: tuple, dtype: torch.dtype):
    """A callable making an output of `shape` and `dtype` (`pool.empty`): for an output
    smaller than the pool's `MIN_BYTES`, `torch.empty_strided` with the row-major strides
    `torch.empty` gives (the same tensor; about 1 µs less than `torch.empty`, whose argument
    parser tries several signatures)."""
    if math.prod(shape) * dtype.itemsize < MIN_BYTES:
        return functools.partial(torch.empty_strided, tuple(shape), tuple(contiguous(shape)),
                                 dtype=dtype, device=CPU)
    return functools.partial(empty, shape, dtype)


def kept_key(key: tuple) -> tuple:
    """A plan key as kept: its `torch.Size`s as tuples (equal, with the same hash), which the
    garbage collector stops tracking as it does tuples of numbers."""
    return (key[0], *[(tuple(shape), *rest) for shape, *rest in key[1:]])


class Copy:
    """An access whose view chain copies its input (a reshape no strides express, such as
    that of a permuted tensor): each call makes the copy afresh from that call's input (its
    sizes and strides, so the copy's layout and offset, are the plan's: `copies`, as
    `resolve` recorded them when the plan was made)."""

    __slots__ = ("input", "copies")

    def __init__(self, input: int, copies: tuple) -> None:
        self.input, self.copies = input, copies

    def base(self, inputs) -> torch.Tensor:
        return copy_base(inputs[self.input], self.copies)


SHORT_INNER = 16  # a pointwise loop this short costs more in row offsets than in elements


def long_inner(sizes: list, rows: list) -> tuple[list, list]:
    """The iteration space of a pointwise kernel with its longest axis innermost, when the
    inner one (after coalescing) is shorter than `SHORT_INNER` and the longest is at least 4
    times as long: the kernel computes each row's offsets with a division per axis, which would
    cost more than the elements of a short row (a transposed (8, 4, 128, 4) input: 4096 rows of
    4 contiguous elements, or 128 rows of 128 strided ones). Every point is computed
    independently, so any order of the axes gives the same result."""
    if len(sizes) < 2 or sizes[-1] >= SHORT_INNER:
        return sizes, rows
    longest = max(range(len(sizes) - 1), key=lambda d: sizes[d])
    if sizes[longest] < 4 * sizes[-1]:
        return sizes, rows
    order = [d for d in range(len(sizes)) if d != longest] + [longest]
    return [sizes[d] for d in order], [[row[d] for d in order] for row in rows]


def contiguous(shape) -> list[int]:
    """Row-major element strides of `shape` (those of `torch.empty(shape)`)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
