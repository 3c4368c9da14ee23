"""Ops that run torch callables under torch.autograd, for the autodiff transform: the symbols
printed traces call as `autodiff.autograd_vjp` (the backward of one op by recomputation and
`torch.autograd.grad`), `autodiff.autograd_forward` (run an op recording its autograd graph)
and `autodiff.autograd_backward` (differentiate that graph). They live with the ops so that
running a printed trace needs no transform; `fulmen.transforms.autodiff.rules` builds the
statements that call them.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, Symbol
from fulmen.core.proxy import iter_proxies, map_proxies
from fulmen.core.symbol import Namespace
from fulmen.proxies import TensorProxy


def _differentiable(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex)


# NOTE [flat arguments]: most opaque calls take tensors and plain constants only; their leaves
# are the arguments themselves, in pytree's order (positional, then keyword values in insertion
# order), so the per-call paths below skip pytree's flatten/unflatten for them (GPT-2's SDPA with
# dropout runs here twice per forward and twice per backward). Anything else (a list of
# tensors, a nested tuple) goes through pytree as before.
_FLAT_LEAF_TYPES = frozenset({int, float, bool, complex, str, type(None), torch.dtype,
                              torch.device, torch.layout, torch.memory_format})


def _is_flat(values) -> bool:
    """Whether every value is a tensor or a constant pytree treats as a leaf."""
    return all(isinstance(v, torch.Tensor) or type(v) in _FLAT_LEAF_TYPES for v in values)


def _leaves(args, kwargs) -> list:
    """`pytree.tree_leaves((args, kwargs))`, without pytree for flat arguments."""
    if type(args) is tuple and type(kwargs) is dict:
        flat = [*args, *kwargs.values()]
        if _is_flat(flat):
            return flat
    return pytree.tree_leaves((args, kwargs))


def _primal_leaves(args, kwargs) -> list:
    """Distinct differentiable tensors among the arguments, in order (by name for proxies, by
    identity for real tensors)."""
    seen, leaves = set(), []
    for leaf in _leaves(args, kwargs):
        if _differentiable(leaf):
            key = leaf.name if isinstance(leaf, TensorProxy) else id(leaf)
            if key not in seen:
                seen.add(key)
                leaves.append(leaf)
    return leaves


def _per_argument(values: list, primals: list, grads) -> list:
    """One cotangent entry per argument from torch.autograd's gradients of the distinct primals.

    NOTE [one gradient per primal]: torch.autograd already sums the uses of a tensor passed
    twice (`cdist(x, x)`, `index_add(0, i, x)` on x itself), so its gradient goes to the first
    argument holding it and the others get None; giving it to each would double it.
    """
    pending = {p.name: g for p, g in zip(primals, grads)}
    return [map_proxies(lambda p: pending.pop(p.name, None), v) if iter_proxies(v) else None
            for v in values]


def autograd_vjp_impl(fn, args, kwargs, cotangent):
    """Backward of `fn(*args, **kwargs)` by torch.autograd: recompute, then `autograd.grad`.

    `fn` is a symbol (called outside tracing, it runs its implementation) or a callable.
    """
    primals = _primal_leaves(args, kwargs)
    with torch.enable_grad():
        leaves, args, kwargs = _swap_primals(args, kwargs, primals, _is_function(fn))
        outputs = fn(*args, **kwargs)
    out_leaves = _output_tensors(outputs)
    cotangents = list(cotangent) if isinstance(cotangent, (tuple, list)) else [cotangent]
    pairs = [(o, c) for o, c in zip(out_leaves, cotangents) if c is not None and o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                [c for _, c in pairs], allow_unused=True, materialize_grads=True)
    return tuple(grads)


def _autograd_vjp_meta(fn, args, kwargs, cotangent):
    return tuple(TensorProxy.like(p) for p in _primal_leaves(args, kwargs))


AUTODIFF_NAMESPACE = Namespace("autodiff", "fulmen.ops.torch_autograd",
                              "from fulmen.ops import torch_autograd as autodiff")
# Backward of one op by torch.autograd; executors run it with `autograd_vjp_impl`.
AUTOGRAD_VJP = Symbol("autograd_vjp", _autograd_vjp_meta, namespace=AUTODIFF_NAMESPACE,
                      is_prim=True, impl=autograd_vjp_impl, tags={"opaque"})


def _swap_primals(args, kwargs, primals, keep_leaves: bool = False):
    """Detached copies of the primals that require grad, and the arguments using them.
    NOTE [a parameter stays itself]: with `keep_leaves` (a user's `autograd.Function`), a leaf
    that requires grad, is no view and has no tensor hooks (a parameter) is used as it is:
    `torch.autograd.grad` gives its gradient without accumulating into `.grad`, and a Function
    that recomputes in its backward through a closure (`ctx.fn(x)` calling the module whose
    parameters it saved: a hand-written checkpoint) differentiates the very tensor it saved, as
    in eager (a copy was not in that graph: "appears to not have been used in the graph"). A
    leaf with hooks (`p.register_hook`) is copied: its hooks would run here and again when the
    outer backward hands it the gradient; a view's gradient would go to its base."""
    leaves = {id(p): p if keep_leaves and p.is_leaf and p.requires_grad and not p._is_view()
              and not p._backward_hooks else p.detach().requires_grad_() for p in primals}
    if type(args) is tuple and type(kwargs) is dict and _is_flat(args) \
            and _is_flat(kwargs.values()):  # NOTE [flat arguments]
        get = leaves.get
        return leaves, tuple([get(id(x), x) for x in args]), {
            k: get(id(x), x) for k, x in kwargs.items()}
    swap = lambda x: leaves.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return leaves, pytree.tree_map(swap, args), pytree.tree_map(swap, kwargs)


def _is_function(fn) -> bool:
    """Whether `fn` is the symbol of a user's `autograd.Function` (NOTE [a parameter stays
    itself])."""
    return "autograd_function" in getattr(fn, "tags", ())


def _detached(outputs):
    """`outputs` with every tensor detached (a tensor or a flat tuple without pytree)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if type(outputs) is tuple and _is_flat(outputs):
        return tuple([o.detach() if isinstance(o, torch.Tensor) else o for o in outputs])
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outputs)


def _output_tensors(outputs) -> list:
    """The tensors among `outputs`' leaves, in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    leaves = outputs if type(outputs) is tuple and _is_flat(outputs) \
        else pytree.tree_leaves(outputs)
    return [o for o in leaves if isinstance(o, torch.Tensor)]


def autograd_forward_impl(fn, args, kwargs, mask):
    """Run `fn` recording a torch.autograd graph for the primals selected by `mask` (one flag
    per differentiable tensor argument); return `(outputs, graph)`. `autograd_backward_impl`
    differentiates the graph: no recomputation, so random ops are exact."""
    primals = [p for p, wanted in zip(_primal_leaves(args, kwargs), mask) if wanted]
    with torch.enable_grad():
        leaves, args, kwargs = _swap_primals(args, kwargs, primals, _is_function(fn))
        outputs = fn(*args, **kwargs)
    return _detached(outputs), (outputs, tuple(leaves.values()))


def autograd_backward_impl(graph, specs, cotangent):
    """Gradients for the primals of an `autograd_forward_impl` call, given output cotangents."""
    outputs, inputs = graph
    out_leaves = _output_tensors(outputs)
    cotangents = list(cotangent) if isinstance(cotangent, (tuple, list)) else [cotangent]
    pairs = [(o, c) for o, c in zip(out_leaves, cotangents) if c is not None and o.requires_grad]
    # retain_graph: the outer backward may run again (retain_graph=True); the graph is freed with
    # the autograd node that holds it
    return tuple(torch.autograd.grad([o for o, _ in pairs], list(inputs), [c for _, c in pairs],
                                     allow_unused=True, materialize_grads=True, retain_graph=True))


def _forward_meta(*args, **kwargs):
    raise FulmenError("autograd_forward statements are built by the autodiff transform, not traced",
                      op="autodiff.autograd_forward")


def _backward_meta(graph, specs, cotangent):
    return tuple(TensorProxy(None, shape, dtype, device) for shape, dtype, device in specs)


AUTOGRAD_FORWARD = Symbol("autograd_forward", _forward_meta, namespace=AUTODIFF_NAMESPACE,
                          is_prim=True, impl=autograd_forward_impl, tags={"opaque", "random"})
AUTOGRAD_BACKWARD = Symbol("autograd_backward", _backward_meta, namespace=AUTODIFF_NAMESPACE,
                           is_prim=True, impl=autograd_backward_impl, tags={"opaque"})


__all__ = ["AUTODIFF_NAMESPACE", "AUTOGRAD_BACKWARD", "AUTOGRAD_FORWARD", "AUTOGRAD_VJP",
           "autograd_backward_impl", "autograd_forward_impl", "autograd_vjp_impl"]
