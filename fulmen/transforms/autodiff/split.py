"""Reverse-mode autodiff: split a traced program into a forward and a backward trace.

Given the computation trace and which inputs require grad:

1. Forward pass over the statements: a statement reading a value that requires grad is
   *differentiable*. It stays whole in the forward (see NOTE [whole ops in forward]).
2. Backward pass, in reverse order, inside a new recording context: each differentiable
   statement whose outputs received a cotangent calls its VJP rule (prims, composite rules of
   torch-level ops, opaque ops), or recomputes its decomposition and calls the rules of the
   parts; cotangents of a value used several times are summed.
3. Residuals are the forward values the backward trace reads. The forward trace returns
   `(outputs, residuals)`; the backward trace takes `(*residuals, *cotangents)` and returns one
   gradient per forward input (None for inputs that do not require grad).

Reference: the forward/backward split follows reverse-mode AD as in JAX's `vjp`
(Frostig, Johnson, Leary: "Compiling machine learning programs via high-level tracing", 2018).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.utils._pytree as pytree

from fulmen.core import (
    BoundSymbol,
    CallSiteTag,
    FulmenError,
    Tag,
    Trace,
    TraceCtx,
    any_tagged,
    flatten,
    tracing,
)
from fulmen.core.proxy import ObjectProxy, Proxy, iter_proxies, map_proxies
from fulmen.core.trace import reserved_names
from fulmen.ops import prims
from fulmen.ops.torch_autograd import AUTOGRAD_FORWARD
from fulmen.proxies import TensorProxy, differentiable_value
from fulmen.tracer.dispatch import TracerCtx
from fulmen.transforms.autodiff.registry import bound_arguments, rule_for, saving_forward_for
from fulmen.transforms.autodiff.rules import (
    accumulate,
    autograd_forward,
    differentiable_outputs,
    graph_vjp,
    opaque_vjp,
)
from fulmen.transforms.dce import free_values, live_bsyms


@dataclass(frozen=True)
class ForwardBackward:
    """The result of `split_forward_backward`.

    Attributes:
        forward: returns `(output_leaves, residuals)`; `output_leaves` is the flat tuple of the
            original output's leaves.
        backward: takes `(*residuals, *cotangents)`, one cotangent per differentiable output
            leaf, and returns a tuple with one gradient (or None) per forward input.
        output_spec: treespec of the original output.
        differentiable_outputs: for each output leaf, whether it is a floating tensor that
            depends on an input requiring grad (and so has a cotangent input in backward).
    """

    forward: Trace
    backward: Trace
    output_spec: object
    differentiable_outputs: tuple[bool, ...]


def _has_rule(bsym: BoundSymbol) -> bool:
    return rule_for(bsym.sym) is not None or "opaque" in bsym.sym.tags


def _is_differentiable(bsym: BoundSymbol) -> bool:
    return any(map(differentiable_value, bsym.proxy_outputs))


def _is_complex(bsym: BoundSymbol) -> bool:
    """NOTE [complex values]: the VJP rules are written for real values, and PyTorch's complex
    gradients are conjugated (the cotangent of `a` in `a * b` is `grad * b.conj()`), so an op
    reading or producing a complex tensor is differentiated by torch.autograd, as an opaque op
    is (HF Llama 4's rotary embedding multiplies complex tensors)."""
    proxies = (*bsym.read_proxies, *bsym.proxy_outputs)
    return any(isinstance(p, TensorProxy) and p.dtype.is_complex for p in proxies)


def _by_autograd(bsym: BoundSymbol) -> bool:
    """Whether the forward runs `bsym` under torch.autograd and keeps its graph for the
    backward: an opaque op without a rule, or an op on complex values (NOTE [complex values])."""
    if rule_for(bsym.sym) is None and "opaque" in bsym.sym.tags:
        return True
    return bsym.sym.impl is not None and not bsym.has_side_effects and _is_complex(bsym)


def _augment(bsym: BoundSymbol, requires: set[str], out: list[BoundSymbol],
             differentiable: list[BoundSymbol], graphs: dict[int, tuple], names) -> None:
    """Append `bsym` to the forward statements `out`, tracking values that require grad.

    NOTE [whole ops in forward]: a differentiable torch-level op without a rule still runs whole
    in the forward (eager's kernel, so forward values equal eager's); its backward recomputes the
    decomposition from the op's inputs and applies the rules of the parts. Only an op whose
    decomposition draws random numbers (dropout, attention with dropout) is replaced by its
    decomposition in the forward, so the backward reuses the very mask the forward drew; such
    an op takes that path even when it has a rule (a rule recomputes from the inputs, which
    would draw again). An opaque op runs under
    torch.autograd in the forward and keeps its graph for the backward (no recomputation).
    An op with a saving forward (attention) is replaced by the statements it records, which
    also keep what its fused backward needs (NOTE [saving forwards] in `registry.py`).
    `graphs` maps the id of a statement to its kept `(graph, wrt)` or its saving backward.
    """
    if (not bsym.input_names & requires or not _is_differentiable(bsym)
            or Tag.NOT_DIFFERENTIABLE in bsym.sym.tags or bsym.sym is AUTOGRAD_FORWARD
            or CallSiteTag.TRACED_BACKWARD in bsym.tags):
        # (an `autograd_forward` is an earlier backward's forward, in a trace holding several
        # `loss.backward()`s: its graph is spent, and wrapping it again made a statement no
        # executor runs; an earlier backward's statements make values that do not require
        # grad: `p.grad` read after a backward is a constant. Not `NO_GRAD`: common
        # subexpression elimination may keep a no_grad statement for a repeat made with grad,
        # whose values the tracer's detach alone keeps from the gradient)
        out.append(bsym)  # nothing flows through it (e.g. a comparison, an argmax, zeros_like)
        return
    if not _has_rule(bsym) and not bsym.subsymbols:
        raise FulmenError("has no VJP rule, so gradients cannot flow through it",
                          op=bsym.sym.id, where=bsym.source)
    if (not _has_rule(bsym) and bsym.has_side_effects) \
            or any_tagged(bsym.subsymbols, {Tag.RANDOM}):
        for sub in bsym.subsymbols:
            _augment(sub.replace(source=bsym.source), requires, out, differentiable, graphs, names)
        return
    produced = {p.name for p in bsym.proxy_outputs if differentiable_value(p)}
    saved = _saving_forward(bsym, requires, names)
    if saved is not None:
        statements, graphs[id(bsym)] = saved
        out.extend(statements)
    elif _by_autograd(bsym):
        graph = ObjectProxy(names.new("g"), "autograd graph")
        wrt = bsym.input_names & requires
        graphs[id(bsym)] = (graph, wrt)
        out.append(autograd_forward(bsym, graph, wrt))
        produced &= differentiable_outputs(bsym, wrt)  # e.g. not the mean/rstd of a norm
    else:
        out.append(bsym)
    differentiable.append(bsym)
    requires.update(produced)


def _saving_forward(bsym: BoundSymbol, requires: set[str], names):
    """`(statements, backward)` from the saving forward of `bsym`'s symbol (NOTE [saving
    forwards] in `registry.py`), or None when it has none or declines this call site."""
    saving = saving_forward_for(bsym.sym)
    if saving is None:
        return None
    scratch = TraceCtx("forward")
    scratch.names = names
    with tracing(scratch):
        result = saving(bsym, requires)
    if result is None:
        return None
    new_output, backward = result
    renamed = dict(zip_proxies(new_output, bsym.output))
    rename = lambda p: renamed.get(p.name, p)  # noqa: E731
    statements = [b.replace(args=map_proxies(rename, b.args), kwargs=map_proxies(rename, b.kwargs),
                            output=map_proxies(rename, b.output), source=bsym.source)
                  for b in scratch.bsyms]
    return statements, backward


# torch-level ops whose output holds their input's elements in the same (row-major) order
_SAME_ORDER = frozenset({"reshape", "view", "flatten", "contiguous", "Tensor_contiguous"})


def _relayout(bsym: BoundSymbol, proxy: Proxy) -> bool:
    """Whether `bsym` only rearranges `proxy` (its first argument) into its single output
    (same dtype and element count: not a `view(dtype)`)."""
    name = bsym.sym.name.rstrip("_")
    if not bsym.args or bsym.args[0] is not proxy or len(bsym.proxy_outputs) != 1:
        return False
    out = bsym.proxy_outputs[0]
    return (isinstance(out, TensorProxy) and out.dtype == proxy.dtype
            and out.numel() == proxy.numel()
            and (name in _SAME_ORDER or name in ("transpose", "permute")))


def _undo(bsym: BoundSymbol, value: TensorProxy) -> TensorProxy:
    """A tensor with the values of `bsym`'s input, from one with the values of its output."""
    source = bsym.args[0]
    name = bsym.sym.name.rstrip("_")
    if name in ("transpose", "permute"):
        arguments = bound_arguments(bsym.sym, bsym.args, bsym.kwargs)[1:]
        dims = [d for a in arguments for d in (a if isinstance(a, (tuple, list)) else (a,))
                if isinstance(d, int)]
        order = list(range(source.ndim))
        if name == "transpose":
            first, second = (d % max(source.ndim, 1) for d in dims[:2])
            order[first], order[second] = order[second], order[first]
        else:
            for position, dim in enumerate(d % max(source.ndim, 1) for d in dims):
                order[dim] = position
        if order != list(range(source.ndim)):
            value = prims.permute(value, tuple(order))
    if tuple(value.shape) != tuple(source.shape):
        value = prims.reshape(value, tuple(source.shape))
    return value


def _same_values(proxy: Proxy, readers: dict[str, list[BoundSymbol]]):
    """NOTE [values kept under another layout]: a forward value the backward reads is saved
    unless the backward can get it back. When the forward only rearranges it (attention's
    output, transposed, made contiguous and reshaped for the output projection, whose
    backward saves that copy anyway), the same values are read back from the end of that chain
    through views, so keeping them costs no bytes. Returns `proxy` when there is no chain, or
    when the view read back would not have a unit innermost stride, as eager's output has:
    PyTorch's CPU flash-attention backward reads `out` as if its last dim were innermost, and
    gave wrong query and key gradients for a view through a permutation that moves it
    (`out.permute(2, 0, 3, 1).contiguous().reshape(...)`); the output is saved then."""
    chain = []
    current = proxy
    while isinstance(current, TensorProxy):
        step = next((b for b in readers.get(current.name, ()) if _relayout(b, current)), None)
        if step is None:
            break
        chain.append(step)
        current = step.output
    value = current
    for step in reversed(chain):
        value = _undo(step, value)
    if value is not proxy and not _unit_innermost(value):
        return proxy
    return value


def _unit_innermost(tensor: TensorProxy) -> bool:
    """Whether `tensor`'s last dim is known to be innermost (stride 1, or a size of 1)."""
    if tensor.ndim == 0:
        return True
    size, stride = tensor.shape[-1], tensor.stride()[-1]
    return (type(size) is int and size == 1) or (type(stride) is int and stride == 1)


def zip_proxies(new, old) -> list[tuple[str, Proxy]]:
    """`(new proxy's name, old proxy)` pairs of two values with the same structure."""
    return [(n.name, o) for n, o in zip(iter_proxies(new), iter_proxies(old))]


def _backward_of(bsym: BoundSymbol, grads: dict[str, TensorProxy], ctx: TracerCtx,
                 graphs: dict[int, tuple], readers: dict[str, list[BoundSymbol]]) -> None:
    """Record the backward of one forward statement (see NOTE [whole ops in forward])."""
    if callable(graphs.get(id(bsym))):  # a saving forward's backward
        output = _same_values(bsym.output, readers)
        results = graphs[id(bsym)](_output_cotangents(bsym, grads), output)
        _accumulate_results(bsym, results, bound_arguments(bsym.sym, bsym.args, bsym.kwargs), grads)
        return
    if id(bsym) in graphs:
        graph, wrt = graphs[id(bsym)]
        results = graph_vjp(bsym, graph, wrt, _output_cotangents(bsym, grads))
        _accumulate_results(bsym, results, list(bsym.args) + list(bsym.kwargs.values()), grads)
        return
    if _has_rule(bsym):
        _run_rule(bsym, _output_cotangents(bsym, grads), grads)
        return
    parts = flatten(bsym, stop=_has_rule)
    computed = bsym.output_names
    for part in parts:  # recompute the intermediates the forward never materialised
        if not part.output_names & computed:
            ctx.bsyms.append(part)
    for part in reversed(parts):
        cotangent = _output_cotangents(part, grads)
        if not _is_differentiable(part) or all(g is None for g in pytree.tree_leaves(cotangent)):
            continue
        if not _has_rule(part):
            raise FulmenError("has no VJP rule, so gradients cannot flow through it",
                              op=part.sym.id, where=bsym.source)
        _run_rule(part, cotangent, grads)


def _output_cotangents(bsym: BoundSymbol, grads: dict[str, TensorProxy]):
    """The cotangent argument of a rule: a proxy, or a tuple for multi-output symbols."""
    if isinstance(bsym.output, Proxy):
        return grads.get(bsym.output.name)
    return pytree.tree_map(
        lambda leaf: grads.get(leaf.name) if isinstance(leaf, Proxy) else None, bsym.output
    )


def _run_rule(bsym: BoundSymbol, cotangent, grads: dict[str, TensorProxy]) -> None:
    rule = rule_for(bsym.sym)
    if rule is None:
        values = list(bsym.args) + list(bsym.kwargs.values())
        results = opaque_vjp(bsym, cotangent)
    else:
        values = bound_arguments(bsym.sym, bsym.args, bsym.kwargs)
        results = rule(cotangent, bsym.output, *values)
    _accumulate_results(bsym, results, values, grads)


def _accumulate_results(bsym: BoundSymbol, results, values: list, grads: dict) -> None:
    """Add a rule's per-argument cotangents into `grads`."""
    if not isinstance(results, (tuple, list)):
        results = (results,)
    for value, grad in zip(values, results):
        if grad is None:
            continue
        value_leaves = list(iter_proxies(value))
        grad_leaves = list(iter_proxies(grad)) if isinstance(value, (tuple, list)) else [grad]
        for primal, g in zip(value_leaves, grad_leaves):
            if g is not None and differentiable_value(primal):
                grads[primal.name] = accumulate(grads.get(primal.name), g)


def split_forward_backward(trace: Trace, wrt: set[str] | None = None, *,
                           zeros_for_unused: bool = False) -> ForwardBackward:
    """Split `trace` into forward and backward traces (see the module docstring).

    Gradients are taken with respect to the inputs named in `wrt`, by default the inputs whose
    proxies have `requires_grad=True`. An input in `wrt` that receives no gradient gets None
    (as `.grad` stays None in eager), or zeros with `zeros_for_unused` (as `torch.func.grad`).

    Raises:
        FulmenError: when a differentiable statement has neither a VJP rule nor a decomposition.
    """
    if wrt is None:
        wrt = {p.name for p in trace.args if p.requires_grad}
    requires = {p.name for p in trace.args if p.name in wrt and differentiable_value(p)}
    wanted = set(requires)
    forward_bsyms: list[BoundSymbol] = []
    differentiable: list[BoundSymbol] = []
    graphs: dict[int, tuple] = {}
    ctx = TracerCtx("backward")
    ctx.names = reserved_names(trace.args, trace.bsyms)
    for bsym in trace.bsyms:
        _augment(bsym, requires, forward_bsyms, differentiable, graphs, ctx.names)

    output_leaves, output_spec = pytree.tree_flatten(trace.output)
    readers: dict[str, list[BoundSymbol]] = {}
    for bsym in forward_bsyms:
        for name in bsym.input_names:
            readers.setdefault(name, []).append(bsym)

    cotangents: list[TensorProxy] = []
    grads: dict[str, TensorProxy] = {}
    flags = []
    for leaf in output_leaves:
        is_diff = isinstance(leaf, TensorProxy) and leaf.name in requires
        flags.append(is_diff)
        if is_diff:
            cotangent = TensorProxy(ctx.names.named(f"grad_{leaf.name}"), leaf.shape, leaf.dtype,
                                    leaf.device, strides=None)
            cotangents.append(cotangent)
            grads[leaf.name] = accumulate_outside(grads.get(leaf.name), cotangent, ctx)

    with tracing(ctx):
        for bsym in reversed(differentiable):
            # rules also give cotangents to values that do not require grad (`k.detach()`,
            # a norm's mean): nothing flows back through those, as in eager, so an input
            # reached only through them keeps a None gradient, not zeros
            for name in bsym.output_names - requires:
                grads.pop(name, None)
            cotangent = _output_cotangents(bsym, grads)
            if all(g is None for g in pytree.tree_leaves(cotangent)) or cotangent is None:
                continue
            first_new = len(ctx.bsyms)
            _backward_of(bsym, grads, ctx, graphs, readers)
            for index in range(first_new, len(ctx.bsyms)):  # point backward lines at the source
                ctx.bsyms[index] = ctx.bsyms[index].replace(source=bsym.source)
        input_grads = tuple(
            (_grad_or_zeros(grads.get(p.name), p) if zeros_for_unused else grads.get(p.name))
            if p.name in wanted else None
            for p in trace.args
        )

    # rules also compute cotangents of values that do not require grad: dropping those first
    # keeps their operands out of the residuals
    backward_bsyms = live_bsyms(ctx.bsyms, input_grads)
    residuals = free_values(backward_bsyms, input_grads, cotangents, sizes_from=trace.args)

    forward = trace.replace(name="forward", bsyms=tuple(forward_bsyms),
                            output=(tuple(output_leaves), residuals))
    backward = Trace("backward", (*residuals, *cotangents), backward_bsyms, input_grads,
                     provenance="constructed by autodiff")
    return ForwardBackward(forward, backward, output_spec, tuple(flags))


def _grad_or_zeros(grad, primal):
    """An input that requires grad but is not used gets zeros, as `torch.func.grad` returns."""
    if grad is not None:
        return grad
    return prims.full(tuple(primal.shape), 0, primal.dtype, primal.device)


def accumulate_outside(existing, cotangent, ctx):
    """Accumulate an output cotangent (an output listed twice gets the sum)."""
    if existing is None:
        return cotangent
    with tracing(ctx):
        return accumulate(existing, cotangent)


__all__ = ["ForwardBackward", "split_forward_backward"]
