"""`trace_program`: run a function or module once on proxies and record its Trace.

Inputs: tensor leaves of the call's arguments become input proxies named after the parameters
they were passed as (`x`, `batch_0`, `kwargs_mask`); module parameters and buffers become inputs
named after their qualified names (`layers_0_weight`); real tensors the code closes over become
`captured*` inputs. In-place updates of any of them end the trace with explicit write-backs
(`torch.Tensor.copy_(x, t7)`; see `fulmen.tracer.mutation`). Non-tensor leaves (Python numbers, strings, None) are constants baked into
the trace; the cache key guards their values.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import NotYetSupportedError, Trace, tracing
from fulmen.core.errors import RunsEagerly
from fulmen.ops.functionalized import WRITE_BACK
from fulmen.proxies import TensorProxy
from fulmen.tracer.argument_containers import ArgumentContainers
from fulmen.tracer.backward_in_trace import finish_backward, grad_stores
from fulmen.tracer.bool_args import symbolic_bools_decided
from fulmen.tracer.breaks import BreakInfo, BreakRecorder
from fulmen.tracer.call_constants import copy_of, made_during_the_call
from fulmen.tracer.call_outputs import (
    clear_grads_after_each_call,
    epilogue_values,
    flatten_output,
    is_printable_spec,
    traced_stores,
)
from fulmen.tracer.compiled_callees import compiled_code_runs_eagerly
from fulmen.tracer.dispatch import TracerCtx
from fulmen.tracer.environment import environment_recorded
from fulmen.tracer.factory_mode import FactoryMode, UnreadGrad
from fulmen.tracer.fast_paths import eager_fast_paths
from fulmen.tracer.fresh_leaves import refuse_escaping_fresh
from fulmen.tracer.host_floats import (
    floats_read_at_run_time,
    items_requested,
    read_float,
    refuse_nan_constants,
)
from fulmen.tracer.inference_results import refuse_inference_results
from fulmen.tracer.input_names import _path_name, _positional_names, state_slots
from fulmen.tracer.int_answers import symbolic_ints_are_ints
from fulmen.tracer.library_caches import library_caches_set_aside
from fulmen.tracer.library_flags import answered_for_proxies
from fulmen.tracer.module_stores import (
    ModuleStore,
    captured_grad_clears,
    held_modules,
    module_stores,
    refuse_held,
)
from fulmen.tracer.object_inputs import ObjectInputs
from fulmen.tracer.objects import (
    function_roots,
    has_argument_grad,
    is_plain_object,
)
from fulmen.tracer.size_trees import keep_sizes
from fulmen.tracer.sym_ops import memoized_symbolic_ops
from fulmen.tracer.symbolic import FLOAT, INT, SymbolicSizes, carrier, number_function
from fulmen.tracer.vmap import vmap_emulated


@dataclass
class TracedProgram:
    """A trace plus what the runtime needs to call it.

    Attributes:
        trace: the computation trace; its inputs are, in order, the call's tensor leaves, the
            module's parameters/buffers (`state_names`), and captured tensors.
        tensor_positions: indices of the tensor leaves among the flattened `(args, kwargs)`.
        state_names: qualified names of the module parameters/buffers passed as inputs.
        captured: real tensors closed over by the traced code, passed after the state.
        output_spec: treespec to rebuild the output from the trace's flat tuple, or None when the
            trace returns the user's structure directly.
        seconds: time spent tracing.
        mutated_inputs: indices (among the trace inputs) of the tensors the trace writes back
            to; the runtime checks that they share memory with no other input
            (`check_no_input_aliasing`).
        breaks: the graph breaks taken, in order (each is a guard statement in the trace).
        requires_grad_names: the proxies that depend on an input requiring grad.
        objects: the object arguments (`fulmen.tracer.objects`): the tensors inside them are
            trace inputs after the call's tensor leaves; when its epilogue has stores or
            rebuilt outputs, the trace returns `(output_leaves, epilogue_values)`.
        offset_reads: positions (as `tensor_positions`) of the arguments whose
            `storage_offset()` the program read; -1 when it read a parameter's or buffer's.
        symbolic: the symbolic sizes of the inputs traced with dynamic dimensions.
        module_stores: the stores of Python constants the forward made on its modules, to
            replay after each call (`fulmen.tracer.module_stores`).
        module_writes: `(id(module), attribute)` of each traced tensor the forward stored on a
            module (an epilogue store of `objects`).
        captured_fresh: indices of the captured tensors the call made itself, from data no
            torch function sees (NOTE [tensors made during the call], `call_constants.py`):
            the runtime passes a copy of each on every call.
        captured_attributes: `(index, module, attribute)` of each captured tensor that is a
            plain tensor attribute of a module (`self.h`): the runtime reads it afresh from
            the module on every call (`fulmen.jit`), keyed by its metadata.
        int_positions: positions (as `fulmen.tracer.symbolic.tensor_at`) of the integers
            traced as symbols; their carriers (`symbolic.carrier`) are trace inputs after the
            object tensors.
        held_modules: the modules the function reached besides the jitted one (arguments,
            globals: `fulmen.tracer.module_stores.held_modules`), whose `training` flags and
            attributes the cache key must cover from now on.
        environment_reads: the environment variables the traced code looked up (`WHOLE`: it
            read them all), whose values the cache key must cover from now on (NOTE
            [environment reads]).
        flag_reads: `(tensor, flag)` for each autograd flag of a real tensor the code read,
            which the cache key must cover from now on; `captured_grads`: `(index, tensor)` of
            each captured tensor that is such a tensor's `.grad`, read afresh on every call
            (NOTE [flags of closed-over tensors]).
    """

    trace: Trace
    tensor_positions: tuple[int, ...]
    state_names: tuple[str, ...] = ()
    captured: tuple[torch.Tensor, ...] = ()
    output_spec: Any = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    mutated_inputs: tuple[int, ...] = ()
    breaks: tuple[BreakInfo, ...] = ()
    requires_grad_names: frozenset[str] = frozenset()
    objects: ObjectInputs | None = None
    offset_reads: frozenset[int] = frozenset()
    symbolic: SymbolicSizes | None = None
    module_stores: tuple[ModuleStore, ...] = ()
    module_writes: frozenset[tuple[int, str]] = frozenset()
    captured_attributes: tuple[tuple[int, torch.nn.Module, str], ...] = ()
    captured_fresh: tuple[int, ...] = ()
    int_positions: tuple = ()
    held_modules: tuple[torch.nn.Module, ...] = ()
    environment_reads: frozenset[str] = frozenset()
    flag_reads: tuple = ()
    captured_grads: tuple[tuple[int, torch.Tensor], ...] = ()


def _captured_fresh(ctx, captured: list, proxies: list, trace: Trace,
                    mutated: tuple[int, ...]) -> tuple[int, ...]:
    """The indices of the captured tensors the call made itself (NOTE [tensors made during the
    call]) among those the trace mutates or returns."""
    first = len(trace.args) - len(captured)
    returned = {leaf.name for leaf in pytree.tree_leaves(trace.output)
                if isinstance(leaf, TensorProxy)}
    candidates = [index - first for index in mutated if index >= first]
    candidates += [index for index, proxy in enumerate(proxies) if proxy.name in returned]
    if not candidates:
        return ()
    internal = [*ctx.captured.values()]
    if ctx.breaks is not None:
        internal.append(ctx.breaks.env)
    return made_during_the_call(captured, candidates, internal, ctx.foreign_sources)


def _offset_reads(read: set[str], inputs, positions, state: dict,
                  held_at: dict[str, tuple]) -> frozenset:
    """The flattened-argument positions of the inputs whose `storage_offset()` was read (an
    object-held tensor's as `(root, path)`, see `held_at`), with `-1` standing for any
    parameter or buffer of the module. Static keys key object-held tensors by their offsets
    always; symbolic entries guard them only where read (NOTE [offsets of held tensors])."""
    at = dict(zip([proxy.name for proxy in inputs], positions))
    at.update(held_at)
    state_names = {proxy.name for proxy in state.values()}
    return frozenset([at[name] for name in read if name in at]
                     + [-1 for name in read if name in state_names])


def _attribute_owners(module: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, str]]:
    """id of each plain tensor attribute of `module`'s modules (not a parameter or buffer:
    `self.h = torch.zeros(4)`) -> `(owner, attribute)`."""
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    for sub in module.modules():
        for key, value in vars(sub).items():
            if type(value) is torch.Tensor:
                owners.setdefault(id(value), (sub, key))
    return owners


class TorchFunctionSubclass(RunsEagerly):
    """An argument is (or an argument object holds) a tensor subclass with a
    `__torch_function__` of its own: it would run on the trace's ops at run time, not on the
    user's, and see no call while tracing, so the call runs eagerly (its type is in the key)."""


