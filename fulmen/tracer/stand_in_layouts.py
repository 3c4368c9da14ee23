"""Eager's output layouts where a size-1 dim has an odd stride, found by running the op once on
small real stand-ins of its operands (NOTE [size-1 strides]): whether an elementwise kernel takes
TensorIterator's fast setup (`fast_setup`, asked by the rules of `fulmen.tracer.layout`), and the
layouts of an op recorded whole where PyTorch's meta and CPU kernels disagree
(`stand_in_layouts`, asked by `fulmen.tracer.layout_truth`).
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree

from fulmen.core.proxy import iter_proxies
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import contiguous_strides, known_same_shape, strides_of
from fulmen.tracer.objects import PLAIN_NUMBER


# NOTE [size-1 strides]: a tensor that is contiguous by `is_contiguous()` (which ignores the
# strides of size-1 dims) while a size-1 dim has another stride than the row-major one (`(4, 1)`
# with strides `(1, 4)`, a one-token `q.transpose(1, 2)` in decoding) gets eager outputs whose
# layout depends on how the kernel takes its operands: TensorIterator's fast setup (every operand
# a tensor of the output's shape, all contiguous: `neg`, `x + y`, `clamp(min=0)`) allocates
# row-major strides, while a Python number wrapped as an operand (`x * 2`, `where(c, x, 0.0)`)
# or an `empty_like` copy (`x.double()`, `clone`) keeps the size-1 dim's stride, as
# `compute_elementwise_output_strides` states. Meta kernels do not agree with the CPU kernels
# here (meta `relu` keeps the stride, meta `x * 2` drops it). So the op itself runs once on
# two-element stand-ins of its operands (same size-1 dims and their strides, contiguous): a
# row-major result means the fast setup.
def odd_size_one_strides(t: TensorProxy) -> bool:
    """Whether a static size-1 dim of `t` has a stride not known to be its row-major one.
    A contiguous tensor may have others there (`x.transpose(1, 2)` of a `(2, 1, 8)` tensor has
    strides `(8, 1, 8)`), and eager keeps them through views and elementwise maps
    (`.reshape(2, -1, 1, 1)` gives `(8, 1, 8, 8)`, not `(8, 1, 1, 1)`), which decides the
    memory format a later op suggests (channels-last for `F.interpolate`, and so the order in
    which a dropout mask is drawn) and whether an elementwise kernel takes the fast setup.
    Decided without a guard: a symbolic stride there counts as odd (symbolic sizes are never
    1, so neither is such a stride)."""
    sizes, strides = tuple(t.shape), strides_of(t)
    return any(type(size) is int and size == 1 and not known_same_shape((stride,), (row,))
               for size, stride, row in zip(sizes, strides, contiguous_strides(sizes)))


def _contiguous_beside_size_one(sizes, strides, canonical) -> bool:
    keep = [d for d, size in enumerate(sizes) if not (type(size) is int and size == 1)]
    return known_same_shape(tuple(strides[d] for d in keep), tuple(canonical[d] for d in keep))


def _stand_in(t: TensorProxy) -> torch.Tensor:
    """A real CPU tensor with `t`'s rank, dtype and size-1 dims, 2 where `t`'s size is larger,
    contiguous, with `t`'s strides in its size-1 dims (never used to address memory)."""
    sizes = tuple(1 if type(size) is int and size == 1 else 2 for size in t.shape)
    strides = list(contiguous_strides(sizes))
    for d, size in enumerate(sizes):
        if size == 1:
            stride = t.stride()[d]
            strides[d] = stride if type(stride) is int else 7 * strides[d] + 5
    return torch.empty_strided(sizes, strides, dtype=t.dtype)


def fast_setup(func, args, kwargs, operands, shape) -> bool:
    """Whether eager's kernel for `func` takes the fast setup with these operands (NOTE
    [size-1 strides]); False when it cannot be told (operands that broadcast or are not
    contiguous never take it) and for empty results (the meta kernel's rule answers)."""
    if any(type(size) is int and size == 0 for size in shape):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        if not all(p.dim() == 0 or (known_same_shape(tuple(p.shape), shape)
                                    and _contiguous_beside_size_one(
                                        tuple(p.shape), p.stride(), contiguous_strides(p.shape)))
                   for p in operands):
            return False
    call = _on_stand_ins(args, kwargs, operands)
    if call is None:
        return False
    try:
        out = _run_quietly(func, *call)
    except Exception:  # an op the stand-ins do not suit: PyTorch's rule answers
        return False
    return isinstance(out, torch.Tensor) and out.stride() == contiguous_strides(out.shape)


