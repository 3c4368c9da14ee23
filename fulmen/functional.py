"""Functional autodiff: `fulmen.grad`, `fulmen.value_and_grad`, `fulmen.vjp`.

    dloss = fulmen.grad(loss_fn, argnums=1)       # d loss / d args[1]
    dloss(x, w)                                   # one compiled trace: forward and backward
    out, vjp_fn = fulmen.vjp(fn, x, w)
    dx, dw = vjp_fn(torch.ones_like(out))

The inputs need not require grad, and grad mode does not matter: the gradient computation is
part of the compiled trace, not of torch.autograd's graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.utils._pytree as pytree

from fulmen.executors import resolve_executors
from fulmen.jit import JittedFunction
from fulmen.pipeline import lower
from fulmen.tracer import trace_program
from fulmen.transforms import dce
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.autodiff.eager_replay import eager_replay


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, *, executors=None) -> Callable:
    """Return `g(*args) -> (fn(*args), grads)`, grads of `fn`'s scalar output w.r.t.
    `args[argnums]` (a tuple when `argnums` is a sequence), compiled as one trace.

    Each selected argument may be a tensor or a pytree of floating tensors; its gradient has the
    same structure. Inputs that do not influence the value get zeros.

    Raises:
        FulmenError: if `fn` does not return a one-element floating tensor.
    """
    return JittedFunction(fn, executors, grad_argnums=argnums)


def grad(fn: Callable, argnums: int | Sequence[int] = 0, *, executors=None) -> Callable:
    """Like `value_and_grad` but returns only the gradients.

    Example:
        >>> dsq = fulmen.grad(lambda x: (x * x).sum())
        >>> dsq(torch.tensor([1.0, 2.0]))
        tensor([2., 4.])
    """
    both = value_and_grad(fn, argnums, executors=executors)

    def grad_fn(*args, **kwargs):
        return both(*args, **kwargs)[1]

    grad_fn.__wrapped__ = both
    return grad_fn


def vjp(fn: Callable, *primals, executors=None):
    """Evaluate `fn(*primals)` and return `(outputs, vjp_fn)`.

    `vjp_fn(cotangents)` takes cotangents shaped like `outputs` (for the floating-point tensor
    outputs; others are ignored) and returns one gradient per primal (zeros where a primal
    does not influence the outputs; None for non-tensor primals).
    """
    program = trace_program(fn, primals, {})
    trace = dce(program.trace)
    positions = program.tensor_positions
    inputs = list(pytree.tree_leaves((primals, {})))
    wrt = {trace.args[i].name for i, _ in enumerate(positions)
           if inputs[positions[i]].dtype.is_floating_point}
    split = split_forward_backward(trace, wrt, zeros_for_unused=True)
    chosen = resolve_executors(executors)
    forward = lower(split.forward, chosen)
    backward = lower(dce(split.backward), chosen)

    tensor_inputs = [inputs[p] for p in positions]
    replay = eager_replay(trace)
    wrt_at = tuple(i for i, p in enumerate(trace.args[:len(positions)]) if p.name in wrt)
    output_leaves, residuals = forward(*tensor_inputs, *program.captured)
    outputs = pytree.tree_unflatten(list(output_leaves), split.output_spec)
    if program.output_spec is not None:
        outputs = pytree.tree_unflatten(list(outputs), program.output_spec)

    def vjp_fn(cotangents):
        leaves = pytree.tree_leaves(cotangents)
        if len(leaves) != len(split.differentiable_outputs):
            raise ValueError(f"expected {len(split.differentiable_outputs)} cotangents, got "
                             f"{len(leaves)}")
        chosen_cotangents = [c for c, flag in zip(leaves, split.differentiable_outputs) if flag]
        grads = backward(*residuals, *chosen_cotangents)
        if replay is not None:  # NOTE [eager's gradient layouts]
            picked = [grads[i] for i in wrt_at]
            if replay.pending:
                replay.decide_layouts([*tensor_inputs, *program.captured], leaves, picked, wrt_at)
            if replay.layouts is not None:
                grads = list(grads)
                for i, grad in zip(wrt_at, replay.relaid(picked)):
                    grads[i] = grad
        per_leaf = [None] * len(inputs)
        for index, position in enumerate(positions):
            per_leaf[position] = grads[index]
        flat_primals, spec = pytree.tree_flatten(primals)
        return tuple(pytree.tree_unflatten(per_leaf[: len(flat_primals)], spec))

    return outputs, vjp_fn


__all__ = ["grad", "value_and_grad", "vjp"]