# the `__torch_function__`s of torch.Tensor and of subclasses that keep torch's behaviour
# (`nn.Parameter`, `nn.Buffer`: disabled, their results are plain tensors)
_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__,
                    torch._C._disabled_torch_function_impl)


def _own_torch_function(tensor: torch.Tensor) -> bool:
    if isinstance(tensor, TensorProxy):  # a trace of traced values (fulmen's own)
        return False
    function = type(tensor).__torch_function__
    return getattr(function, "__func__", function) not in _TORCH_FUNCTIONS


def _refuse_own_torch_function(tensor: torch.Tensor, where: str) -> None:
    """Raise `TorchFunctionSubclass` for a tensor argument (`where`: "an argument is") or a
    tensor an argument object holds ("an argument holds") whose type has a
    `__torch_function__` of its own (see `TorchFunctionSubclass`)."""
    if type(tensor) is not torch.Tensor and _own_torch_function(tensor):
        raise TorchFunctionSubclass(
            f"{where} a {type(tensor).__name__}, a tensor subclass with a "
            "__torch_function__ of its own", op="__torch_function__",
            hint="pass a plain tensor (t.as_subclass(torch.Tensor))")


def _mark_parameter(proxy: TensorProxy, tensor: torch.Tensor) -> None:
    """Make `isinstance(proxy, nn.Parameter)` True, as in eager, when the user's `tensor` is
    a Parameter (an argument, or held by an argument object; keyed apart by its type:
    `leaf_keys._leaf_key`)."""
    if isinstance(tensor, torch.nn.Parameter):
        proxy._is_param = True


