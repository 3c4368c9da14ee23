"""The autograd bridge: running a forward/backward trace pair inside `torch.autograd`.

The compiled forward and backward traces sit inside one `torch.autograd.Function`, so
`loss.backward()`, `torch.autograd.grad`, gradient accumulation into `.grad`, parameter hooks,
optimizers and `retain_graph=True` behave as in eager.

NOTE [double backward by recomputation]: the saved residuals were computed without recording
a graph, and the compiled backward's kernels are not differentiable. A backward run with
`create_graph=True` (a gradient penalty, a PINN's derivative of the output by the input,
Hessian-vector products) recomputes the program's outputs from its inputs with the
computation trace's torch ops, recording a graph, and differentiates them with
`torch.autograd.grad(create_graph=True)`, as activation checkpointing does: the gradients it
returns carry a graph to the inputs. An input updated in place since the forward (its
version moved) makes it raise, and so does a program that draws random numbers, writes into
its inputs or has side effects (`CompiledPair.recompute` is None): its recomputation would not
be the forward that ran.

NOTE [a view of an intermediate returned]: eager's `return (x * 2)[0]` is a view of a tensor
the call made; an output of a custom Function that is a view of a tensor made inside it is one
autograd forbids to update in place ("Output 0 of FulmenAutogradFunction is a view and is being
modified inplace"), where eager updates it and differentiates through the update. Such
outputs leave the Function detached (`_intermediate_views_detached`: the same memory, no view
of anything), so an in-place update and its gradient are eager's; `_is_view()` and `._base`
answer as for a tensor that is no view (eager: its intermediate base), a known difference.

NOTE [outputs other outputs read] (`fulmen/read_outputs.py`): an output other outputs of the
call are computed from (`h` in `return b(h), h`) would get, at this one node, only the
gradient from outside the call; the outputs computed from it leave through nodes of their own.
"""

from __future__ import annotations

