"""`loss.backward()` inside traced code: a whole training step in one trace.

    @fulmen.jit
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        return loss

When the traced code calls `loss.backward()` (or `torch.autograd.backward(loss)`),
`record_backward` differentiates the statements recorded so far with fulmen's own autodiff
(`split_forward_backward`, as `fulmen.grad` does): the recorded prefix is replaced by the
split's forward, followed by a seed of ones and the backward statements (tagged
`TRACED_BACKWARD`: a later backward in the trace does not differentiate them). Each gradient is then
accumulated as eager's `AccumulateGrad` does: into the gradient the trace sees for the leaf
(`p.grad += g`, in place, when it has one), or it becomes the leaf's gradient (`p.grad = g`).
Later reads of `p.grad` in the trace (the optimizer's, `clip_grad_norm_`'s) see the new value,
and the tracer stores the gradients that were None after each call (`grad_stores`), as it
replays `p.grad = None`.

Only the plain case is traced; anything else raises `BackwardInTrace` and the call runs
eagerly (never a wrong answer):

- the leaves that receive a gradient must be tensors inside argument objects (the optimizer,
  closed over or passed: its parameters; `ctx.object_proxies`), each a real autograd leaf
  without hooks; a gradient for any other input (a tensor argument, a closed-over tensor no
  argument object holds, the jitted module's own parameters) is refused;
- a one-element floating loss computed in the trace with grad enabled; no `gradient`,
  `retain_graph`, `create_graph` or `inputs=` argument; anomaly mode off; `torch.autograd.grad`
  is always refused;
- no graph break before or after it (checked by the tracer at the end), and a new gradient
  laid out as its parameter (eager's layout contract). (A loss computed from parameters an
  earlier `opt.step()` of the call updated is refused before: `NoGradUpdate`'s read check.)

A trace holding a backward is compiled and run without torch.autograd (the gradients are its
values, `run_without_grad`); an output eager would return requiring grad (the loss) requires
grad through a spent graph: backward through it raises, as eager's does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, CallSiteTag, Trace
from fulmen.core.proxy import ObjectProxy, iter_proxies, strides_of
from fulmen.core.symbol import free_inputs
from fulmen.ops import prims
from fulmen.proxies import TensorProxy
from fulmen.tracer.autograd_function import backward_refusal

# `fulmen.transforms.autodiff.split_forward_backward`, which sits above the tracer: set by
# `fulmen.compile_miss` when it is imported (`use_autodiff`)
_split = None


def use_autodiff(split) -> None:
    """Make `record_backward` differentiate with `split` (`split_forward_backward`)."""
    global _split
    _split = split

_SIGNATURES = {
    torch.Tensor.backward: inspect.signature(torch.Tensor.backward),
    torch.autograd.backward: inspect.signature(torch.autograd.backward),
}


def _grad_of(proxy: TensorProxy):
    with torch._C.DisableTorchFunctionSubclass():
        return proxy.grad


def _set_grad(proxy: TensorProxy, value) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        proxy.grad = value


def _plain_loss(func, args: tuple, kwargs: dict):
    """The loss of a `backward` call without options, or None."""
    signature = _SIGNATURES.get(func)
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    values = dict(bound.arguments)
    loss = values.pop("self", None) if func is torch.Tensor.backward else values.pop("tensors")
    if isinstance(loss, (tuple, list)):
        loss = loss[0] if len(loss) == 1 else None
    plain = all(values.get(name) in (None, False) for name in (
        "gradient", "grad_tensors", "grad_variables", "retain_graph", "create_graph", "inputs"))
    return loss if plain and isinstance(loss, TensorProxy) else None


def _defined(bsyms) -> set[str]:
    names: set[str] = set()
    for bsym in bsyms:
        names |= bsym.output_names
    return names


def _all_names(bsyms) -> set[str]:
    """Every name `bsyms` assign, inside their decompositions too."""
    names: set[str] = set()
    stack = list(bsyms)
    while stack:
        bsym = stack.pop()
        names |= bsym.output_names
        stack.extend(bsym.subsymbols)
    return names


def _renamed(proxy, name: str):
    if isinstance(proxy, TensorProxy):
        with torch._C.DisableTorchFunctionSubclass():
            offset = torch.Tensor.storage_offset(proxy)
        return TensorProxy(name, proxy.shape, proxy.dtype, proxy.device,
                           requires_grad=proxy.requires_grad, strides=strides_of(proxy),
                           storage_offset=offset)
    if isinstance(proxy, ObjectProxy):
        return ObjectProxy(name, proxy.kind)
    return None


def _apart(ctx, forward: list, backward: list, grads: dict, func) -> list:
    """`backward` with each name it assigns that `forward` also assigns (inside a
    decomposition: the split copies a decomposition's statements into the backward, names and
    all, where forward and backward are two traces) given a new name; `grads` renamed too."""
    taken = _all_names(forward)
    clashes = _all_names(backward) & taken
    if not clashes:
        return backward
    new: dict[str, object] = {}
    for bsym in backward:
        stack = [bsym]
        while stack:
            current = stack.pop()
            for proxy in iter_proxies(current.output):
                if proxy.name in clashes and proxy.name not in new:
                    fresh = _renamed(proxy, ctx.names.new())
                    if fresh is None:
                        raise backward_refusal(func, f"the backward's name {proxy.name} is taken")
                    new[proxy.name] = fresh
            stack.extend(current.subsymbols)

    def rename(proxy):
        return new.get(proxy.name, proxy)

    for name, grad in list(grads.items()):
        grads[name] = rename(grad)
    return [bsym.renamed(rename, outputs=True) for bsym in backward]


def _of_the_backward(bsym: BoundSymbol) -> BoundSymbol:
    return bsym.replace(tags=bsym.tags | {CallSiteTag.TRACED_BACKWARD})


def _real_leaf(ctx, proxy: TensorProxy):
    """The real tensor inside an argument object that `proxy` stands for, or None."""
    for tensor_id, candidate in ctx.object_proxies.items():
        if candidate is proxy:
            return ctx.object_tensors.get(tensor_id)
    return None


def record_backward(ctx, func, args: tuple, kwargs: dict) -> None:
    """Record `loss.backward()` in the trace `ctx` records (see the module docstring).

    Raises:
        BackwardInTrace: a case this does not trace (the call runs eagerly).
    """
    loss = _plain_loss(func, args, kwargs)
    if loss is None:
        raise backward_refusal(func, "with arguments fulmen does not trace")
    loss = ctx.mutation.resolve(loss)
    breaks = ctx.breaks
    if breaks is not None and (breaks.breaks or breaks.done):
        raise backward_refusal(func, "after a graph break")
    if not (torch.is_grad_enabled() and ctx.differentiable) or torch.is_anomaly_enabled() \
            or ctx.vmap_emulation is not None:
        raise backward_refusal(func, "grad mode off, anomaly mode or vmap")
    if loss.name not in ctx.requires_grad_names or not loss.dtype.is_floating_point \
            or any(not isinstance(size, int) for size in loss.shape) or loss.numel() != 1:
        raise backward_refusal(func, "on a value that is not a one-element loss computed with grad")
    if ctx.mutation.fresh_roots or ctx.mutation.grad_leaves:
        raise backward_refusal(func, "with autograd leaves made inside the call, whose .grad eager fills")
    if _split is None:
        raise backward_refusal(func, "no autodiff installed")
    prefix = list(ctx.bsyms)
    free = tuple(free_inputs(prefix))
    wrt = [p for p in free if isinstance(p, TensorProxy) and p.requires_grad
           and (p.dtype.is_floating_point or p.dtype.is_complex)]
    if loss.name not in _defined(prefix):
        raise backward_refusal(func, "on a value the trace did not compute")
    trace = Trace("backward_prefix", free, tuple(prefix), loss,
                  provenance="the statements before loss.backward()")
    split = _split(trace, {p.name for p in wrt})
    grads = {p.name: g for p, g in zip(trace.args, split.backward.output) if g is not None}
    leaves = []
    for proxy in wrt:
        if proxy.name not in grads:
            continue  # not reached: eager leaves its .grad as it is
        real = _real_leaf(ctx, proxy)
        if real is None or not real.is_leaf or not real.requires_grad:
            raise backward_refusal(func, f"a gradient for {proxy.name}, which no argument object "
                           "(optimizer) holds as a leaf")
        if real._backward_hooks or getattr(real, "_post_accumulate_grad_hooks", None):
            raise backward_refusal(func, f"{proxy.name} has gradient hooks")
        if _grad_of(proxy) is None and strides_of(grads[proxy.name]) != strides_of(proxy):
            # eager's new .grad is laid out as its parameter
            raise backward_refusal(func, f"the gradient of {proxy.name} is laid out otherwise")
        leaves.append(proxy)
    if not leaves:
        raise backward_refusal(func, "no parameter of an argument object receives a gradient")
    forward = list(split.forward.bsyms)
    if not _defined(prefix) <= _defined(forward):
        raise backward_refusal(func, "the forward's statements change under autodiff")
    residual_count = len(split.forward.output[1])
    seeds = [BoundSymbol(prims.full, (tuple(c.shape), 1.0, c.dtype, c.device), {}, c)
             for c in split.backward.args[residual_count:]]
    for bsym in [*forward, *split.backward.bsyms]:  # names the split made: never made again
        for name in _all_names([bsym]) | bsym.input_names:
            ctx.names.reserve(name)
    backward = _apart(ctx, forward, list(split.backward.bsyms), grads, func)
    # the seeds and the backward run without grad (a later backward in the trace must not
    # differentiate them: eager's `.grad` has no graph)
    ctx.bsyms[:] = [*forward, *(_of_the_backward(b) for b in (*seeds, *backward))]
    ctx.spent_names |= _defined(prefix)
    ctx.backward_in_trace = True
    for proxy in leaves:
        grad = grads[proxy.name]
        old = _grad_of(proxy)
        if old is None:
            _set_grad(proxy, grad)
            if all(done is not proxy for done in ctx.step_grads):
                ctx.step_grads.append(proxy)
        else:  # eager's AccumulateGrad adds into the gradient in place
            with torch.no_grad():
                ctx.mutation.functionalize(torch.Tensor.add_, (old, grad), {})


def finish_backward(ctx, trace: Trace) -> dict:
    """What the compiled program of `trace` (recorded by `ctx`) needs to know of its backward:
    `{}` without one, else `{"spent": names}`, the returned values requiring grad whose graph
    eager's backward spent (computed before it, or after it from such values only:
    `run_without_grad`).

    Raises:
        BackwardInTrace: the trace has graph breaks, or returns a value requiring grad
            computed after the last backward (eager gives it a live graph; the trace runs
            without torch.autograd).
    """
    if not ctx.backward_in_trace:
        return {}
    func = torch.Tensor.backward
    if ctx.breaks is not None and ctx.breaks.breaks:
        raise backward_refusal(func, "in a function with graph breaks")
    inputs = {p.name for p in trace.args}
    # values computed after the backward from the leaves, not through a spent graph only
    live = {p.name for p in trace.args if isinstance(p, TensorProxy) and p.requires_grad}
    for bsym in trace.bsyms:
        if bsym.input_names & live and not bsym.output_names & ctx.spent_names:
            live |= {p.name for p in bsym.proxy_outputs
                     if isinstance(p, TensorProxy) and p.requires_grad}
    spent = set()
    for proxy in iter_proxies(trace.output):
        if not isinstance(proxy, TensorProxy) or not proxy.requires_grad \
                or proxy.name in inputs:
            continue
        if proxy.name in live:
            raise backward_refusal(func, f"the function returns {proxy.name}, computed with "
                                   "grad after it")
        spent.add(proxy.name)
    return {"spent": frozenset(spent)}


def grad_stores(ctx, paths: dict[str, tuple], stores: list) -> None:
    """Append to `stores` (epilogue stores: `(root, path, step, template)`) a store of the
    final `.grad` of each argument-object tensor whose gradient a backward in the trace made
    (it was None): `paths` maps a proxy's name to its object path."""
    for proxy in ctx.step_grads:
        final = _grad_of(proxy)
        if final is not None:
            root, path = paths[proxy.name]
            stores.append((root, path, ("attr", "grad"), final))


