"""`value_and_grad_trace`: one trace computing a scalar function and its gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fulmen.core import BoundSymbol, FulmenError, Trace
from fulmen.ops import prims
from fulmen.transforms.autodiff.split import split_forward_backward
from fulmen.transforms.base import transform


@transform("value and grad")
def value_and_grad_trace(trace: Trace, wrt: Sequence[str]) -> Trace:
    """Rewrite `trace` (returning a scalar tensor) to return `(value, grads)`.

    `grads` has one gradient per input named in `wrt`, in that order: the forward statements,
    a cotangent of ones for the value, then the backward statements, in a single trace.

    Raises:
        FulmenError: if the output is not a single floating-point tensor with one element.
    """
    value = trace.output
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point):
        raise FulmenError("the function must return a single floating-point tensor with one "
                          "element to take its gradient", op="fulmen.grad")
    split = split_forward_backward(trace, set(wrt), zeros_for_unused=True)
    residual_count = len(split.forward.output[1])
    cotangents = split.backward.args[residual_count:]
    seeds = [BoundSymbol(prims.full, (tuple(c.shape), 1.0, c.dtype, c.device), {}, c)
             for c in cotangents]
    by_name = {p.name: g for p, g in zip(trace.args, split.backward.output)}
    grads = tuple(by_name[name] for name in wrt)
    bsyms = (*split.forward.bsyms, *seeds, *split.backward.bsyms)
    return trace.replace(bsyms=bsyms, output=(value, grads))
