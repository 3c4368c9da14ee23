"""Which torch calls return views of their input (`VIEW_FUNCTIONS`: call -> how to replay it),
read by the dispatcher and by the mutation tracker (`fulmen.tracer.mutation`)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import Proxy

T = torch.Tensor

# ---------------------------------------------------------------------------------------------
# Which calls are views
# ---------------------------------------------------------------------------------------------

_VIEW_METHODS = (
    "view", "view_as", "__getitem__", "select", "narrow", "transpose", "t", "permute", "squeeze",
    "unsqueeze", "expand", "expand_as", "unflatten", "movedim", "moveaxis", "swapaxes",
    "swapdims", "diagonal", "unfold", "unbind", "split", "split_with_sizes", "chunk",
    "tensor_split", "hsplit", "vsplit", "dsplit", "detach", "broadcast_to", "adjoint", "alias",
    "view_as_real", "view_as_complex", "conj", "resolve_conj", "resolve_neg", "atleast_1d",
    "atleast_2d", "atleast_3d",
)  # fmt: skip
_MAYBE_VIEW_METHODS = ("reshape", "reshape_as", "flatten", "ravel")
_VIEW_ATTRS = ("T", "mT", "H", "mH", "real", "imag", "data")
# Views whose element mapping depends on strides (or that mutating is an error for): reading
# them after their base changed, or mutating them, raises.
_UNREPLAYABLE = ("as_strided", "expand", "expand_as", "broadcast_to", "unfold")


# `x.view_as(y)` is `x.view(y.shape)`: y is read for its shape only
SHAPE_OF_SECOND = {T.view_as: T.view, T.reshape_as: T.reshape, T.expand_as: T.expand}


def replay_call(fn, args: tuple, kwargs: dict) -> tuple | None:
    """`(fn, args)` that repeat the view call `fn(base, *args, **kwargs)` on another call's
    real base (NOTE [a view of an input returned] in `fulmen.returned_views`): `x.view_as(y)`
    as `x.view(y.shape)`; None where an argument is a traced value or a symbolic number,
    whose value is another at the next call. `args` exclude the base."""
    if fn in SHAPE_OF_SECOND and len(args) == 1 and not kwargs \
            and isinstance(args[0], torch.Tensor):
        fn, args = SHAPE_OF_SECOND[fn], (tuple(args[0].shape),)
    if any(isinstance(v, _VARYING) for v in _leaves((args, kwargs))):
        return None
    return fn, args


_VARYING = (Proxy, torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def _leaves(tree) -> list:
    """The leaves of `tree`, a slice's start, stop and step among them (`x[:n]` with a
    symbolic `n` holds it in a slice, which pytree takes for a leaf)."""
    leaves = []
    for leaf in pytree.tree_leaves(tree):
        leaves += [leaf.start, leaf.stop, leaf.step] if isinstance(leaf, slice) else [leaf]
    return leaves


def _view_table() -> dict:
    table: dict = {}
    for names, maybe in ((_VIEW_METHODS, False), (_MAYBE_VIEW_METHODS, True)):
        for name in names:
            for space in (T, torch, torch.functional):
                fn = getattr(space, name, None)
                if callable(fn):
                    table.setdefault(fn, ("method", name, maybe))
    for name in _VIEW_ATTRS:
        table[getattr(T, name).__get__] = ("attr", name, False)
    table[T.as_strided] = table[torch.as_strided] = ("method", "as_strided", False)
    return table


VIEW_FUNCTIONS = _view_table()


def _is_basic_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(item is None or item is Ellipsis or isinstance(item, (int, slice))
               and not isinstance(item, bool) for item in items)


__all__ = ["SHAPE_OF_SECOND", "VIEW_FUNCTIONS", "replay_call"]