def trace_program(fn: Callable, args: tuple, kwargs: dict, *, module: torch.nn.Module | None = None,
                  name: str = "computation", ctx: TracerCtx | None = None,
                  allow_breaks: bool = False, dynamic: dict | None = None,
                  replay_stores: bool = False, share_repeated: bool = False) -> TracedProgram:
    """Trace `fn(*args, **kwargs)` (or `module(*args, **kwargs)`) on proxies.

    `ctx` is a fresh recording context to use (by default one is made); after a failure its
    statements are the part of the program traced so far (`fulmen.examine` reports them).
    With `allow_breaks`, value-dependent Python is answered from the real `args` and recorded
    as graph breaks (`fulmen.tracer.breaks`) instead of raising.
    `dynamic` maps flattened-argument positions (or `(position, path)` of a tensor inside an
    object argument) to the dimensions that get symbolic sizes (`fulmen.tracer.symbolic`); the
    program's `symbolic` then guards them.
    With `replay_stores`, stores into the lists and dicts among the arguments become epilogue
    stores (NOTE [argument container stores] in `fulmen.tracer.argument_containers`) for a
    caller that runs the epilogue (`fulmen.jit`); without, they are refused.
    With `share_repeated`, a tensor object passed at several argument positions
    (`attention(x, x, x)`) is one proxy and one trace input, so the traced code's `query is key`
    answers as eager's (NOTE [repeated tensor arguments]).

    Raises:
        FulmenError: when the program does something that cannot be traced (value-dependent
            control flow, an op PyTorch cannot describe); the message names the user's line.
    """
    start = time.perf_counter()
    ctx = TracerCtx(name) if ctx is None else ctx
    ctx.offset_reads = set()  # inputs whose storage_offset() the program read (to be guarded)
    ctx.flag_reads, ctx.grad_owners = {}, {}  # NOTE [flags of closed-over tensors]
    target = module.forward if module is not None else fn
    param_names = _positional_names(target)
    leaves_with_paths, in_spec = pytree.tree_flatten_with_path((args, kwargs))
    in_spec = keep_sizes(in_spec)  # a `torch.Size` argument stays one

    inputs: list[TensorProxy] = []
    positions: list[int] = []
    proxied_leaves = []
    symbolic = SymbolicSizes() if dynamic else None
    if symbolic is not None and module is None:
        symbolic.fn = fn  # (its objects' numbers, at negative roots, in the shape guard)
    numbers: list[tuple[Any, torch.SymInt, TensorProxy, int]] = []  # integers given symbols

    def make_int(position, label: str, value: int) -> torch.SymInt | None:
        if symbolic is not None and dynamic.get(position) == FLOAT and type(value) is float:
            made = read_float(ctx, ctx.names.named(f"{label}_carrier"), value)
            numbers.append((position, made[0], made[1], value))
            return made[0]
        made = symbolic.symbolize_int(value, ctx.names.named(f"{label}_carrier")) \
            if symbolic is not None and dynamic.get(position) == INT else None
        if made is None:
            return None
        number, proxy = made
        symbolic.add_input(number, position)
        numbers.append((position, number, proxy, value))
        return number

    proxy_of: dict[int, TensorProxy] = {}  # id of a tensor argument -> its proxy
    for index, (path, leaf) in enumerate(leaves_with_paths):
        if isinstance(leaf, torch.Tensor) and share_repeated and id(leaf) in proxy_of:
            proxied_leaves.append(proxy_of[id(leaf)])  # the same tensor again: the same proxy
        elif isinstance(leaf, torch.Tensor):
            name = ctx.names.named(_path_name(path, param_names))
            shape, strides = leaf.shape, leaf.stride()
            if symbolic is not None and index in dynamic:
                shape, strides = symbolic.symbolize(leaf, name, dynamic[index])
            proxy = TensorProxy(name, shape, leaf.dtype, leaf.device,
                                requires_grad=leaf.requires_grad, strides=strides,
                                storage_offset=leaf.storage_offset())
            if symbolic is not None:
                symbolic.add_input(proxy, index)
            if has_argument_grad(leaf):
                proxy.unseen_grad = True  # reading it raises (dispatch): not an input
            _refuse_own_torch_function(leaf, "an argument is")
            _mark_parameter(proxy, leaf)
            inputs.append(proxy)
            ctx.add_input(proxy)
            positions.append(index)
            proxied_leaves.append(proxy)
            proxy_of[id(leaf)] = proxy
        elif type(leaf) in (int, float) and symbolic is not None \
                and dynamic.get(index) in (INT, FLOAT):
            number = make_int(index, _path_name(path, param_names), leaf)
            proxied_leaves.append(leaf if number is None else number)
        else:
            proxied_leaves.append(leaf)
    proxy_args, proxy_kwargs = pytree.tree_unflatten(proxied_leaves, in_spec)

    roots = {index: leaf for index, (_, leaf) in enumerate(leaves_with_paths)
             if is_plain_object(leaf)}
    for index, obj in enumerate(function_roots(fn) if module is None else ()):
        roots[-1 - index] = obj  # a bound method's self, objects in the closure
    # before any proxy is swapped into the objects: a refusal here leaves them as they are
    held = held_modules(fn if module is None else None, (args, kwargs), list(roots.values()),
                        module)
    refuse_held(held)
    objects = ObjectInputs(roots)
    object_pairs = []
    held_at: dict[str, tuple] = {}  # an object-held input's name -> its `(root, path)`
    if roots:
        def make_proxy(root, path, tensor):
            label = _path_name(leaves_with_paths[root][0], param_names) if root >= 0 else \
                ("self" if root == -1 else f"object{-1 - root}")
            steps = "_".join(str(key) if isinstance(key, (str, int)) else "tensor"
                             for _, key in path)
            name = ctx.names.named(f"{label}_{steps}")
            shape, strides = tensor.shape, tensor.stride()
            if symbolic is not None and (root, path) in dynamic:
                shape, strides = symbolic.symbolize(tensor, name, dynamic[(root, path)])
            proxy = TensorProxy(name, shape, tensor.dtype, tensor.device,
                                requires_grad=tensor.requires_grad, strides=strides,
                                storage_offset=tensor.storage_offset())
            _refuse_own_torch_function(tensor, "an argument holds")
            _mark_parameter(proxy, tensor)
            if symbolic is not None:
                symbolic.add_input(proxy, (root, path))
            ctx.add_input(proxy)
            held_at[name] = (root, path)
            return proxy

        def make_object_int(root, path, value):
            label = _path_name(leaves_with_paths[root][0], param_names) if root >= 0 else \
                ("self" if root == -1 else f"object{-1 - root}")
            steps = "_".join(str(key) if isinstance(key, (str, int)) else "item"
                             for _, key in path)
            return make_int((root, path), f"{label}_{steps}", value)

        def stand_in(root, tensor, proxy):
            if not share_repeated or root < 0:  # (the function's own objects: keyed apart)
                return proxy
            return proxy_of.setdefault(id(tensor), proxy)

        object_pairs = objects.swap_in(make_proxy, make_object_int, stand_in)
        inputs.extend(proxy for proxy, _ in object_pairs)
        ctx.object_proxies = {id(tensor): proxy for proxy, tensor in object_pairs}
        ctx.object_tensors = {id(tensor): tensor for _, tensor in object_pairs}
    for _, _, proxy, _ in numbers:  # the carriers of the integers (`symbolic.carrier`)
        ctx.add_input(proxy)
        inputs.append(proxy)

    state_names: list[str] = []
    state: dict[int, TensorProxy] = {}
    for slot in state_slots(module) if module is not None else ():
        tensor = slot.get()
        state[id(tensor)] = TensorProxy(ctx.names.named(slot.qualname), tensor.shape,
                                        tensor.dtype, tensor.device,
                                        requires_grad=tensor.requires_grad, strides=tensor.stride(),
                                        storage_offset=tensor.storage_offset())
        ctx.add_input(state[id(tensor)])
        state_names.append(slot.qualname)

    if allow_breaks:
        real = {proxy.name: leaves_with_paths[index][1] for proxy, index in zip(inputs, positions)}
        real.update({proxy.name: tensor for proxy, tensor in object_pairs})
        real.update({proxy.name: carrier(value) for _, _, proxy, value in numbers})
        for slot in state_slots(module) if module is not None else ():
            real[state[id(slot.get())].name] = slot.get()
        ctx.breaks = BreakRecorder(ctx, real)

    # the traced code sees copies of the argument lists and dicts (rebuilt around the proxies):
    # a store into one is replayed or refused (NOTE [argument container stores])
    containers = ArgumentContainers((proxy_args, proxy_kwargs), (args, kwargs))
    stores: list[ModuleStore] = []
    writes: set[tuple[int, str]] = set()
    try:
        with tracing(ctx), FactoryMode(ctx), answered_for_proxies(), compiled_code_runs_eagerly(), \
                library_caches_set_aside(), \
                environment_recorded() as environment, \
                vmap_emulated(), \
                symbolic_ints_are_ints() if symbolic is not None else contextlib.nullcontext(), \
                floats_read_at_run_time(ctx) if items_requested() \
                or FLOAT in (dynamic or {}).values() \
                else contextlib.nullcontext(), \
                memoized_symbolic_ops() if symbolic is not None else contextlib.nullcontext(), \
                symbolic_bools_decided() if symbolic is not None else contextlib.nullcontext(), \
                contextlib.ExitStack() as held_stores:
            # stores on the other modules it reaches: put back, constants replayed
            held_found = [held_stores.enter_context(module_stores(other, ctx.capture, ctx.captured))
                          for other in held]
            if module is not None:
                # the module keeps its real tensors (another thread may use it meanwhile);
                # every torch call made while tracing sees its state proxies instead
                ctx.state_proxies = state
                with module_stores(module, ctx.capture) as stores, eager_fast_paths():
                    out = module(*proxy_args, **proxy_kwargs)
            else:
                with eager_fast_paths():
                    out = fn(*proxy_args, **proxy_kwargs)
            writes = {(id(store.module), store.key) for store in stores if store.traced}
            stores = traced_stores(stores, objects)
            held_stores.close()  # their stores are known (or refused) from here on
            stores += [store for found in held_found for store in found]
            out_leaves, out_spec = flatten_output(out)
            out_leaves = [ctx.capture(leaf) if isinstance(leaf, torch.Tensor)
                          and not isinstance(leaf, TensorProxy) else leaf for leaf in out_leaves]
            if replay_stores:
                input_paths = [(proxy, leaves_with_paths[index][0])
                               for proxy, index in zip(inputs, positions)]
                containers.record(objects.epilogue, out, input_paths)
            cleared, grad_clears = captured_grad_clears(
                ctx.mutation.grad_clears, ctx.captured,
                ctx.breaks is not None and bool(ctx.breaks.breaks))
            clear_grads_after_each_call(cleared, objects, object_pairs)
            if ctx.step_grads:  # gradients a `loss.backward()` in the trace made
                grad_stores(ctx, {proxy.name: objects.tensor_paths[index] for index, (proxy, _)
                                  in enumerate(object_pairs)}, objects.epilogue.stores)
            stores += grad_clears  # (`model.zero_grad()` of a closed-over model)
            extras = epilogue_values(objects, out_leaves)
            resolved = ctx.mutation.finish([*out_leaves, *extras])
            refuse_escaping_fresh(ctx, resolved, len(out_leaves))
            refuse_inference_results(ctx, resolved)  # NOTE [inference tensors made inside]
            out_leaves, extras = resolved[:len(out_leaves)], resolved[len(out_leaves):]
    finally:
        objects.finish_restore()
        changed = containers.restore()
    if environment.writes:  # (undone: NOTE [environment reads])
        name, (_, where) = next(iter(environment.writes.items()))
        raise RunsEagerly(
            f"the function sets the environment variable {name!r}; a compiled call would not "
            "repeat that", op="os.environ", where=where,
            hint="set it outside the jitted function")
    if changed and not replay_stores:
        raise NotYetSupportedError(
            f"the function changes the list or dict passed as {changed[0]} (append, item store, "
            "pop); this caller would not repeat that (fulmen.jit does)", op="list/dict argument",
            hint="return the new value instead, or keep it in an object attribute "
            "(cache.layers = ...), whose stores fulmen replays")

    if objects.epilogue:
        output, output_spec = (tuple(out_leaves), tuple(extras)), out_spec
    elif is_printable_spec(out_spec):
        output, output_spec = pytree.tree_unflatten(out_leaves, out_spec), None
    else:
        output, output_spec = tuple(out_leaves), out_spec

    captured = [tensor for tensor, _ in ctx.captured.values()]
    captured_proxies = [proxy for _, proxy in ctx.captured.values()]
    owners = _attribute_owners(module) if module is not None and captured else {}
    captured_attributes = tuple((index, *owners[id(tensor)]) for index, tensor
                                in enumerate(captured) if id(tensor) in owners)
    seconds = time.perf_counter() - start
    refuse_nan_constants(ctx)  # NOTE [floats read at run time]
    trace = ctx.to_trace((*inputs, *state.values(), *captured_proxies), output,
                         provenance="constructed by tracing", seconds=seconds)
    if objects.epilogue.numbers:  # evaluated from each call's inputs
        objects.epilogue.number_fn = number_function(
            objects.epilogue.numbers, list(trace.args[:len(trace.args) - len(captured)]))
    arg_index = {proxy.name: index for index, proxy in enumerate(trace.args)}
    mutated = tuple(arg_index[b.args[0].name] for b in trace.bsyms if b.sym is WRITE_BACK)
    out = None  # the call's own output refers to a tensor it made and returns
    grads = tuple((index, ctx.grad_owners[id(tensor)]) for index, tensor in enumerate(captured)
                  if id(tensor) in ctx.grad_owners)
    step = finish_backward(ctx, trace)  # (a trace holding `loss.backward()`, or {})
    if grads and ctx.breaks is not None and ctx.breaks.breaks:  # (a tree's captures are fixed)
        raise UnreadGrad("computing with the .grad of a tensor the function closes over, in a "
                         "function with graph breaks", op="Tensor.grad")
    captured_fresh = tuple(index for index in _captured_fresh(ctx, captured, captured_proxies,
                                                              trace, mutated)
                           if id(captured[index]) not in ctx.grad_owners)  # (only `p` holds it)
    for index in captured_fresh:  # NOTE [tensors made during the call]: its value when made
        captured[index] = copy_of(captured[index])
    return TracedProgram(trace, tuple(positions), tuple(state_names), tuple(captured),
                         output_spec, seconds, mutated_inputs=mutated,
                         breaks=tuple(ctx.breaks.breaks) if ctx.breaks is not None else (),
                         requires_grad_names=frozenset(ctx.requires_grad_names),
                         objects=objects if objects.roots or objects.epilogue else None,
                         offset_reads=_offset_reads(ctx.offset_reads, inputs, positions, state,
                                                         held_at),
                         symbolic=symbolic, module_stores=tuple(stores),
                         module_writes=frozenset(writes),
                         captured_attributes=captured_attributes,
                         captured_fresh=captured_fresh,
                         int_positions=tuple(position for position, *_ in numbers),
                         held_modules=tuple(held),
                         environment_reads=frozenset(environment.reads),
                         flag_reads=tuple(ctx.flag_reads.values()), captured_grads=grads,
                         extra=step)
