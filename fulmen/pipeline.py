"""The pass pipeline: the one order in which passes run, for `jit` and the functional API.

    grouped attention (`transforms/grouped_attention.py`)
        -> additive attention masks (`transforms/attention_masks.py`) -> dce -> cse
        -> user transforms -> [value_and_grad (functional grad)]
        -> [autodiff split -> rematerialization -> backward: dce, cse, layer norm reuse
            (`transforms/layer_norm_reuse.py`)]   (an input requires grad)
        -> claiming by the executors (fusion regions, then operators)
        -> statements reading nothing the call brings run once, at compile time
           (`executors/torch/constants.py`) -> `del` insertion
        -> large float32 CPU linears on oneDNN (`executors/torch/onednn_linear.py`)
        -> large products of two matrices into pool blocks (`executors/torch/pooled_outputs.py`)
        -> in-place relu on a dying matrix product, index_copy into a written input
           (`executors/torch/inplace.py`, `inplace_index.py`, `inplace_lists.py`)
        -> a written-back input's new value computed into the input (`executors/torch/
           reinplace.py`)
        -> Python compilation of the printed trace
    the backward's claiming, `del`s, in-place rewrites and compilation: at its first call, or
        when its stages are asked for (NOTE [the backward compiles when first needed])
    later, at the first backward call with a new pattern of unused outputs: the backward
        before claiming -> unused-cotangent folding -> claiming -> constants -> `del`s -> in-place
        rewrites

`compile_trace` runs it on one trace (a whole program, or one segment of a program with graph
breaks) and returns the callable with every stage's trace; `lower` is its tail (claiming,
deletion, compilation) for traces another transform produced (`fulmen.vjp`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from fulmen.autograd_bridge import CompiledPair, run_with_autograd
from fulmen.core import Tag, Trace, any_tagged
from fulmen.core.ambient import without_autocast
from fulmen.core.proxy import iter_proxies
from fulmen.executors import Executor
from fulmen.executors.claim import claim_executors
from fulmen.executors.torch.constants import fold_constants
from fulmen.executors.torch.inplace import relu_in_place
from fulmen.executors.torch.inplace_index import index_copy_in_place
from fulmen.executors.torch.inplace_lists import aten_lists_in_place
from fulmen.executors.torch.onednn_linear import onednn_linear
from fulmen.executors.torch.pooled_outputs import pooled_outputs
from fulmen.executors.torch.reinplace import reinplace
from fulmen.logs import get_logger
from fulmen.proxies import TensorProxy
from fulmen.read_outputs import find_read_outputs, give_outputs
from fulmen.returned_views import replay, returned_views
from fulmen.tracer.sym_ops import memoized_symbolic_ops
from fulmen.transforms import dce, delete_last_used
from fulmen.transforms.attention_masks import additive_attention_masks
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.autodiff.eager_replay import eager_replay, grads_laid_out_as_eager
from fulmen.transforms.autodiff.joint import value_and_grad_trace
from fulmen.transforms.cse import cse
from fulmen.transforms.grouped_attention import grouped_attention
from fulmen.transforms.layer_norm_reuse import reuse_layer_norm
from fulmen.transforms.remat import rematerialize as rematerialize_split
from fulmen.transforms.unused_cotangents import fold_unused_cotangents, unreached_gradients
from fulmen.tree import CompiledSegment

_PASSES = get_logger("passes")


# after claiming: statements reading nothing the call brings run once (constants), `del`
# insertion, large float32 linears on oneDNN, large outputs from the pool, then the in-place
# rewrites that read where values die
_AFTER_CLAIMING = (fold_constants, delete_last_used, onednn_linear, pooled_outputs,
                   relu_in_place, index_copy_in_place, aten_lists_in_place, reinplace)


def _claimed_stages(trace: Trace, executors: Sequence[Executor]) -> list[Trace]:
    """`trace` claimed by `executors`, then each stage of `_AFTER_CLAIMING` that changed it."""
    stages = [claim_executors(trace, executors)]
    for stage in _AFTER_CLAIMING:
        result = stage(stages[-1])
        if result is not stages[-1]:
            stages.append(result)
    return stages


def lower(trace: Trace, executors: Sequence[Executor]) -> Callable:
    """Claim `trace`'s statements by `executors`, insert `del`s (and the in-place rewrites),
    compile it to Python; the callable never re-applies the caller's autocast (traces hold
    autocast's casts)."""
    return without_autocast(_claimed_stages(trace, executors)[-1].python_callable())


