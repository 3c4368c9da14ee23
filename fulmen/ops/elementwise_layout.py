"""Eager's output strides of an elementwise map (`elementwise_strides`: TensorIterator's rule,
as PyTorch's `compute_elementwise_output_strides` states it), answered without fake tensors
where the sizes settle it (`_row_major_broadcasts`, `_symbolic_strides`), else on fake tensors
of the trace's ShapeEnv (`fulmen.ops.meta._fake_mode`), cached per ShapeEnv."""

from __future__ import annotations

import contextlib
import math

import torch
from torch._prims_common import compute_elementwise_output_strides

from fulmen.ops.meta import _fake_mode, _layout_key, _Uncacheable
from fulmen.proxies.tensor import contiguous_strides, known_same_shape, strides_of


def elementwise_strides(tensors, shape) -> tuple[int, ...]:
    """Eager's output strides for an elementwise map of `tensors` broadcast to `shape`: the
    TensorIterator rule (operand layouts in order, broadcast dims ignored), as PyTorch's
    `compute_elementwise_output_strides` states it. 0-dim tensors take no part, as in eager."""
    shape = tuple(shape)
    canonical = _row_major_strides(shape)
    if all(known_same_shape(tuple(t.shape), shape) and known_same_shape(strides_of(t), canonical)
           for t in tensors if len(t.shape) != 0):
        # TensorIterator's fast setup: operands of the output's shape, all contiguous, give a
        # contiguous output (decided here without the fake tensors symbolic sizes need)
        return canonical
    if _row_major_broadcasts(tensors, shape, canonical):
        return canonical
    envs: list = []
    try:
        key = ("elementwise", _layout_key(tuple(t for t in tensors if len(t.shape) != 0), envs),
               _layout_key(shape, envs))
    except _Uncacheable:
        envs = []
    if not envs or any(env is not envs[0] for env in envs):
        return _elementwise_strides(tensors, shape)
    cache = envs[0].__dict__.setdefault("_fulmen_layouts", {})  # as in `eager_layouts`
    if key not in cache:
        cache[key] = _elementwise_strides(tensors, shape)
    return cache[key]


def _row_major_broadcasts(tensors, shape: tuple, canonical: tuple) -> bool:
    """Whether every operand broadcast to `shape` (known without a guard: `_broadcast`) has,
    on each dim, stride 0 or the row-major stride of `shape`, and at least one has no stride
    0: the weight of `x * w` or the rotary table of `q * cos` beside a contiguous activation.
    TensorIterator's permutation then keeps every dim in place (a stride 0 never decides an
    order; every other pair is ordered as row-major), so the output is row-major, as the fake
    tensors of `_elementwise_strides` would say, without them. Only where every size inside
    the outermost is known not to be 1 (nor 0): row-major strides are then strictly ordered,
    with no tie for PyTorch's rule to break by sizes (a size-1 dim's stride)."""
    if not any(isinstance(v, torch.SymInt) for v in shape):
        return False  # static sizes: plain meta tensors are cheap, and their cache is shared
    for size in shape[1:]:
        if (size < 2) if type(size) is int else not _known_not_one(size):
            return False
    operands = _broadcast_operands(tensors, shape)
    if operands is None:
        return False
    full = False
    for operand in operands:
        zeros = 0
        for stride, expected in zip(operand.strides, canonical):
            if type(stride) is int and stride == 0:
                zeros += 1
            elif not known_same_shape((stride,), (expected,)):
                return False
        full |= zeros == 0
    return full


def _elementwise_strides(tensors, shape: tuple) -> tuple:
    symbolic = _symbolic_strides(tensors, shape)
    if symbolic is not None:
        return symbolic
    operands = []
    with _fake_mode((tensors, shape)), torch._C.DisableTorchFunction():
        for tensor in tensors:
            if tensor.dim() == 0:
                continue
            meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                       dtype=tensor.dtype, device="meta")
            operands.append(meta.expand(shape))
        if not operands:
            return contiguous_strides(shape)
        return tuple(compute_elementwise_output_strides(*operands))


