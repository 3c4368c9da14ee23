"""The check, before each compiled call, that no input the program modifies in place shares
memory with another input or with itself (`check_no_input_aliasing`): the trace treats its
inputs as independent, so such a call runs eagerly (`AliasedInputs`)."""

from __future__ import annotations

import itertools
import operator

import torch

from fulmen.core import NotYetSupportedError, RunsEagerly


def _memory_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes `[start, end)` (on its device) that `tensor`'s elements lie in, or None when it
    has no elements. Strides are never negative, so the last element is at the sum of
    `(size - 1) * stride`."""
    if tensor.is_contiguous():
        start, nbytes = tensor.data_ptr(), tensor.nbytes
        return (start, start + nbytes) if nbytes else None
    shape, strides = tensor.shape, tensor.stride()
    if 0 in shape:
        return None
    last = sum((size - 1) * stride for size, stride in zip(shape, strides))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def _describe_input(index: int, tensor: torch.Tensor) -> str:
    return (f"input {index} ({str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}, "
            f"strides {tensor.stride()}, storage offset {tensor.storage_offset()})")


class AliasedInputs(RunsEagerly):
    """Two inputs of a call share memory and the compiled program modifies one of them in
    place: the program treats its inputs as independent, so such a call runs eagerly (eager's
    effects through the alias are the answer), or raises under `fullgraph=True`."""


def _refuse_overlap(inputs, cluster: list[int], mutated: set[int]) -> None:
    """Raise for the first two inputs of `cluster` (whose ranges overlap as a chain) that share
    bytes on one device, one of them mutated."""
    spans = {index: _memory_span(inputs[index]) for index in cluster}
    for a, b in itertools.combinations(sorted(cluster), 2):
        if a not in mutated and b not in mutated:
            continue
        (start_a, end_a), (start_b, end_b) = spans[a], spans[b]
        if start_a < end_b and start_b < end_a and inputs[a].device == inputs[b].device:
            changed = a if a in mutated else b
            raise AliasedInputs(
                f"trace {_describe_input(a, inputs[a])} and {_describe_input(b, inputs[b])} "
                f"may share memory, and input {changed} is modified in place: the compiled "
                "program treats them as independent", op="in-place update",
                hint="pass tensors that do not overlap (clone one of them)")


def _refuse_self_overlap(inputs, mutated: tuple[int, ...]) -> None:
    for index in mutated:
        tensor = inputs[index]
        if tensor.is_contiguous():
            continue
        if any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())):
            raise NotYetSupportedError(
                f"trace {_describe_input(index, tensor)} is modified in place, but more than one "
                "element of the written-to tensor refers to a single memory location (a "
                "stride-0 dimension, as expand makes); eager raises 'unsupported operation' "
                "for in-place ops on it", op="in-place update",
                hint="clone() the tensor before passing it")


def check_no_input_aliasing(inputs, mutated: tuple[int, ...]) -> bool:
    """Raise if an input the trace mutates may share memory with another input, or with itself:
    the trace treats inputs as independent, so eager's effects through the alias would be lost.
    The check runs before the call, so a refused call changes nothing (eager may have updated
    some inputs before failing).

    Inputs share memory when the byte ranges their elements span overlap: tensors without
    elements and disjoint views of one storage (`buf[:4]`, `buf[4:]`) are independent. Views
    whose ranges overlap without sharing an element (`buf[0::2]`, `buf[1::2]`) are refused too.
    One sort of the ranges finds the overlapping ones (O(n log n) for n inputs, every call).
    Returns whether no two inputs' byte ranges overlap at all (on any device: `AliasingMemo`).

    Raises:
        NotYetSupportedError: naming the two inputs (position, shape, strides, offset), or the
            mutated input with a stride-0 dimension.
    """
    _refuse_self_overlap(inputs, mutated)
    spans: list[tuple[int, int, int]] = []  # (start, end, input index)
    for index, tensor in enumerate(inputs):
        if tensor.is_contiguous():  # the common case, made cheap: spans are taken every call
            nbytes = tensor.nbytes
            if nbytes:
                start = tensor.data_ptr()
                spans.append((start, start + nbytes, index))
        else:
            span = _memory_span(tensor)
            if span is not None:
                spans.append((*span, index))
    spans.sort()
    end = 0
    for start, stop, _ in spans:
        if start < end:
            break
        end = stop
    else:
        return True  # no two inputs overlap (every call of a program mutating its inputs)
    changed = set(mutated)
    cluster: list[int] = []
    end = 0
    for start, stop, index in [*spans, (float("inf"), 0, -1)]:
        if start < end:  # overlaps a range of the cluster
            cluster.append(index)
            end = max(end, stop)
            continue
        if len(cluster) > 1 and not changed.isdisjoint(cluster):
            _refuse_overlap(inputs, cluster, changed)
        cluster, end = [index], stop
    return False


_is_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr
_nbytes = operator.attrgetter("nbytes")


class AliasingMemo:
    """`check_no_input_aliasing` for one compiled program, remembering the last call it passed.

    NOTE [aliasing memo]: when every input is contiguous, the check's answer is a function of
    each input's byte range `(data_ptr, data_ptr + nbytes)` alone (no self-overlap is possible,
    and ranges decide overlap between inputs). So when every input is contiguous and the start
    addresses and byte counts are those of the last call that passed, this call passes too: read
    by three C-level passes instead of a Python loop and a sort over ~100 optimizer tensors.
    Anything else (a non-contiguous input, one moved or resized, a different count) runs the
    whole check, and only a call whose ranges are all disjoint is remembered. Only integers
    are kept: no tensor is held alive, and an address reused by a new tensor of the same size
    spans the same bytes. Addresses and sizes are stored as one pair (one store: a concurrent
    call never sees the addresses of one call with the sizes of another)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple | None = None  # (addresses, byte counts) of the last call passed

    def check(self, inputs, mutated: tuple[int, ...], fresh=()) -> None:
        """`check_no_input_aliasing(inputs, mutated)`, skipped where its answer is known.
        `fresh`: positions of inputs the call allocated itself (a copy of a captured tensor, a
        float's carrier: new each call), left out of the comparison, since a new allocation
        shares no byte with any tensor alive (and only contiguous ones are compared)."""
        contiguous = all(map(_is_contiguous, inputs))
        if contiguous:
            ptrs = list(map(_data_ptr, inputs))
            sizes = list(map(_nbytes, inputs))
            for index in fresh:
                ptrs[index] = sizes[index] = None
            if (ptrs, sizes) == self._last:
                return
        self._last = None
        # remembered only where no ranges overlap at all: overlapping ranges on two devices
        # pass too, and the same addresses could later lie on one device
        if check_no_input_aliasing(inputs, mutated) and contiguous:
            self._last = (ptrs, sizes)


__all__ = ["AliasedInputs", "AliasingMemo", "check_no_input_aliasing"]
