"""The `prim` decorator and the checks meta functions share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Number

import torch

from fulmen.core import FulmenError, Symbol
from fulmen.core.symbol import Namespace

PRIMS_NAMESPACE = Namespace("prims", "fulmen.ops.prims", "from fulmen.ops import prims")
_PRIMS: dict[str, Symbol] = {}


def prim(name: str, *, tags: Sequence[str] = ()) -> Callable[[Callable], Symbol]:
    """Declare a prim whose meta function is the decorated function."""

    def declare(meta: Callable) -> Symbol:
        if name in _PRIMS:
            raise ValueError(f"prim {name!r} is declared twice")
        sym = Symbol(name, meta, namespace=PRIMS_NAMESPACE, is_prim=True, tags=set(tags))
        sym.fn.__doc__ = meta.__doc__
        _PRIMS[name] = sym
        return sym

    return declare


def all_prims() -> dict[str, Symbol]:
    """Every declared prim, by name."""
    return dict(_PRIMS)


def check(condition: bool, op: str, message: str | Callable[[], str]) -> None:
    """Raise a FulmenError for `op` unless `condition`. A message that formats shapes is given
    as a function, called on failure only: a symbolic size prints through sympy (~50 us), and
    the checks of a trace with symbolic sizes pass thousands of times."""
    if not condition:
        raise FulmenError(message() if callable(message) else message, op=f"prims.{op}")


def tensors_of(args) -> list[torch.Tensor]:
    return [arg for arg in args if isinstance(arg, torch.Tensor)]


def check_elementwise(op: str, args) -> torch.Tensor:
    """Tensor operands share shape, dtype and device; others are Python numbers (or symbolic
    sizes standing for one). Returns the first tensor operand."""
    tensors = tensors_of(args)
    check(bool(tensors), op, "needs at least one tensor operand")
    first = tensors[0]
    for tensor in tensors[1:]:
        if not tensor.shape == first.shape:
            check(False, op, f"shapes differ: {first.shape} vs {tensor.shape}")
        check(tensor.dtype == first.dtype, op, f"dtypes differ: {first.dtype} vs {tensor.dtype}")
        check(tensor.device == first.device, op, f"devices differ: {first.device} vs {tensor.device}")
    for arg in args:
        if not isinstance(arg, (torch.Tensor, Number, torch.SymInt, torch.SymFloat)):
            check(False, op, f"operand {arg!r} is not a tensor or number")
    return first


def canonical_dims(op: str, dims: Sequence[int], rank: int) -> tuple[int, ...]:
    """Check that `dims` are distinct, in-range, non-negative dimensions."""
    dims = tuple(dims)
    check(len(set(dims)) == len(dims), op, f"repeated dimension in {dims}")
    for dim in dims:
        check(0 <= dim < max(rank, 1), op, f"dimension {dim} out of range for rank {rank}")
    return dims