def compile_trace(trace: Trace, executors: Sequence[Executor], *, transforms=(), wrt=None,
                  rematerialize: bool = True) -> tuple[CompiledSegment, dict[str, float]]:
    """Run the pipeline on `trace`; return the compiled segment and seconds per stage.

    Args:
        trace: a traced program (or segment).
        executors: the executors that claim statements, in priority order.
        transforms: user passes `Trace -> Trace`, run after dce.
        wrt: names of inputs to differentiate in-trace (`fulmen.grad`), or None.
        rematerialize: choose the saved-for-backward values by a min cut (`transforms.remat`).

    When grad mode is on and an input requires grad, the callable runs the forward and
    backward traces inside one `torch.autograd.Function` (`fulmen.autograd_bridge`).
    """
    with memoized_symbolic_ops():  # NOTE [symbolic arithmetic kept by the ShapeEnv]
        return _compile_trace(trace, executors, transforms, wrt, rematerialize)


def _compile_trace(trace: Trace, executors: Sequence[Executor], transforms, wrt,
                   rematerialize: bool) -> tuple[CompiledSegment, dict[str, float]]:
    seconds: dict[str, float] = {}
    traces = [trace]
    backward_traces: list[Trace] = []
    variants: dict[tuple[bool, ...], list[Trace]] = {}

    def run(stages: list[Trace], stage, *extra) -> None:
        _record(stages, stage(stages[-1], *extra), seconds, stages is not traces)

    run(traces, grouped_attention)  # the head repeats it leaves unread go with dce
    run(traces, additive_attention_masks)  # one conversion per mask: cse merges the repeats
    run(traces, dce)
    run(traces, cse)
    for user_transform in transforms:
        run(traces, user_transform)
    computation = traces[-1]
    if wrt is not None:
        run(traces, value_and_grad_trace, wrt)
    needs_grad = (wrt is None and torch.is_grad_enabled() and traces[-1].output != ()
                  and any(p.requires_grad for p in traces[-1].args))
    if needs_grad:
        returned = returned_views(traces[-1])
        recompute = _recompute(traces[-1])
        replay = eager_replay(traces[-1])
        start = time.perf_counter()
        split = split_forward_backward(traces[-1])
        seconds["autodiff"] = time.perf_counter() - start
        traces.append(split.forward.replace(provenance="after autodiff (forward)",
                                            seconds=seconds["autodiff"]))
        backward_traces.append(split.backward)
        if rematerialize:
            start = time.perf_counter()
            split = rematerialize_split(split)
            if split.forward is not traces[-1]:
                traces.append(split.forward)
                backward_traces.append(split.backward)
            seconds["rematerialization"] = time.perf_counter() - start
        run(backward_traces, dce)
        run(backward_traces, cse)
        run(backward_traces, reuse_layer_norm)  # one native_layer_norm for output and statistics
        unclaimed = backward_traces[-1]
        # statements the split added twice (attention's float masks), residuals included
        run(traces, cse, frozenset(p.name for p in iter_proxies(traces[-1].output[0])))
    run(traces, claim_executors, executors)
    for stage in _AFTER_CLAIMING:
        run(traces, stage)

    start = time.perf_counter()
    # the traces hold autocast's casts explicitly: never cast again under the caller's
    fn = without_autocast(traces[-1].python_callable())
    seconds["python compilation"] = time.perf_counter() - start
    if wrt is not None:  # NOTE [eager's gradient layouts]
        fn = grads_laid_out_as_eager(fn, computation, wrt)
    finish_backward = None
    if needs_grad:
        residuals = traces[-1].output[1]
        backward = _Backward(backward_traces, executors, seconds)
        finish_backward = backward.build
        pair = CompiledPair(fn, backward, split.differentiable_outputs,
                            any(not isinstance(r, torch.Tensor) for r in residuals),
                            _variant_builder(unclaimed, sum(split.differentiable_outputs),
                                             executors, variants), recompute=recompute,
                            unreached=_unreached_builder(unclaimed,
                                                         sum(split.differentiable_outputs)),
                            size_only=_size_only_residuals(unclaimed, len(residuals)),
                            input_residuals=_input_residuals(traces[-1]), replay=replay)
        read = find_read_outputs(computation, returned, split.differentiable_outputs)
        fn = functools.partial(_call_with_autograd, pair, split.output_spec, returned, read)
    return CompiledSegment(fn, traces, backward_traces, variants, finish_backward), seconds


