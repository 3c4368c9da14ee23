"""Permutation, flip and repeat torch-level ops (`permute`, `transpose`, `t`, `mT`, `movedim`,
`flip`, `repeat`, `repeat_interleave`, `tile`), decomposed into the shape prims with the
helpers of `shape` (argument forms and aliasing as described there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.shape import (
    VIEW,
    _varargs,
    alias,
    permute_to,
    transpose_dims,
    wrap_dim,
    wrap_dims,
)

T = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Permutations
# ---------------------------------------------------------------------------------------------


@torch_op(T.permute, torch.permute, tags=VIEW)
def permute(self, *dims, **kwargs):
    dims = _varargs(dims, kwargs, "dims", "permute")
    if len(dims) != self.ndim:
        raise FulmenError(f"number of dims {len(dims)} don't match the rank {self.ndim}",
                          op="permute")
    return permute_to(self, wrap_dims(dims, self.ndim, "permute"))


@torch_op(torch.transpose, methods=("transpose",), tags=VIEW)
def transpose(input, dim0, dim1):
    return transpose_dims(input, dim0, dim1)


@torch_op(torch.swapaxes, methods=("swapaxes",), tags=VIEW)
def swapaxes(input, axis0, axis1):
    return transpose_dims(input, axis0, axis1, "swapaxes")


@torch_op(torch.swapdims, methods=("swapdims",), tags=VIEW)
def swapdims(input, dim0, dim1):
    return transpose_dims(input, dim0, dim1, "swapdims")


@torch_op(torch.t, methods=("t",), tags=VIEW)
def t(input):
    if input.ndim > 2:
        raise FulmenError(f"t() expects a tensor with <= 2 dimensions, but self is {input.ndim}D",
                          op="t")
    return permute_to(input, tuple(reversed(range(input.ndim))))


@torch_op(T.T.__get__, name="T", tags=VIEW)
def numpy_T(self):
    return permute_to(self, tuple(reversed(range(self.ndim))))


def _matrix_transpose(a: T, op: str) -> T:
    if a.ndim < 2:
        raise FulmenError(f"tensor.{op} is only supported on matrices or batches of matrices. "
                          f"Got {a.ndim}-D tensor.", op=op)
    return transpose_dims(a, -2, -1, op)


@torch_op(T.mT.__get__, name="mT", tags=VIEW)
def matrix_T(self):
    return _matrix_transpose(self, "mT")


@torch_op(T.mH.__get__, name="mH", tags=VIEW)
def matrix_H(self):
    if self.dtype.is_complex:
        raise NotYetSupportedError("conjugate transpose of a complex tensor", op="mH")
    return _matrix_transpose(self, "mH")


def _movedim(input, source, destination, op: str) -> T:
    source = wrap_dims(source, input.ndim, op, unique=False)
    destination = wrap_dims(destination, input.ndim, op, unique=False)
    for dims in (source, destination):
        if len(set(dims)) != len(dims):
            raise FulmenError(f"repeated dim in {list(dims)}", op=op)
    if len(source) != len(destination):
        raise FulmenError(f"Invalid source or destination dims: source ({list(source)} dims) "
                          f"should contain the same number of dims as destination "
                          f"({list(destination)} dims)", op=op)
    if input.ndim == 0:
        return alias(input)
    order = [-1] * input.ndim
    for src, dst in zip(source, destination):
        order[dst] = src
    rest = iter(d for d in range(input.ndim) if d not in source)
    return permute_to(input, [d if d != -1 else next(rest) for d in order])


@torch_op(torch.movedim, methods=("movedim",), tags=VIEW)
def movedim(input, source, destination):
    return _movedim(input, source, destination, "movedim")


@torch_op(torch.moveaxis, methods=("moveaxis",), tags=VIEW)
def moveaxis(input, source, destination):
    return _movedim(input, source, destination, "moveaxis")


# ---------------------------------------------------------------------------------------------
# Flip and repeat
# ---------------------------------------------------------------------------------------------


@torch_op(T.flip, torch.flip)
def flip(self, *dims, **kwargs):
    dims = wrap_dims(_varargs(dims, kwargs, "dims", "flip"), self.ndim, "flip")
    return prims.flip(self, tuple(sorted(dims)))


@torch_op(torch.fliplr, methods=("fliplr",))
def fliplr(input):
    if input.ndim < 2:
        raise FulmenError("Input must be >= 2-d.", op="fliplr")
    return prims.flip(input, (1,))


@torch_op(torch.flipud, methods=("flipud",))
def flipud(input):
    if input.ndim < 1:
        raise FulmenError("Input must be >= 1-d.", op="flipud")
    return prims.flip(input, (0,))


def repeat_to(a: T, repeats: Sequence[int], op: str = "repeat") -> T:
    """Tile `a` `repeats[i]` times along dim i (leading repeats add dimensions)."""
    if len(repeats) < a.ndim:
        raise FulmenError("Number of dimensions of repeat dims can not be smaller than number "
                          "of dimensions of tensor", op=op)
    if any(r < 0 for r in repeats):
        raise FulmenError(f"trying to create tensor with negative dimension: {list(repeats)}",
                          op=op)
    sizes = (1,) * (len(repeats) - a.ndim) + tuple(a.shape)
    # broadcast to (r0, s0, r1, s1, ...), then merge each (r_i, s_i) pair
    spread = tuple(x for r, s in zip(repeats, sizes) for x in (r, s))
    padded = prims.reshape(a, sizes) if len(sizes) != a.ndim else a
    out = prims.broadcast_in_dim(padded, spread, tuple(range(1, len(spread), 2)))
    return prims.reshape(out, tuple(r * s for r, s in zip(repeats, sizes)))


@torch_op(T.repeat)
def repeat(self, *repeats, **kwargs):
    return repeat_to(self, _varargs(repeats, kwargs, "repeats", "repeat"))


@torch_op(torch.repeat_interleave, methods=("repeat_interleave",))
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """Each element `repeats` times in a row along `dim` (the flattened input when `dim` is
    None): a broadcast over a new axis after `dim`, merged into it, so the gradient is a sum
    over that axis. Eager returns a new contiguous tensor, as the merge of a broadcast does.

    Only a Python int `repeats` of at least 1 without `output_size` decomposes (litgpt's
    grouped-query `k.repeat_interleave(q_per_kv, dim=1)`); a tensor of repeats (sizes that
    depend on its values), 0, a symbolic count or `output_size` record eager's op."""
    if not isinstance(input, torch.Tensor) or type(repeats) is not int or repeats < 1 \
            or output_size is not None or (dim is not None and input.ndim == 0):
        raise NotYetSupportedError("repeat_interleave with repeats other than an int >= 1, or "
                                   "output_size", op="repeat_interleave")
    if dim is None:
        input, d = prims.reshape(input, (math.prod(input.shape),)), 0
    else:
        d = wrap_dim(dim, input.ndim, "repeat_interleave")
    shape = tuple(input.shape)
    wide = prims.broadcast_in_dim(input, (*shape[:d + 1], repeats, *shape[d + 1:]),
                                  (*range(d + 1), *range(d + 2, len(shape) + 1)))
    return prims.reshape(wide, (*shape[:d], shape[d] * repeats, *shape[d + 1:]))


@torch_op(T.tile, torch.tile)
def tile(self, *dims, **kwargs):
    dims = _varargs(dims, kwargs, "dims", "tile")
    dims = (1,) * (self.ndim - len(dims)) + dims
    return repeat_to(self, dims, "tile")
