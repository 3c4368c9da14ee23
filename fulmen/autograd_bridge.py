"""The autograd bridge: running a forward/backward trace pair inside `torch.autograd`.

The compiled forward and backward traces sit inside one `torch.autograd.Function`, so
`loss.backward()`, `torch.autograd.grad`, gradient accumulation into `.grad`, parameter hooks,
optimizers and `retain_graph=True` behave as in eager. Double backward (`create_graph=True`)
raises: the saved residuals were computed without recording a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fulmen.core import NotYetSupportedError


@dataclass(frozen=True)
class CompiledPair:
    """Compiled forward (`inputs -> (output_leaves, residuals)`) and backward
    (`(*residuals, *cotangents) -> input grads`) callables, and which output leaves are
    differentiable.

    `backward_without`, when set, compiles the backward for calls in which the cotangents
    flagged True (one flag per cotangent) are unused: it takes only the others
    (`fulmen.transforms.unused_cotangents`); `variants` caches them by flags.
    """

    forward: Callable
    backward: Callable
    differentiable_outputs: tuple[bool, ...]
    has_object_residuals: bool = True
    backward_without: Callable | None = None
    variants: dict = field(default_factory=dict, compare=False)

    @property
    def all_outputs_differentiable(self) -> bool:
        return all(self.differentiable_outputs)


class FulmenAutogradFunction(torch.autograd.Function):
    """One node in the autograd graph for a whole compiled program."""

    @staticmethod
    def forward(ctx, pair: CompiledPair, *inputs):
        outputs, residuals = pair.forward(*inputs)
        ctx.pair = pair
        if pair.backward_without is not None:  # unused outputs get None, not zeros
            ctx.set_materialize_grads(False)
        # tensors go through save_for_backward (hooks, version checks); other residuals (kept
        # autograd graphs of opaque ops) ride on ctx
        objects = ()
        if pair.has_object_residuals:
            objects = [(i, r) for i, r in enumerate(residuals) if not isinstance(r, torch.Tensor)]
            residuals = [r for r in residuals if isinstance(r, torch.Tensor)]
        ctx.save_for_backward(*residuals)
        ctx.objects = objects
        if not pair.all_outputs_differentiable:
            ctx.mark_non_differentiable(*[
                out for out, flag in zip(outputs, pair.differentiable_outputs)
                if not flag and isinstance(out, torch.Tensor)
            ])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise NotYetSupportedError(
                "double backward (create_graph=True) through a fulmen-compiled function",
                op="torch.autograd.backward",
                hint="compute higher-order gradients eagerly, or use create_graph=False",
            )
        pair: CompiledPair = ctx.pair
        cotangents = [g for g, flag in zip(grads, pair.differentiable_outputs) if flag]
        residuals = list(ctx.saved_tensors)
        for index, obj in ctx.objects:
            residuals.insert(index, obj)
        backward = pair.backward
        if pair.backward_without is not None and any(g is None for g in cotangents):
            unused = tuple(g is None for g in cotangents)
            backward = pair.variants.get(unused)
            if backward is None:
                backward = pair.variants[unused] = pair.backward_without(unused)
            cotangents = [g for g in cotangents if g is not None]
        input_grads = backward(*residuals, *cotangents)
        return (None, *input_grads)


# The C++ apply under `Function.apply`, whose Python wrapper only adds functorch handling.
_apply = super(torch.autograd.Function, FulmenAutogradFunction).apply
_functorch_active = torch._C._are_functorch_transforms_active


def run_with_autograd(pair: CompiledPair, inputs: list) -> tuple:
    """Run `pair` on `inputs`, recording one autograd node; returns the output leaves."""
    if _functorch_active():
        return FulmenAutogradFunction.apply(pair, *inputs)
    return _apply(pair, *inputs)
