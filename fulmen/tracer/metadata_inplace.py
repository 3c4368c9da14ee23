"""In-place changes of a tensor's shape and strides (`x.unsqueeze_(1)`, `x.t_()`), traced.

NOTE [in-place metadata changes]: `x.unsqueeze_(1)` changes the sizes and strides of the
tensor object `x` itself, and every Python reference to it sees the new shape. A proxy's
metadata is fixed (the statements that made it keep their types), so the tracer records the
out-of-place view instead (`t5 = ltorch.unsqueeze(t4, 1)`, registered as a view of `x`'s root
like any view: later in-place updates of either alias the other, as in eager) and *rebinds*
the user's references: every local variable (and closure cell) of the user's frames on the
stack that holds `x` now holds the new proxy, and the call returns it. The old proxy becomes
stale (`StaleTensorProxy`): any later use of it by user code (a torch call, `.shape`,
`.size()`, returning it, storing it in a module) raises `MetadataMutation`, so a reference the
tracer did not rebind (an element of a list, an attribute) makes the call run eagerly rather
than read the old shape. HF BigBird calls `unsqueeze_` on locals in its attention and
question-answering head.

Only tensors the call makes itself are traced this way. The caller's tensors (arguments,
parameters, buffers, captured globals) and views of them would change shape for the caller
too, and a leaf made to require grad inside the call makes eager raise (a tensor computed
from one is refused too); for those the call runs eagerly, as before (`MetadataMutation`).
"""

from __future__ import annotations

import ctypes
import sys

import torch

from fulmen.core import RunsEagerly, get_tracectx
from fulmen.core.source import is_internal, user_source_location
from fulmen.proxies import TensorProxy

T = torch.Tensor


class MetadataMutation(RunsEagerly):
    """An in-place change of a tensor's metadata (`x.t_()` on an argument, `requires_grad_()`
    on a new tensor, `resize_`) or F.embedding's `max_norm` renormalisation: the call runs
    eagerly."""


# the in-place metadata ops traced as their out-of-place view (NOTE [in-place metadata changes])
VIEW_FOR_METADATA_OP = {
    "unsqueeze_": T.unsqueeze, "squeeze_": T.squeeze, "transpose_": T.transpose, "t_": T.t,
    "swapdims_": T.swapdims, "swapaxes_": T.swapaxes, "as_strided_": T.as_strided,
}  # fmt: skip


class StaleTensorProxy(TensorProxy):
    """A proxy whose tensor changed shape in place (NOTE [in-place metadata changes]): the
    trace's statements keep reading it, user code may not."""

    @property
    def shape(self) -> torch.Size:
        if get_tracectx() is not None and not is_internal(sys._getframe(1).f_code.co_filename):
            raise stale_use(self, "Tensor.shape")
        return self._fulmen_meta[0]


def stale_use(proxy: TensorProxy, op: str) -> MetadataMutation:
    """The error for user code reading `proxy` after an in-place metadata change rebound it."""
    return MetadataMutation(
        f"{proxy.name} is used after an in-place change of its shape through a reference "
        "fulmen could not update (a container element or an attribute)", op=op,
        where=user_source_location(),
        hint="use the out-of-place form (x = x.unsqueeze(1))")


def trace_metadata_change(functionalizer, name: str, args: tuple, kwargs: dict):
    """`args[0].<name>(*args[1:], **kwargs)` for a tensor the call made, traced as its view
    with the user's references rebound (NOTE [in-place metadata changes]); None when the call
    must run eagerly instead."""
    target = args[0]
    if type(target) is not TensorProxy or name not in VIEW_FOR_METADATA_OP:
        return None
    view = functionalizer.views.get(target.name)
    root = view.root if view is not None else target.name
    if root in functionalizer.inputs or root in functionalizer.fresh_roots \
            or root in functionalizer.poisoned:
        return None
    ctx = functionalizer.ctx
    if target.name not in ctx.requires_grad_names and (
            target.requires_grad or target.name in ctx.fresh_grad_names
            or root in functionalizer.grad_leaves):
        return None  # a leaf made to require grad inside the call (or computed from one)
    new = ctx.handle(VIEW_FOR_METADATA_OP[name], (T,), args, kwargs)
    if new is target:
        return target
    _rebind_locals(target, new)
    target.__class__ = StaleTensorProxy
    functionalizer.mutated = True  # reads resolve (and refuse) stale proxies from here on
    return new


def _rebind_locals(old, new) -> None:
    """Every local variable and closure cell of the user's frames on the stack that holds `old`
    holds `new` afterwards."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            names = frame.f_locals
            held = [key for key, value in names.items() if value is old]
            for key in held:
                names[key] = new  # a write-through view of the frame from Python 3.13 on
            if held and sys.version_info < (3, 13):
                _LOCALS_TO_FAST(ctypes.py_object(frame), ctypes.c_int(0))
        frame = frame.f_back


_LOCALS_TO_FAST = getattr(ctypes.pythonapi, "PyFrame_LocalsToFast", None)
