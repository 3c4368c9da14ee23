"""The callables `fulmen.jit` returns: `JittedFunction` (a function or bound method),
`JittedModule` (an `nn.Module` sharing the wrapped module's parameters, buffers and attributes)
and `JittedDDP` (`fulmen.jit(DistributedDataParallel(model))`). Each runs its calls through a
`fulmen.jitted._Jitted`.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable

import torch

from fulmen.compile_miss import _RECOMPILES
from fulmen.core import get_tracectx
from fulmen.executors import Executor, get_executor
from fulmen.jitted import _Jitted
from fulmen.tracer.compiled_callees import outside_dynamo
from fulmen.tracer.input_names import state_slots
from fulmen.tracer.leaf_keys import StateRemoved
from fulmen.tracer.module_hooks import (
    HookWatch,
    StructureWatch,
    TiesBroken,
    TieWatch,
    add_wrapper_prefix,
    strip_wrapper_prefix,
)
from fulmen.tracer.module_stores import UnreplayableStore
from fulmen.tracer.sources import COMPILED_FORWARD


class JittedFunction(_Jitted):
    """A function compiled by `fulmen.jit`; call it like the original."""

    def __init__(self, fn: Callable, executors=None, transforms=None, grad_argnums=None,
                 rematerialize: bool = True, fullgraph: bool = False,
                 cache_size_limit: int | None = None, dynamic: bool | None = None) -> None:
        self._setup(fn, None, executors, transforms, grad_argnums, rematerialize, fullgraph,
                    cache_size_limit, dynamic)
        self._grad_free = _is_optimizer_step(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_exporting():  # `torch.export` traces the original's torch calls
            return self._fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # `torch.compile` traces a caller: a graph break
            return outside_dynamo(self.__call__, *args, **kwargs)
        if self._grad_free and torch.is_grad_enabled():
            with torch.no_grad():  # what the step does first thing itself
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def __get__(self, instance, owner=None):
        """Jitted functions defined in a class body become bound methods."""
        return self if instance is None else functools.partial(self.__call__, instance)


def _is_optimizer_step(fn) -> bool:
    """Whether `fn` is `optimizer.step` of a torch optimizer that runs its body without grad
    (`differentiable=False`, the default): calling it under `torch.no_grad()` changes nothing,
    and the trace then updates the parameters (leaves requiring grad) in place as eager does."""
    if getattr(fn, "__name__", "") != "step":
        return False
    owner = getattr(fn, "__self__", None)
    # an LR scheduler replaces `optimizer.step` by a wrapper holding the optimizer weakly,
    # marked `_wrapped_by_lr_sched`; a user's own function named `step` that closes over an
    # optimizer (a training step: forward, backward, `opt.step()`) is not one, and runs with
    # the caller's grad mode as eager's
    lr_wrapper = owner is None and getattr(fn, "_wrapped_by_lr_sched", False)
    cells = (getattr(fn, "__closure__", None) or ()) if lr_wrapper else ()
    for cell in cells:
        value = cell.cell_contents
        value = value() if isinstance(value, weakref.ref) else value
        if isinstance(value, torch.optim.Optimizer):
            owner = value
    return isinstance(owner, torch.optim.Optimizer) and not owner.defaults.get(
        "differentiable", False)


class _BoundForward:
    """`jitted.forward` as an instance sees it: the compiled call, showing the wrapped module's
    forward signature, so code that inspects `model.forward` (HF `generate` choosing what to
    pass, e.g. GPT-2's `position_ids` from a padded mask; Trainer's column filter) sees the
    same parameters as on the module."""

    __slots__ = ("__self__",)

    def __init__(self, jitted: JittedModule) -> None:
        self.__self__ = jitted

    def __call__(self, *args, **kwargs):
        return self.__self__._compiled_forward(*args, **kwargs)

    @property
    def __signature__(self):
        return inspect.signature(self.__self__._orig_mod.forward)

    @property
    def __code__(self):
        # non-strict `torch.export` reads it first, then would name the parameters wrongly
        raise AttributeError(
            "the forward of a fulmen-jitted module is the compiled call, not a Python function "
            "(no __code__): to torch.export it, export the original module, "
            "`torch.export.export(jitted._orig_mod, args)` (the same parameters), or pass "
            "strict=True")


class _ForwardDescriptor:
    """Class attribute `JittedModule.forward`: instances get a `_BoundForward`."""

    def __get__(self, instance, owner=None):
        return owner._compiled_forward if instance is None else _BoundForward(instance)


class JittedModule(torch.nn.Module):
    """An `nn.Module` compiled by `fulmen.jit`.

    It holds the original module as `_orig_mod` and shares its parameters and buffers (and
    attributes set on it, `jmodel.temperature = 0.5`, land on the module), so
    `jmodel.parameters()`, optimizers and `state_dict()` see the very same tensors. It behaves
    like the module: `state_dict()`, `named_parameters()` and `named_buffers()` have the module's
    own names (`load_state_dict` takes those or `_orig_mod.`-prefixed ones); `copy.deepcopy`, pickle and `torch.save` copy the module and
    its options, and the copy compiles anew at its first call; `train()`/`eval()` and hooks
    added to or removed from its submodules after jitting retrace.
    """

    def __init__(self, module: torch.nn.Module, executors=None, transforms=None,
                 rematerialize: bool = True, fullgraph: bool = False,
                 cache_size_limit: int | None = None, dynamic: bool | None = None) -> None:
        super().__init__()
        self._orig_mod = module
        self._jit_options = dict(executors=executors, transforms=transforms,
                                 rematerialize=rematerialize, fullgraph=fullgraph,
                                 cache_size_limit=cache_size_limit, dynamic=dynamic)
        self._start_jit()
        self.register_state_dict_post_hook(strip_wrapper_prefix)
        self.register_load_state_dict_pre_hook(add_wrapper_prefix)

    def _start_jit(self) -> None:
        before = getattr(self, "_jit", None)
        self._jit = _Jitted()
        self._jit._setup(self._orig_mod, self._orig_mod, **self._jit_options)
        if before is not None:  # calls that ran eagerly stay counted (`fulmen.compile_stats`)
            self._jit._stats.eager_calls = before._stats.eager_calls
        self._hooks = HookWatch(self._orig_mod)
        self._structure = StructureWatch(self._orig_mod)
        self._ties = TieWatch(self._orig_mod)
        self._jit.after_buffer_stores = self._accept_buffer_stores

    def _accept_buffer_stores(self) -> None:
        """A compiled call replaced buffers (`self.mem = torch.cat(...)` in the forward): not a
        change of the module's structure, unless a replaced buffer was tied to another one
        (then the next call compiles anew)."""
        layout = [(id(slot.owner), slot.key) for slot in state_slots(self._orig_mod)]
        if layout == [(id(slot.owner), slot.key) for slot in self._jit._state_slots]:
            self._structure = StructureWatch(self._orig_mod)

    forward = _ForwardDescriptor()

    def __call__(self, *args, **kwargs):
        """`nn.Module.__call__`, which without hooks, `torch.jit` tracing, `Module.compile` or
        a replaced `forward` only calls the forward: then the compiled forward, directly.

        Global module hooks (`register_module_forward_hook`, `..._full_backward_hook`) do not
        count: the wrapper is not a module of the user's model, and they fire for the wrapped
        module and its submodules as in eager. Run for the wrapper too, a hook that changes
        outputs or input gradients applied once more (a global full backward hook doubling
        `grad_input` gave twice eager's input gradient; `torch.compile(module)` warns of the
        same extra call for its `OptimizedModule`)."""
        if (self._compiled_call_impl is None and not (
                self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks
                or self._backward_hooks)
                and "forward" not in self.__dict__ and not _jit_tracing()):
            return self._compiled_forward(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _compiled_forward(self, *args, **kwargs):
        """The module's forward, compiled (what `jmodel(...)` and `jmodel.forward(...)` run)."""
        if torch.compiler.is_exporting():  # `torch.export` traces the module's torch calls
            return self._orig_mod(*args, **kwargs)
        if torch.compiler.is_compiling():  # `torch.compile` traces a caller: a graph break
            return outside_dynamo(self._compiled_forward, *args, **kwargs)
        if self._structure.changed():  # a submodule or parameter replaced: everything anew
            _RECOMPILES.info("%s: the module's submodules, parameters or buffers changed; "
                             "compiling anew", type(self._orig_mod).__name__)
            self._start_jit()
        hooks = self._hooks
        if hooks.changed():  # hooks run inside the trace: a new or removed one retraces
            self._jit.forget_compiled()
        if hooks.backward_hooked and torch.is_grad_enabled():
            return self._jit._eagerly_or_raise(args, kwargs, UnreplayableStore(
                f"backward hooks (register_full_backward_hook) on {hooks.backward_hooked[0]!r} "
                "inside a jitted module: a compiled call would never fire them",
                op="register_full_backward_hook",
                hint="register the hook on the jitted module itself (it runs as a module around "
                "the compiled call), or use tensor hooks on parameters (p.register_hook, "
                "register_post_accumulate_grad_hook)"))
        untied = self._ties.broken()
        if untied is not None:
            return self._jit._eagerly_or_raise(args, kwargs, TiesBroken(
                f"the tensors tied when the module was jitted are not one now ({untied!r} holds "
                "another; torch.func.functional_call with tie_weights=False): the compiled "
                "program reads them as one", op="functional_call",
                hint="pass the tied tensors together, or keep tie_weights=True"))
        try:
            return self._jit._call(args, kwargs)
        except StateRemoved:  # `m.bias = None`: a change of structure
            _RECOMPILES.info("%s: a parameter or buffer was set to None; compiling anew",
                             type(self._orig_mod).__name__)
            self._start_jit()
            return self._jit._call(args, kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """The module's parameters under the module's own names (`0.weight`, not
        `_orig_mod.0.weight`), as `state_dict()` keys them; with `recurse=False` the wrapper's
        own (none), so walking `modules()` counts each parameter once."""
        if not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return self._orig_mod.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        """The module's buffers under the module's own names (see `named_parameters`)."""
        if not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return self._orig_mod.named_buffers(prefix, recurse, remove_duplicate)

    def __getstate__(self):
        """The module and the options, without the compiled cache (its traces hold proxies and
        compiled code); registered executors are kept by name."""
        state = self.__dict__.copy()
        del state["_jit"], state["_hooks"], state["_structure"], state["_ties"]
        executors = self._jit_options["executors"]
        if executors is not None:
            executors = [_registered_name(executor) for executor in executors]
        state["_jit_options"] = {**self._jit_options, "executors": executors}
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._start_jit()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules["_orig_mod"]
            value = getattr(module, name)
            if getattr(value, "__self__", None) is module and name != "forward":
                # a method of the module that calls `self(...)` (HF `generate`) runs the
                # compiled forward, as it would on the module itself
                return functools.partial(self._with_jitted_forward, value)
            return value

    def __setattr__(self, name: str, value) -> None:
        """`jmodel.temperature = 0.5` sets the module's attribute (the compiled forward reads
        the module's); the wrapper's own state and private names stay on the wrapper."""
        if self._wrapper_attribute(name):
            super().__setattr__(name, value)
            return
        module = self._modules["_orig_mod"]
        if name in module._parameters and isinstance(value, torch.Tensor) \
                and not isinstance(value, torch.nn.Parameter):
            # `torch.func.functional_call(jmodel, params)` swaps plain tensors in for the
            # module's parameters, as it does on the module itself
            module._parameters[name] = value
        else:
            setattr(module, name, value)

    def __delattr__(self, name: str) -> None:
        if self._wrapper_attribute(name):
            super().__delattr__(name)
        else:
            delattr(self._modules["_orig_mod"], name)

    def _wrapper_attribute(self, name: str) -> bool:
        return (name.startswith("_") or name in self.__dict__ or hasattr(type(self), name)
                or "_orig_mod" not in self.__dict__.get("_modules", {}))

    def _with_jitted_forward(self, method, *args, **kwargs):
        """Run `method` of the wrapped module with its `forward` compiled: calls made while
        tracing (the trace of that forward itself) reach the module's own forward."""
        module = self._orig_mod
        own = module.__dict__.get("forward")
        original = module.forward

        def forward(*call_args, **call_kwargs):
            if get_tracectx() is not None or self._jit._running_eagerly:
                return original(*call_args, **call_kwargs)
            return self.forward(*call_args, **call_kwargs)

        # `generate` reads the forward's signature to choose what to pass (GPT-2 gets
        # `position_ids` from a padded mask only if its forward takes them)
        functools.update_wrapper(forward, original)
        setattr(forward, COMPILED_FORWARD, True)  # not a replaced forward to key
        module.forward = forward
        try:
            return method(*args, **kwargs)
        finally:
            if own is None:
                del module.forward
            else:
                module.forward = own


class JittedDDP(JittedModule):
    """`DistributedDataParallel(model)` compiled by `fulmen.jit`: the model inside is compiled
    (a `JittedModule` sharing its parameters) and DDP's own forward runs eagerly around it at
    every call, so buffers are broadcast, the reducer is prepared for the backward and
    `no_sync()` holds exactly as in eager; the gradient hooks fire as the compiled backward
    accumulates into the parameters. The same as `DDP(fulmen.jit(model))`; torch.compile too
    keeps DDP's hooks outside its graphs. Attributes (`module`, `no_sync`) are DDP's and
    `state_dict()` has DDP's keys (`module.`-prefixed)."""

    def _start_jit(self) -> None:
        ddp = self._orig_mod
        # not registered as a submodule: the parameters are listed once, under DDP
        object.__setattr__(self, "_compiled", JittedModule(ddp.module, **self._jit_options))

    @property
    def _jit(self) -> _Jitted:
        return self._compiled._jit

    def _compiled_forward(self, *args, **kwargs):
        ddp = self._orig_mod
        modules = ddp._modules
        model = modules["module"]
        if model is not self._compiled._orig_mod:  # `ddp.module` was replaced
            self._start_jit()
        modules["module"] = self._compiled  # what DDP's forward calls (`self.module(...)`)
        try:
            return ddp(*args, **kwargs)
        finally:
            modules["module"] = model

    def __getstate__(self):
        raise TypeError("a jitted DistributedDataParallel cannot be pickled or deep-copied "
                        "(DDP holds a process group); copy the model and wrap the copy")


_jit_tracing = torch._C._get_tracing_state


def _fsdp_sharded(module: torch.nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) was applied to `module` or one of its submodules (its
    jitted blocks excepted: sharding a compiled block is the supported spelling)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return False
    stack = [module]
    while stack:
        current = stack.pop()
        if isinstance(current, FSDPModule) and not isinstance(current, JittedModule):
            return True
        if not isinstance(current, JittedModule):
            stack.extend(current.children())
    return False


def _registered_name(executor):
    """An executor's name when it is the one registered under it (picklable), else itself."""
    if isinstance(executor, Executor):
        try:
            if get_executor(executor.name) is executor:
                return executor.name
        except KeyError:
            pass
    return executor