import collections
import operator
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

    `recompute`, when set, runs the program's computation trace (`inputs -> outputs`) with
    torch's differentiable ops, for a backward with `create_graph=True` (NOTE [double
    backward by recomputation]).
    """

    forward: Callable
    backward: Callable
    differentiable_outputs: tuple[bool, ...]
    has_object_residuals: bool = True
    backward_without: Callable | None = None
    variants: dict = field(default_factory=dict, compare=False)
    recompute: Callable | None = None
    # positions of the residual tensors the backward reads only the sizes of (NOTE [residuals
    # read for their sizes])
    size_only: tuple[int, ...] = ()
    # positions of the residuals that are inputs of the forward (NOTE [outputs backpropagated
    # in turns])
    input_residuals: frozenset[int] = frozenset()
    # the program run on fake tensors, for eager's gradient layouts and saved-tensor errors
    # (`fulmen.transforms.autodiff.eager_replay`); None where it has side effects
    replay: object | None = None
    # where `backward_without` is None (symbolic cotangent sizes): `unused -> (positions, reads)`:
    # the input gradients reached from unused outputs alone, None as in eager (the backward runs
    # on zeros for the unused, as autograd would materialize them), and the residuals it reads
    unreached: Callable | None = None

    @property
    def all_outputs_differentiable(self) -> bool:
        return all(self.differentiable_outputs)


def _version(x) -> int | None:
    """`x`'s version counter; None for non-tensors and inference tensors, which have none (and
    cannot be written outside inference mode)."""
    if not isinstance(x, torch.Tensor) or x.is_inference():
        return None
    return x._version


class _InferenceResidual(Exception):
    pass


def _savable(residual: torch.Tensor) -> torch.Tensor:
    """`residual`; raises `_InferenceResidual` where it is an inference tensor, which autograd
    refuses to save (`_saved_inference`)."""
    if residual.is_inference():
        raise _InferenceResidual
    return residual


def _saved_inference(ctx, pair: CompiledPair, inputs, residuals: list) -> None:
    """Save `residuals`, one of which is an inference tensor: an input made under
    `torch.inference_mode()`. Where eager saves it for backward, raise eager's error (NOTE
    [inference tensors saved for backward] in `fulmen.transforms.autodiff.eager_replay`);
    else eager reads it in the forward only (it saves what it computes from it, `a + b` for
    `(a + b).sin()`), and rematerialization kept it because it is cheaper to save than a
    result: a copy is saved."""
    if pair.replay is not None:
        pair.replay.refuse_saved_inference(inputs)
    ctx.save_for_backward(*[r.clone() if r.is_inference() else r for r in residuals])


def _refuse_inference_arguments(pair: CompiledPair, inputs) -> None:
    """After the forward failed: raise eager's error where eager saves an inference tensor
    argument for backward (NOTE [inference tensors saved for backward] in
    `fulmen.transforms.autodiff.eager_replay`). An op run by torch.autograd inside the forward
    (a 3-d convolution, a GRU) fails first on an inference tensor requiring grad ("Setting
    requires_grad=True on inference tensor")."""
    if pair.replay is not None and any(
            isinstance(x, torch.Tensor) and x.is_inference() for x in inputs):
        pair.replay.refuse_saved_inference(inputs)


def _sizes_of(residual):
    """NOTE [residuals read for their sizes]: a backward with symbolic sizes binds them from
    its arguments' sizes and strides (`s0 = y.shape[0]`); one that needs nothing else of a
    tensor (`y.sum()`'s backward) gets a meta tensor of its sizes and strides instead of the
    tensor, so updating it in place before the backward works, as in eager (which saves only
    the sizes), and the backward keeps no memory alive for it."""
    if not isinstance(residual, torch.Tensor):
        return residual
    return torch.empty_strided(residual.shape, residual.stride(), dtype=residual.dtype,
                               device="meta")


def _intermediate_views_detached(outputs, inputs):
    """`outputs` with each view of a tensor that is no input detached (NOTE [a view of an
    intermediate returned]); views of inputs are replayed outside (`returned_views`). Views
    of one base that another output also views or is stay views: detached, an in-place update
    of one would change the other unseen by autograd (its gradient silently eager's no more),
    where the Function's view raises."""
    views = [out for out in outputs if isinstance(out, torch.Tensor) and out._is_view()]
    if not views:
        return outputs
    given = {id(x) for x in inputs}
    bases = collections.Counter(id(view._base) for view in views)
    bases.update(id(out) for out in outputs if isinstance(out, torch.Tensor))
    return type(outputs)(
        out.detach() if isinstance(out, torch.Tensor) and out._is_view() and id(out) not in given
        and id(out._base) not in given and bases[id(out._base)] == 1 else out
        for out in outputs)


class FulmenAutogradFunction(torch.autograd.Function):
    """One node in the autograd graph for a whole compiled program."""

    @staticmethod
    def forward(ctx, pair: CompiledPair, *inputs):
        try:
            outputs, residuals = pair.forward(*inputs)
        except RuntimeError:
            _refuse_inference_arguments(pair, inputs)
            raise
        ctx.pair = pair
        if pair.size_only:
            residuals = list(residuals)
            for position in pair.size_only:
                residuals[position] = _sizes_of(residuals[position])
        if pair.recompute is not None:  # NOTE [double backward by recomputation]
            ctx.inputs = inputs
            ctx.versions = [_version(x) for x in inputs]
        if pair.backward_without is not None:  # unused outputs get None, not zeros
            ctx.set_materialize_grads(False)
        elif pair.unreached is not None:  # zeros made here, to tell the unused outputs
            ctx.set_materialize_grads(False)
            ctx.zeros_like = [(out.shape, out.dtype, out.device) if flag else None
                              for out, flag in zip(outputs, pair.differentiable_outputs)]
        # tensors go through save_for_backward (hooks, version checks); other residuals (kept
        # autograd graphs of opaque ops) ride on ctx
        objects = ()
        if pair.has_object_residuals:
            objects = [(i, r) for i, r in enumerate(residuals) if not isinstance(r, torch.Tensor)]
            residuals = [r for r in residuals if isinstance(r, torch.Tensor)]
        try:
            ctx.save_for_backward(*map(_savable, residuals))
        except _InferenceResidual:
            _saved_inference(ctx, pair, inputs, residuals)
        ctx.objects = objects
        if pair.replay is not None and pair.replay.pending:  # NOTE [eager's gradient layouts]
            ctx.first_inputs = inputs
        outputs = _intermediate_views_detached(outputs, inputs)
        if not pair.all_outputs_differentiable:
            ctx.mark_non_differentiable(*[
                out for out, flag in zip(outputs, pair.differentiable_outputs)
                if not flag and isinstance(out, torch.Tensor)
            ])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            return (None, *_recomputed_grads(ctx, grads))
        pair: CompiledPair = ctx.pair
        cotangents = [g for g, flag in zip(grads, pair.differentiable_outputs) if flag]
        backward = pair.backward
        if pair.backward_without is not None and any(g is None for g in cotangents):
            unused = tuple(g is None for g in cotangents)
            backward = pair.variants.get(unused)
            if backward is None:
                backward = pair.variants[unused] = pair.backward_without(unused)
        reached = tuple(g is not None for g in cotangents)
        reads = getattr(backward, "residuals_read", None)
        unreached = ()
        if pair.unreached is not None and not all(reached):
            unreached, reads = pair.unreached(tuple(not r for r in reached))
            zeros = [meta for meta, flag in zip(ctx.zeros_like, pair.differentiable_outputs)
                     if flag]
            cotangents = [g if g is not None else torch.zeros(meta[0], dtype=meta[1],
                                                              device=meta[2])
                          for g, meta in zip(cotangents, zeros)]
        residuals = _residuals(ctx, reads, reached)
        if residuals is None:  # freed, and not all kept: the forward again, with a graph
            with torch.enable_grad():
                return (None, *_recomputed_grads(ctx, grads))
        if pair.backward_without is not None and not all(reached):
            cotangents = [g for g in cotangents if g is not None]
        input_grads = backward(*residuals, *cotangents)
        replay = pair.replay
        if replay is not None:  # NOTE [eager's gradient layouts]
            if replay.pending and getattr(ctx, "first_inputs", None) is not None:
                replay.decide_layouts(ctx.first_inputs, grads, input_grads)
                ctx.first_inputs = None
            if replay.layouts is not None:
                input_grads = replay.relaid(input_grads)
        if unreached:
            input_grads = [None if i in unreached else g for i, g in enumerate(input_grads)]
        return (None, *input_grads)


def _residuals(ctx, reads: frozenset[int] | None, reached: tuple[bool, ...]) -> list | None:
    """The residuals (tensors and objects, in the backward's order) for a backward reading
    the tensors at positions `reads` (None: all) from the outputs flagged in `reached`; None
    where they were freed and the backward must recompute the forward.

    NOTE [outputs backpropagated in turns]: eager gives each output its own graph, so
    `a.backward()` then `b.backward()` works where `b` shares no saved tensor with `a`
    (a generator's and a discriminator's loss from one call). The one node of a compiled
    call saves the residuals of every output, and a backward without `retain_graph` frees
    them all. So a backward that leaves outputs without a cotangent keeps, on `ctx`, the
    residuals it does not read (eager keeps the graphs of the outputs it did not reach) and
    those that are inputs of the call (every eager node saving one holds its own reference).
    A later backward from outputs not reached before takes them; where it reads a residual
    an earlier backward read (a zero cotangent that does not fold away still reads the other
    output's activations: a GAN's two discriminator calls), it recomputes the forward from
    the inputs (as a double backward does; raising where the program cannot be run again:
    random draws). One from an output reached before raises eager's error. An input updated
    in place since raises as in eager (the first backward's `saved_tensors` checked every
    version against the forward's)."""
    kept = getattr(ctx, "kept", None)
    try:
        residuals = list(ctx.saved_tensors)
    except RuntimeError:
        if kept is None or any(map(operator.and_, reached, ctx.reached)):
            raise
        ctx.reached = tuple(map(operator.or_, reached, ctx.reached))
        if reads is None or any(i not in kept for i in reads):
            if getattr(ctx, "inputs", None) is None:  # (no `recompute`: random draws, ...)
                raise
            return None
        for i in reads:
            tensor, version = kept[i]
            if _version(tensor) != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    "by an inplace operation (a residual of a fulmen-compiled call, kept for "
                    "the backward of its other outputs)") from None
        residuals = [kept[i][0] if i in kept else None for i in range(ctx.count)]
        for index, obj in ctx.objects:
            residuals[index] = obj
        return residuals
    for index, obj in ctx.objects:
        residuals.insert(index, obj)
    if kept is None and reads is not None:
        ctx.count, ctx.reached = len(residuals), reached
        inputs = ctx.pair.input_residuals
        ctx.kept = {i: (r, _version(r)) for i, r in enumerate(residuals)
                    if (i not in reads or i in inputs) and isinstance(r, torch.Tensor)}
    elif kept is not None:  # (after a backward with `retain_graph=True`)
        ctx.reached = tuple(map(operator.or_, reached, ctx.reached))
    return residuals