def _on_stand_ins(args, kwargs, operands, other=lambda leaf: leaf) -> tuple | None:
    """`(args, kwargs)` with each of the proxies `operands` replaced by its stand-in
    (`_stand_in`) and every other leaf by `other(leaf)`; None where a real tensor or a
    `torch.Generator` is among the arguments (an op never runs on the user's data, nor draws
    from the user's generator)."""
    with torch._C.DisableTorchFunctionSubclass():
        stand_ins = {p.name: _stand_in(p) for p in operands}
    call = pytree.tree_map(
        lambda leaf: stand_ins.get(leaf.name, leaf) if isinstance(leaf, TensorProxy)
        else other(leaf), (args, kwargs))
    mine = {id(t) for t in stand_ins.values()}
    if any(isinstance(leaf, torch.Generator)
           or (isinstance(leaf, torch.Tensor) and id(leaf) not in mine)
           for leaf in pytree.tree_leaves(call)):
        return None
    return call


def _run_quietly(func, args, kwargs):
    """`func(*args, **kwargs)` with torch function handling and warnings off, and torch's
    global CPU generator put back after it: a random op (a training dropout) asked about draws
    from it, which would shift the traced call's own draws from eager's (the stand-ins are CPU
    tensors; a call naming a generator of its own never runs, `_on_stand_ins`). Raises what
    `func` raises."""
    generator = torch.default_generator  # not `torch.set_rng_state`: refused while tracing
    state = generator.get_state()
    try:
        with torch._C.DisableTorchFunction(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return func(*args, **kwargs)
    finally:
        generator.set_state(state)


def _hinted(value):
    """A symbolic number's value in the traced call, read without a guard (the stand-in run of
    `stand_in_layouts` decides no value); other leaves as they are."""
    kind = PLAIN_NUMBER.get(type(value))
    return value if kind is None else kind(value.node.hint)


def stand_in_layouts(func, args, kwargs, leaves):
    """Eager's (shape, strides) for each tensor output of an op recorded whole (an opaque
    symbol: `x * (1.0 + s0)` with a symbolic number) whose operands have odd size-1 strides,
    where PyTorch's meta kernel, which described it, and the CPU kernel disagree (NOTE [size-1
    strides]): the op runs once on stand-ins of its operands (`_stand_in`) on the CPU and on
    the meta device; where the two lay the results out alike, the meta kernel's answer holds
    (None); else each output is laid out densely in the dim order of the CPU result
    (`_dense_strides_alike`), or, where that result has an operand's strides (an `empty_like`
    of it: `sort`, `frexp` of a `(4, 1)` tensor with strides `(1, 4)`), with that operand's.
    None too where an output cannot be told so, for random ops (the caller's check) and where
    a real tensor is among the arguments."""
    outputs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    operands = [p for p in iter_proxies((args, kwargs)) if isinstance(p, TensorProxy)]
    with torch._C.DisableTorchFunctionSubclass():
        if not outputs or not all(isinstance(leaf, TensorProxy) and leaf.device.type == "cpu"
                                  for leaf in outputs) \
                or not any(odd_size_one_strides(p) for p in operands) \
                or not all(p.dim() == 0 or _contiguous_beside_size_one(
                    tuple(p.shape), p.stride(), contiguous_strides(p.shape)) for p in operands):
            return None
    call = _on_stand_ins(args, kwargs, operands, _hinted)
    if call is None:
        return None
    on_meta = pytree.tree_map(
        lambda leaf: torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype,
                                         device="meta")
        if isinstance(leaf, torch.Tensor) else leaf, call)
    try:
        results, described = ([leaf for leaf in pytree.tree_leaves(_run_quietly(func, *each))
                               if isinstance(leaf, torch.Tensor)] for each in (call, on_meta))
    except Exception:  # an op the stand-ins do not suit
        return None
    if len(results) != len(outputs) or [r.stride() for r in results] == [
            d.stride() for d in described]:
        return None  # the meta kernel lays the stand-ins out as the CPU kernel: its answer holds
    layouts = []
    for out, result in zip(outputs, results):
        shape = tuple(out.shape)
        if result.shape != tuple(1 if type(size) is int and size == 1 else 2 for size in shape):
            return None
        strides = _dense_strides_alike(shape, result)
        if strides is None:  # eager's `empty_like` keeps an operand's strides, size-1 dims' too
            kept = [p.stride() for p in operands if known_same_shape(tuple(p.shape), shape)
                    and _stand_in(p).stride() == result.stride()]
            strides = tuple(kept[0]) if kept else None
        if strides is None:
            return None
        layouts.append((out.shape, strides))
    return layouts


def _dense_strides_alike(shape: tuple, result: torch.Tensor) -> tuple | None:
    """Strides for `shape` that lay it out densely in the dim order of `result`'s strides (a
    stand-in of the same rank), or None where `result` is not dense in any order (an expand, a
    gap). Equal strides order a size-1 dim inside the other dim (each size-1 dim's stride is the
    product of the sizes inside it, as eager allocates)."""
    sizes, got = tuple(result.shape), result.stride()
    order = sorted(range(len(sizes)), key=lambda d: (-got[d], sizes[d] == 1))
    expected, strides = [0] * len(sizes), [0] * len(sizes)
    inner_size, inner = 1, 1
    for d in reversed(order):
        expected[d], strides[d] = inner_size, inner
        inner_size, inner = inner_size * sizes[d], inner * shape[d]
    return tuple(strides) if tuple(expected) == tuple(got) else None