def _size_only_residuals(backward: Trace, count: int) -> tuple[int, ...]:
    """Positions among the first `count` arguments of `backward` (its residuals) of the
    tensors no statement reads: kept only to bind symbolic sizes (NOTE [residuals read for
    their sizes] in `autograd_bridge.py`)."""
    read = _residuals_read(backward, count)
    return tuple(i for i, p in enumerate(backward.args[:count])
                 if isinstance(p, TensorProxy) and i not in read)


def _input_residuals(forward: Trace) -> frozenset[int]:
    """Positions of the residuals of `forward` that are its inputs (parameters, arguments)."""
    inputs = {p.name for p in forward.args if isinstance(p, TensorProxy)}
    return frozenset(i for i, r in enumerate(forward.output[1])
                     if isinstance(r, TensorProxy) and r.name in inputs)


def _residuals_read(backward: Trace, count: int) -> frozenset[int]:
    """Positions among the first `count` arguments of `backward` (its residuals) that a
    statement or the output reads."""
    read = {p.name for bsym in backward.bsyms if not bsym.is_del for p in bsym.proxy_inputs}
    read |= {p.name for p in iter_proxies(backward.output)}
    return frozenset(i for i, p in enumerate(backward.args[:count])
                     if isinstance(p, TensorProxy) and p.name in read)


_NOT_RECOMPUTABLE = frozenset({Tag.RANDOM, Tag.WRITE_BACK, Tag.SIDE_EFFECT})


def _recompute(computation: Trace) -> Callable | None:
    """`inputs -> output leaves` of `computation` with torch's differentiable ops, for a
    backward with `create_graph=True` (NOTE [double backward by recomputation] in
    `fulmen.autograd_bridge`); None when running it again would not repeat the forward (random
    draws, writes into inputs, side effects)."""
    if any_tagged(computation.bsyms, _NOT_RECOMPUTABLE):
        return None
    compiled = []

    def recompute(*inputs):
        if not compiled:  # compiled at the first double backward only
            compiled.append(without_autocast(computation.python_callable()))
        return pytree.tree_leaves(compiled[0](*inputs))

    return recompute


def _record(stages: list[Trace], result: Trace, seconds: dict, backward: bool) -> None:
    """Append a pass's `result` to `stages` (and its time to `seconds`) if it changed the
    trace."""
    if result is not stages[-1]:
        label = f"{result.provenance.removeprefix('after ')}"
        _PASSES.info("%s: %.2f ms", label, result.seconds * 1e3)
        seconds[f"{label} (backward)" if backward else label] = result.seconds
        stages.append(result)


class _Backward:
    """The compiled backward: its trace claimed by the executors and compiled to Python at its
    first call, or when its stages are asked for (`CompiledSegment.finish_backward`).

    NOTE [the backward compiles when first needed]: a training step of a model that returns
    its logits beside the loss never runs the backward for every output: `loss.backward()`
    runs the one for unused outputs (`_variant_builder`), compiled at its own first call.
    Claiming and compiling both in the compile of every shape doubled the backward's share
    of it (tiny HF Llama: about a fifth of a training step's compile)."""

    def __init__(self, stages: list[Trace], executors: Sequence[Executor], seconds: dict):
        self._stages, self._executors, self._seconds = stages, executors, seconds
        self._fn: Callable | None = None
        self._lock = threading.Lock()

    def build(self) -> Callable:
        """Claim, finish and compile the backward once (its stages appended); the callable."""
        with self._lock, collector_paused(), memoized_symbolic_ops():
            if self._fn is None:
                _record(self._stages, claim_executors(self._stages[-1], self._executors),
                        self._seconds, True)
                for stage in _AFTER_CLAIMING:
                    _record(self._stages, stage(self._stages[-1]), self._seconds, True)
                start = time.perf_counter()
                self._fn = without_autocast(self._stages[-1].python_callable())
                self._seconds["python compilation (backward)"] = time.perf_counter() - start
            return self._fn

    def __call__(self, *args):
        return (self._fn or self.build())(*args)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a miss traces and compiles, and while a
    backward for unused outputs compiles at its first use (`_variant_builder`); as it was,
    after. NOTE [the collector while compiling]: tracing allocates millions of short-lived
    objects (proxies, SymInts, sympy expressions, bound symbols), and every ~70,000 of them
    that survive a young collection advance the collector toward a full one, which walks every
    object of the process (torch, transformers: 150-280 ms each on a 2-core machine; a tiny
    HF llama's first forward sweep over 36 shapes paid one, 0.25 s of its 1.2 s). Paused, the
    compile's garbage is freed by one young collection soon after (reference counting frees
    the rest as usual) and the full collections come at the pace of the program's own
    allocations. A training step of a model that returns its logits beside the loss compiles
    that backward inside `loss.backward()`: unpaused, tiny HF Llama's and Qwen2's first
    training sweeps each paid a full collection there (0.25-0.37 s of 1.3-1.6 s)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        _promote_survivors()
        gc.enable()