# the input requiring grad that makes `_SpentGraph`'s outputs require grad (never reached)
_ANCHOR = torch.zeros((), requires_grad=True)


class _SpentGraph(torch.autograd.Function):
    """An output eager would return with a graph its `loss.backward()` already spent:
    requires grad, and backward through it raises as eager's does."""

    @staticmethod
    def forward(ctx, tensor, anchor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "Trying to backward through the graph a second time (fulmen: the compiled training "
            "step's own loss.backward() already ran through it)")


def run_without_grad(fn, output, spent: frozenset[str]) -> Callable:
    """`fn` (a compiled trace holding a backward, whose output is `output`: the trace's, with
    the user's leaves first when the tracer's epilogue adds values) run under `no_grad`; each
    returned tensor computed with grad before a backward (named in `spent`) comes back
    requiring grad through a spent graph (`_SpentGraph`), as eager's loss does."""
    nested = isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], tuple) \
        and isinstance(output[1], tuple)
    leaves = output[0] if nested else pytree.tree_leaves(output)
    flags = [isinstance(p, TensorProxy) and p.requires_grad and p.name in spent for p in leaves]

    def spent(values):
        with torch.enable_grad():
            return [_SpentGraph.apply(v, _ANCHOR) if flag and isinstance(v, torch.Tensor) else v
                    for v, flag in zip(values, flags)]

    @functools.wraps(fn)
    def run(*args):
        with torch.no_grad():
            out = fn(*args)
        if not any(flags) or not torch.is_grad_enabled():
            return out
        if nested:
            return (tuple(spent(out[0])), out[1])
        values, spec = pytree.tree_flatten(out)
        return pytree.tree_unflatten(spent(values), spec)

    return run


__all__ = ["finish_backward", "grad_stores", "record_backward", "run_without_grad", "use_autodiff"]