class _Broadcast:
    """A tensor's layout broadcast to an elementwise op's shape: the metadata PyTorch's
    `compute_elementwise_output_logical_to_physical_perm` reads, without a fake tensor."""

    __slots__ = ("shape", "strides", "ndim")
    is_sparse = False

    def __init__(self, shape: tuple, strides: tuple) -> None:
        self.shape, self.strides, self.ndim = shape, strides, len(shape)

    def stride(self) -> tuple:
        return self.strides

    def dim(self) -> int:
        return self.ndim

    def numel(self):
        return math.prod(self.shape)


def _broadcast_operands(tensors, shape: tuple) -> list[_Broadcast] | None:
    """The layouts of `tensors` (0-dim ones take no part) broadcast to `shape`, or None where
    one is not known without a guard (`_broadcast`)."""
    operands = []
    for tensor in tensors:
        if len(tensor.shape) == 0:
            continue
        operand = _broadcast(tensor, shape)
        if operand is None:
            return None
        operands.append(operand)
    return operands


def _broadcast(tensor, shape: tuple) -> _Broadcast | None:
    """`tensor.expand(shape)`'s layout where it is known without a guard (each size equals the
    output's, or is 1 against a size known not to be 1, or against a generalised 1: stride 0),
    else None."""
    strides = [0] * (len(shape) - len(tensor.shape))
    for size, stride, target in zip(tensor.shape, strides_of(tensor), shape[len(strides):]):
        if size is target or known_same_shape((size,), (target,)):
            strides.append(stride)
        elif isinstance(size, int) and size == 1 and (_known_not_one(target)
                                                      or _generalised_symbol(target)):
            strides.append(0)
        else:
            return None
    return _Broadcast(shape, tuple(strides))


def _generalised_symbol(size) -> bool:
    """Whether `size` is a lone symbol of a ShapeEnv that holds generalised 1s: a size 1
    expanded to it gets stride 0 with no guard, as the fake `expand` that `_elementwise_strides`
    would otherwise run (size-oblivious there, `_size_oblivious`) decides: the general path,
    which a size 1 shares (a size-1 dim's stride changes no element's address)."""
    if not isinstance(size, torch.SymInt):
        return False
    node = size.node
    return node.expr.is_Symbol and getattr(node.shape_env, "_fulmen_generalised_ones", False)


def _known_not_one(size) -> bool:
    if isinstance(size, int):
        return size != 1
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(size != 1)


def _symbolic_strides(tensors, shape: tuple):
    """`elementwise_strides` with symbolic sizes, by PyTorch's own rule on the broadcast
    layouts (`_Broadcast`) instead of fake tensors (a fake tensor with symbolic sizes costs
    milliseconds to make); None where a broadcast is not known without a guard, and for static
    sizes (plain meta tensors are cheap)."""
    env = None
    for size in (*shape, *(v for t in tensors for v in (*t.shape, *strides_of(t)))):
        if isinstance(size, torch.SymInt):
            env = size.node.shape_env
            break
    if env is None:
        return None
    operands = _broadcast_operands(tensors, shape)
    if not operands or len(shape) == 1:
        return None
    from torch._prims_common import (
        compute_elementwise_output_logical_to_physical_perm,
        is_non_overlapping_and_dense_or_false,
        make_contiguous_strides_for,
    )
    from torch.fx.experimental import _config

    oblivious = getattr(env, "_fulmen_generalised_ones", False)  # as `_size_oblivious`
    with _config.patch(backed_size_oblivious=True) if oblivious else contextlib.nullcontext():
        if len(operands) == 1 and is_non_overlapping_and_dense_or_false(operands[0]):
            return operands[0].strides
        # one operand with gaps or overlaps (a slice `x[..., :d]` negated): PyTorch's rule
        # takes `empty_like` of it, whose preserved layout is this same permutation laid out
        # densely (`torch._refs.empty_like`), as TensorIterator's for several operands
        perm, _ = compute_elementwise_output_logical_to_physical_perm(*operands,
                                                                      _skip_checks=True)
    physical = make_contiguous_strides_for([shape[d] for d in perm])
    strides = [0] * len(shape)
    for position, dim in enumerate(perm):
        strides[dim] = physical[position]
    return tuple(strides)


def _row_major_strides(shape) -> tuple:
    """Row-major strides of `shape`, symbolic sizes included (no comparison, so no guard; a
    size 0 or 1 multiplies the strides before it as PyTorch's do: `max(size, 1)`)."""
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * (size if isinstance(size, torch.SymInt) else max(size, 1))
    return tuple(reversed(strides))


__all__ = ["elementwise_strides"]