def _recomputed_grads(ctx, grads) -> tuple:
    """The input gradients of a backward run with `create_graph=True`, with their graph (NOTE
    [double backward by recomputation])."""
    pair: CompiledPair = ctx.pair
    inputs = getattr(ctx, "inputs", None)
    if pair.recompute is None or inputs is None or any(
            _version(x) != version for x, version in zip(inputs, ctx.versions)):
        why = ("an input was updated in place after the forward" if inputs is not None else
               "the program draws random numbers, updates its inputs or has side effects")
        raise NotYetSupportedError(
            f"double backward (create_graph=True) through a fulmen-compiled function: {why}",
            op="torch.autograd.backward",
            hint="compute higher-order gradients eagerly, or use create_graph=False")
    wrt = [x for x, needed in zip(inputs, ctx.needs_input_grad[1:]) if needed]
    pairs = [(out, g) for out, g in zip(pair.recompute(*inputs), grads)
             if isinstance(out, torch.Tensor) and g is not None and out.requires_grad]
    found = iter(torch.autograd.grad([out for out, _ in pairs], wrt, [g for _, g in pairs],
                                     create_graph=True, allow_unused=True) if pairs and wrt
                 else [None] * len(wrt))
    return tuple(next(found) if needed else None for needed in ctx.needs_input_grad[1:])


# The C++ apply under `Function.apply`, whose Python wrapper only adds functorch handling.
_apply = super(torch.autograd.Function, FulmenAutogradFunction).apply
_functorch_active = torch._C._are_functorch_transforms_active


def run_with_autograd(pair: CompiledPair, inputs: list) -> tuple:
    """Run `pair` on `inputs`, recording one autograd node; returns the output leaves."""
    if _functorch_active():
        return FulmenAutogradFunction.apply(pair, *inputs)
    return _apply(pair, *inputs)
