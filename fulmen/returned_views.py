"""Outputs of a differentiated program that eager returns as views: given back by running the
same view ops outside the program's autograd Function.

NOTE [a view of an input returned]: a program run as one `torch.autograd.Function` would return
a view of an input (`return x[1:3].t()`) as a view made inside a custom Function, which
autograd forbids to update in place (`y = f(x); y.mul_(2)` works in eager), and an opaque view
(`diagonal`, `unfold`) as a tensor sharing the input's memory without being a view, whose
in-place update autograd would not see (silently wrong gradients). So the same view ops run on
the argument, outside the Function, give eager's view with eager's autograd (the Function's
own output goes unused); an input returned as it is comes back as the argument itself (a leaf,
with its own `.grad`). The same holds for a view of another output (`return h, h[:, 0]`): it
is replayed on that output, so updating either in place is seen by autograd as in eager.

`returned_views(trace)` finds them once per compilation; `replay(returned, inputs, outputs)`
runs them on each call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from fulmen.core import CallSiteTag, Tag, Trace, any_tagged
from fulmen.proxies import TensorProxy
from fulmen.tracer.view_calls import VIEW_FUNCTIONS, replay_call

_EFFECTS = frozenset({Tag.SIDE_EFFECT})


def returned_views(trace: Trace) -> tuple[tuple[int, int, bool, tuple], ...]:
    """`(output leaf, source position, of_output, chain)` for each output leaf that is an input
    returned as it is (`return x, y * 2`: chain `()`; not updated in place: that is a new
    value written back) or made by view ops alone from an input (`return x[1:3].t()`, also the
    ops that view where they can, `reshape`, and the opaque views, `diagonal`) or from another
    output leaf (`of_output`: `return h, h[:, 0]`, with a non-empty chain). `chain` is
    `((torch_fn, args, kwargs, no_grad, index), ...)`, each applied to the previous result
    (then its `index`th leaf where not None: `unbind`), under `torch.no_grad()` where
    `no_grad` holds (NOTE [a view of an input returned]). The detach the tracer adds to a view
    made under no_grad is left out: eager's view made there requires grad (its base does)
    with no grad_fn, and so does the replayed one. Views only where the chain's other
    arguments are plain Python values (or, for `view_as`/`reshape_as`/`expand_as`, a tensor
    read for its shape), of inputs the trace does not update (written back), in traces with no
    other side effect. Ordered so that an output a chain starts from is made before it.

    >>> returned_views(trace_of(lambda x: (x * 2, x.t())))  # doctest: +SKIP
    ((1, 0, False, ((torch.t, (), {}, False, None),)),)
    """
    written = {bsym.args[0].name for bsym in trace.bsyms if Tag.WRITE_BACK in bsym.sym.tags}
    effects = any_tagged([b for b in trace.bsyms if Tag.WRITE_BACK not in b.sym.tags], _EFFECTS)
    positions = {p.name: i for i, p in enumerate(trace.args) if isinstance(p, TensorProxy)}
    producers = {p.name: bsym for bsym in trace.bsyms for p in bsym.proxy_outputs}
    leaves = pytree.tree_leaves(trace.output)
    made = {}  # name -> the first output leaf that gives it
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, TensorProxy) and leaf.name not in positions:
            made.setdefault(leaf.name, k)
    found = []
    for k, leaf in enumerate(leaves):
        chain, name = [], getattr(leaf, "name", None)
        while isinstance(leaf, TensorProxy) and name not in positions:
            if effects:
                chain = None
                break
            if chain and made.get(name, k) != k:
                break  # a view of another output
            bsym = producers.get(name)
            if bsym is not None and CallSiteTag.NO_GRAD_DETACH in bsym.tags:
                leaf = bsym.args[0]
                name = leaf.name
                continue
            link = None if bsym is None else _replayable_view(bsym, leaf)
            if link is None:
                chain = None
                break
            chain.append(link)
            leaf = bsym.args[0]
            name = leaf.name
        if chain and name in written:
            continue  # a view of an input updated in place: the Function's output
        if chain is not None and isinstance(leaf, TensorProxy) and name in positions:
            found.append((k, positions[name], False, tuple(reversed(chain))))
        elif chain and isinstance(leaf, TensorProxy) and made.get(name, k) != k:
            found.append((k, made[name], True, tuple(reversed(chain))))
    return _ordered(found)


def _ordered(found: list) -> tuple:
    """`found` with each view of an output after the entry that replays that output."""
    done: list = []
    pending = list(found)
    replayed = {entry[0] for entry in found}
    while pending:
        ready = [e for e in pending if not e[2] or e[1] not in replayed
                 or any(d[0] == e[1] for d in done)]
        if not ready:  # (cannot happen: a chain starts from an output made before it)
            break  # the rest keep the Function's outputs
        done += ready
        pending = [e for e in pending if e not in ready]
    return tuple(done)


def _replayable_view(bsym, leaf: TensorProxy) -> tuple | None:
    """The chain link that replays `bsym` (a view, or a call that views where it can) on the
    real first argument to give `leaf`, or None."""
    fn = bsym.sym.torch_fn
    if fn is None or not (Tag.VIEW in bsym.sym.tags or fn in VIEW_FUNCTIONS) or not bsym.args \
            or not isinstance(bsym.args[0], TensorProxy):
        return None
    kwargs = dict(bsym.kwargs)
    call = replay_call(fn, tuple(bsym.args[1:]), kwargs)
    if call is None:
        return None
    fn, args = call
    outputs = pytree.tree_leaves(bsym.output)
    index = None
    if len(outputs) != 1 or outputs[0] is not bsym.output:
        matches = [i for i, out in enumerate(outputs) if out is leaf]
        if len(matches) != 1 or len(bsym.proxy_outputs) != len(outputs):
            return None
        index = matches[0]
    return fn, args, kwargs, CallSiteTag.NO_GRAD in bsym.tags, index


def replay(returned: tuple, inputs: tuple, outputs: tuple) -> list:
    """The Function's `outputs` with each entry of `returned` (`returned_views`) replaced by
    its views run on the argument or output it starts from."""
    outputs = list(outputs)
    for k, position, of_output, chain in returned:
        view = outputs[position] if of_output else inputs[position]
        for fn, args, kwargs, no_grad, index in chain:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                view = fn(view, *args, **kwargs)
            if index is not None:
                view = pytree.tree_leaves(view)[index]
        outputs[k] = view
    return outputs


__all__ = ["replay", "returned_views"]
