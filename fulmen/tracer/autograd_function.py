"""`torch.autograd.Function.apply` inside traced code.

`Function.apply` never reaches `__torch_function__`: PyTorch's C++ `apply` calls the user's
`forward` under no-grad, so tracing through it would record the forward's ops and lose the
user's `backward`. While a trace is recorded, `intercept_function_apply(ctx)` routes
`Function.apply` here instead:

- the call is recorded as one op, `fulmen.ops.autograd_function.function_symbol(cls)`, which
  runs `cls.apply` itself at run time; when the op is differentiated, the autodiff transform
  keeps its torch.autograd graph, so the backward is the user's;
- inside a `torch.no_grad()` region of a function called with grad enabled, `apply` runs as in
  eager, on the proxies: `forward`'s ops are traced inline (eager records no backward there);
- `torch.utils.checkpoint(..., use_reentrant=True)`'s Function is traced as the non-reentrant
  checkpoint, which computes the same values and gradients (`_reentrant_checkpoint`).

NOTE [Function.apply interception]: the patch is installed while at least one trace is being
recorded (a depth count, so nested and concurrent traces share it) and removed afterwards. A
call on a context other than the one being recorded runs the original `apply` untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointFunction, checkpoint

from fulmen.core import RunsEagerly
from fulmen.core.source import user_source_location
from fulmen.core.trace import get_tracectx
from fulmen.ops.autograd_function import autocast_state, function_symbol
from fulmen.tracer.patching import TracingPatch

_Function = torch.autograd.Function
_ORIGINAL_APPLY = _Function.__dict__["apply"]
_lock = threading.Lock()
_recording: dict[int, int] = {}  # id of each context being recorded -> its depth


def _traced_whole(ctx) -> bool:
    """Whether a call is recorded as one op: always, except inside a `torch.no_grad()` region of
    a function called with grad enabled (eager records no backward there). Which inputs get
    gradients is not known yet: `fulmen.grad` and `fulmen.vjp` choose them after tracing."""
    return torch.is_grad_enabled() or not ctx.differentiable


def _apply(cls, *args, **kwargs):
    ctx = get_tracectx()
    if ctx is None or id(ctx) not in _recording or ctx._internal or not any(
            isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs))):
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    args, kwargs = ctx._proxify((args, kwargs))
    args, kwargs = ctx.mutation.resolve_tree((args, kwargs))
    if cls is CheckpointFunction:
        return _reentrant_checkpoint(*args)
    if ctx.vmap_emulation is not None and ctx.vmap_emulation.checking():
        mapped = ctx.vmap_emulation.apply(ctx, cls, args, kwargs)
        if mapped is not None:
            return mapped
    if not _traced_whole(ctx):
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    return ctx.call(function_symbol(cls, autocast_state()), *args, **kwargs)


def _reentrant_checkpoint(function, preserve_rng_state: bool, *args):
    """`checkpoint(function, *args, use_reentrant=True)`: its values and gradients are those of
    the non-reentrant checkpoint (traced, the region recomputed in the backward), except that
    when no tensor argument requires grad, nothing inside gets a gradient (eager's reentrant
    checkpoint records no graph then; PyTorch warns)."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in args):
        return checkpoint(function, *args, use_reentrant=False,
                          preserve_rng_state=preserve_rng_state)
    with torch.no_grad():
        return function(*args)


_PATCHED_APPLY = classmethod(_apply)


_APPLY_PATCH = TracingPatch((_Function, "apply", _PATCHED_APPLY))


@contextlib.contextmanager
def intercept_function_apply(ctx) -> Iterator[None]:
    """Route `torch.autograd.Function.apply` calls made while `ctx` records to `ctx` (see the
    module docstring)."""
    with _lock:
        _recording[id(ctx)] = _recording.get(id(ctx), 0) + 1
    try:
        with _APPLY_PATCH.held():
            yield
    finally:
        with _lock:
            _recording[id(ctx)] -= 1
            if not _recording[id(ctx)]:
                del _recording[id(ctx)]


# Running backward inside traced code makes the call run eagerly (see `backward_refusal`):
# op, as written
BACKWARD_CALLS = {
    torch.Tensor.backward: ("torch.Tensor.backward", "loss.backward()"),
    torch.autograd.backward: ("torch.autograd.backward", "torch.autograd.backward()"),
    torch.autograd.grad: ("torch.autograd.grad", "torch.autograd.grad()"),
}


class BackwardInTrace(RunsEagerly):
    """The traced function runs a backward itself (`loss.backward()`, `torch.autograd.grad`)."""


def backward_refusal(func, why: str = "") -> BackwardInTrace:
    """The error for `loss.backward()` (or `torch.autograd.backward`/`grad`) inside a
    compiled function in a case `fulmen.tracer.backward_in_trace` does not trace (`why`):
    `fulmen.jit` runs such a call eagerly and raises this error only with `fullgraph=True`."""
    op, spelling = BACKWARD_CALLS[func]
    because = f" ({why})" if why else ""
    return BackwardInTrace(
        f"{spelling} inside a compiled function{because}: fulmen traces a plain backward of a "
        "one-element loss whose gradients go to an optimizer's parameters, and no other",
        op=op, where=user_source_location(),
        hint="compile the forward and the loss, and call backward on the result: loss = "
        "fulmen.jit(model_and_loss)(batch); loss.backward(); optimizer.step() (the optimizer "
        "step may be compiled on its own), or use fulmen.grad / fulmen.value_and_grad for "
        "gradients as values",
    )


__all__ = ["BACKWARD_CALLS", "BackwardInTrace", "backward_refusal", "intercept_function_apply"]