def _promote_survivors() -> None:
    """Collect the young generation (the compile's cyclic garbage), then move what survived
    into the oldest generation without counting it toward the next full collection.

    NOTE [a compile's survivors are long-lived]: CPython runs a full collection once the
    objects promoted into its oldest generation by young collections exceed a quarter of those
    the last full collection kept. A compile's survivors (traces, compiled callables, kernels:
    about 20,000 objects for a tiny HF Llama's training step) are the cache's own and live as
    long as it; counted, two compiles plus building the models past the imports made the first
    training sweep of tiny Llama and Qwen2 pay one full collection (230-310 ms of ~1 s).
    `gc.freeze()` then `gc.unfreeze()` moves every tracked object into the oldest generation
    (linked-list splices, no traversal) and leaves that count as it was; nothing stays frozen,
    so every full collection still walks them (a dropped entry is freed as before). Skipped
    where the program froze objects itself (`gc.get_freeze_count()`: they stay frozen)."""
    gc.collect(0)
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def _unreached_builder(backward: Trace, count: int) -> Callable | None:
    """For a backward with symbolic cotangent sizes (no folded variants, `_variant_builder`):
    `unused -> (positions, reads)`: the input gradients that come from unused cotangents alone,
    None as in eager (`unused_cotangents.unreached_gradients`), and the residuals the backward
    reads (NOTE [outputs backpropagated in turns]); None for other backwards."""
    cotangents = backward.args[len(backward.args) - count:]
    if all(isinstance(s, int) for c in cotangents for s in c.shape):
        return None
    reads = _residuals_read(backward, len(backward.args) - count)

    @functools.cache
    def unreached(unused: tuple[bool, ...]) -> tuple[frozenset[int], frozenset[int]]:
        return unreached_gradients(backward, unused), reads

    return unreached


def _variant_builder(backward: Trace, count: int, executors: Sequence[Executor],
                     variants: dict):
    """`unused -> callable`: the backward for calls whose cotangents flagged in `unused` are
    unused (`transforms.unused_cotangents`), its stages recorded in `variants`; None when a
    cotangent has a symbolic size (autograd then materializes zeros, as before). `backward`
    takes `count` cotangents."""
    cotangents = backward.args[len(backward.args) - count:]
    if any(not isinstance(s, int) for c in cotangents for s in c.shape):
        return None

    def build(unused: tuple[bool, ...], fold: bool = True) -> Callable:
        with collector_paused(), memoized_symbolic_ops():
            return _build(unused, fold)

    def _build(unused: tuple[bool, ...], fold: bool) -> Callable:
        try:
            folded = fold_unused_cotangents(backward, unused, fold=fold)
            stages = [folded, *_claimed_stages(folded, executors)]
            compiled = without_autocast(stages[-1].python_callable())
            # (NOTE [outputs backpropagated in turns] in `fulmen.autograd_bridge`)
            compiled.residuals_read = _residuals_read(folded, len(backward.args) - count)
        except Exception:
            if not fold:
                raise
            _PASSES.warning("folding unused cotangents %s failed; materializing them", unused,
                            exc_info=True)
            return _build(unused, fold=False)
        variants[unused] = stages
        return compiled

    return build


def _call_with_autograd(pair: CompiledPair, output_spec, returned, read, *inputs):
    outputs = run_with_autograd(pair, inputs)
    if read is not None:  # NOTE [outputs other outputs read]: their own nodes, views replayed
        outputs = give_outputs(read, outputs, inputs, returned)
    elif returned:  # NOTE [a view of an input returned]: eager's views, made outside
        outputs = replay(returned, inputs, outputs)
    if output_spec.is_leaf():
        return outputs[0]
    return pytree.tree_unflatten(list(outputs), output_spec)
