"""Tensors made to require grad inside the traced function (`requires_grad_()` on a new tensor).

NOTE [fresh leaves]: `torch.zeros_like(q).requires_grad_()` (HF MRA), or
`hidden_states = input_values[:, None]; hidden_states.requires_grad = True` (the feature encoder
of wav2vec2, HuBERT, WavLM, data2vec-audio..., for gradient checkpointing), makes a tensor that
did not require grad a new autograd leaf. Its gradient is accumulated into that tensor's own
`.grad`, which nobody outside the function can read unless the tensor escapes; the gradients of
the function's real inputs are the same with or without it. So the tracer lets such a *fresh
leaf* be: the proxy answers `requires_grad` (and so do the proxies computed from it with grad
enabled, as in eager), but nothing is differentiated with respect to it. That is eager's
behaviour as long as nothing observable depends on the leaf's graph:

- a result (returned, or stored through the epilogue) that requires grad only because of a
  fresh leaf would come back from the compiled call without `requires_grad` and without a
  `grad_fn`: such a call runs eagerly (`FreshLeafGraph`);
- an in-place update of a fresh leaf's base tensor (or of a tensor that does not depend on a
  fresh leaf with a value that does) would need the leaf's identity kept through
  functionalization: the call runs eagerly too. An update of the leaf itself under no_grad
  (`nn.init` filling a new `nn.Parameter`) keeps it a fresh leaf;
- `requires_grad_()` on a trace input (an argument, a parameter, a captured tensor) changes the
  caller's tensor: the call runs eagerly, as before.

`ctx.fresh_grad_names` holds the names of the fresh leaves and of the values that depend on one
but on no input requiring grad; `Functionalizer.fresh_roots` the roots of the fresh leaves.

NOTE [a view made under no_grad]: in eager, `with torch.no_grad(): v = x[1:]` of an `x` that
requires grad gives a view that requires grad with no grad_fn: a new leaf, as a fresh leaf is,
so `v * 2` computed after the block requires grad and has a grad_fn. The tracer detaches
results made under no_grad (the `NO_GRAD_DETACH` statement) and, for a view, makes the detached
value a fresh leaf (`mark_no_grad_view`), also a view taken of such a view: it answers
`requires_grad` as eager's does, and a result computed from it (`v * 2`) runs eagerly as fresh
leaves make it. Such a view returned, or a view of it returned, is exempt where its views have
plain arguments (`ctx.no_grad_views`: name -> that): the compiled call gives it back by running
the same views on the argument (NOTE [a view of an input returned] in `fulmen.returned_views`),
which is eager's answer; so is one written into another tensor under no_grad.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import RunsEagerly
from fulmen.core.source import user_source_location
from fulmen.proxies import TensorProxy
from fulmen.tracer.view_calls import VIEW_FUNCTIONS, replay_call

T = torch.Tensor
_REQUIRES_GRAD_SET = T.requires_grad.__set__


class AutogradGraphRead(RunsEagerly):
    """The traced code reads the autograd graph of a traced tensor (NOTE [graph reads]): the
    call runs eagerly."""


class FreshLeafGraph(RunsEagerly):
    """Something observable depends on the graph of a tensor made to require grad inside the
    function (NOTE [fresh leaves]): the call runs eagerly."""


def is_requires_grad_set(func, name: str) -> bool:
    """Whether `func` (called `name`) turns a tensor's `requires_grad` flag on or off."""
    return name == "requires_grad_" or func == _REQUIRES_GRAD_SET


def _flag(func, args: tuple, kwargs: dict):
    if func == _REQUIRES_GRAD_SET:
        return args[1] if len(args) > 1 else None
    return args[1] if len(args) > 1 else kwargs.get("requires_grad", True)


def make_fresh_leaf(functionalizer, func, args: tuple, kwargs: dict) -> bool:
    """Record `t.requires_grad_()` / `t.requires_grad = True` on a tensor the function made
    (NOTE [fresh leaves]); return False (nothing recorded) where the call is not that."""
    ctx = functionalizer.ctx
    target, flag = args[0] if args else None, _flag(func, args, kwargs)
    if flag is not True or not isinstance(target, TensorProxy):
        return False
    if target.name in ctx.fresh_grad_names:
        return True  # already requires grad: eager changes nothing
    if target.name in functionalizer.inputs or target.name in ctx.requires_grad_names:
        return False
    if not (target.dtype.is_floating_point or target.dtype.is_complex):
        return False  # eager raises: the eager call says so
    view = functionalizer.views.get(target.name)
    if view is not None and not view.exact:
        return False
    root = view.root if view is not None else target.name
    if functionalizer.roots.get(root) is not None and functionalizer.roots[root].version:
        return False  # its base was updated in place: the user's tensor is not this SSA value
    functionalizer.fresh_roots.add(root)
    mark_fresh(ctx, target)
    return True


def check_fresh_update(functionalizer, root_name: str, target: TensorProxy, value: TensorProxy,
                       op: str) -> bool:
    """Raise `FreshLeafGraph` for an in-place update that would lose track of a fresh leaf
    (NOTE [fresh leaves]); return True where the updated tensor keeps requiring grad through a
    fresh leaf (an update of the leaf under no_grad, as `nn.init` makes of a new
    `nn.Parameter`, or any update of a value computed from one)."""
    ctx = functionalizer.ctx
    fresh = ctx.fresh_grad_names
    if not fresh:
        return False
    if root_name in functionalizer.fresh_roots:
        if (target.name in fresh and not torch.is_grad_enabled()
                and value.name not in ctx.requires_grad_names):
            return True
    elif target.name in fresh:  # it keeps requiring grad (`y.add_(1)` under no_grad)
        return value.name not in ctx.requires_grad_names
    elif value.name not in fresh or (
            value.name in ctx.no_grad_views and not torch.is_grad_enabled()):
        return False  # (a view made under no_grad, written under no_grad: no graph to keep)
    raise FreshLeafGraph(
        "an in-place update of a tensor made to require grad inside the function (or of its "
        "base, or with a value computed from it)", op=op, where=user_source_location())


def mark_fresh(ctx, proxy: TensorProxy) -> None:
    """Make `proxy` a fresh leaf's value: it answers `requires_grad` (NOTE [fresh leaves])."""
    ctx.fresh_grad_names.add(proxy.name)
    ctx.fresh_leaf_names.add(proxy.name)
    with torch._C.DisableTorchFunctionSubclass():
        if not proxy.requires_grad:
            T.requires_grad_(proxy)


# `x.detach()` and `x.data` are views that never require grad
_NOT_REQUIRING_GRAD = frozenset({T.detach, torch.detach, T.data.__get__})


def mark_no_grad_view(ctx, func, args: tuple, kwargs: dict, out) -> None:
    """After view call `func` on `args` gave `out` (registered as views): make the outputs
    fresh leaves where eager's view requires grad with no grad_fn, a view of a tensor requiring
    grad made under no_grad, or a view of such a view (NOTE [a view made under no_grad])."""
    if not ctx.differentiable or func in _NOT_REQUIRING_GRAD or not args \
            or not isinstance(args[0], TensorProxy):
        return
    source = args[0].name
    if source not in ctx.no_grad_views and (
            torch.is_grad_enabled() or source not in ctx.requires_grad_names):
        return
    maybe = VIEW_FUNCTIONS[func][2]  # reshape: a view only where the tracer decided it is
    # returned, it is replayed on the argument only with plain arguments (else: runs eagerly)
    replayable = (ctx.no_grad_views.get(source, False) or source in ctx.mutation.inputs) \
        and replay_call(func, tuple(args[1:]), kwargs) is not None
    views = ctx.mutation.views
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, TensorProxy) and (leaf.dtype.is_floating_point
                                              or leaf.dtype.is_complex) \
                and leaf.name in views and (not maybe or views[leaf.name].exact):
            ctx.no_grad_views[leaf.name] = replayable
            mark_fresh(ctx, leaf)


def refuse_escaping_fresh(ctx, leaves: list, returned: int) -> None:
    """Raise `FreshLeafGraph` if one of `leaves` (the first `returned` the results, then the
    epilogue's stored values) requires grad only because of a fresh leaf (NOTE [fresh
    leaves]); a view made under no_grad (or a view of one) may be returned (NOTE [a view made
    under no_grad])."""
    if not ctx.fresh_grad_names:
        return
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, TensorProxy) or k < returned and ctx.no_grad_views.get(leaf.name):
            continue
        if leaf.name in ctx.fresh_grad_names:
            raise FreshLeafGraph(
                f"{leaf.name}, a result of the function, requires grad only because of a new "
                "autograd leaf made inside it (a tensor given requires_grad_(), or a view of "
                "a tensor requiring grad taken under torch.no_grad()); the compiled call would "
                "return it without a grad_fn", op="Tensor.requires_grad_")


# NOTE [graph reads]: a proxy has no autograd history, so by itself it answers `is_leaf` True and
# `grad_fn` None, where eager's tensor computed from one requiring grad is a non-leaf with a
# grad_fn: code branching on `h.grad_fn is None` or `h.is_leaf` took the other branch, silently,
# and a global module hook that walks the graph (`register_multi_grad_hook`, which
# `FlopCounterMode`'s module tracker calls on every module output) crashed on the None. So a
# proxy requiring grad answers as eager's tensor would: a fresh leaf (NOTE [fresh leaves]) is a
# leaf with no grad_fn, a value computed inside the function is no leaf, and its grad_fn (an
# autograd node, which a trace cannot give) makes the call run eagerly; an argument's answer
# depends on the caller's tensor (a leaf, or a value computed before the call), which the cache
# key does not cover, so reading either makes the call run eagerly. Parameters and buffers are
# the module's real tensors while tracing, answering for themselves.
_IS_LEAF_GET = T.is_leaf.__get__
GRAPH_READS = frozenset({_IS_LEAF_GET, T.grad_fn.__get__})


def graph_read(ctx, func, proxy: TensorProxy):
    """Eager's answer of `func` (`Tensor.is_leaf` or `Tensor.grad_fn`) for `proxy`, which
    requires grad, or raise `AutogradGraphRead` where a trace cannot give it (NOTE [graph
    reads])."""
    what = "is_leaf" if func == _IS_LEAF_GET else "grad_fn"
    if proxy.name in ctx.mutation.inputs:
        raise AutogradGraphRead(
            f"reading .{what} of {proxy.name}, an argument requiring grad: whether the caller's "
            "tensor is a leaf is not part of the cache key", op=f"Tensor.{what}",
            where=user_source_location())
    if proxy.name in ctx.fresh_leaf_names:
        with torch._C.DisableTorchFunctionSubclass():
            return func(proxy)
    if func == _IS_LEAF_GET:
        return False
    raise AutogradGraphRead(
        f"reading .grad_fn of {proxy.name}, a value requiring grad computed inside the "
        "function: a compiled call has no autograd node for it", op="Tensor.grad_fn",
        where=user_source_location())
