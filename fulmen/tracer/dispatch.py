"""Routing of torch calls made while tracing.

Every torch call whose arguments include a proxy arrives here, through
`TensorProxy.__torch_function__` or through `FactoryMode` (`fulmen.tracer.factory_mode`: a
`TorchFunctionMode` that also sees calls with no tensor argument, such as `torch.zeros`). The
route, in order:

1. a value-dependent call (`.item()`, `bool(t)`, `.tolist()`, `t in x`, ...) is answered from
   the real inputs and recorded as a graph break (`fulmen.tracer.breaks`); with breaks off
   (`fullgraph=True`) it raises a `FulmenError` naming the construct and the user's line;
2. an in-place or `out=` call is functionalized (`fulmen.tracer.mutation`): recorded as its
   out-of-place form, with the mutated tensor's later reads and a final write-back following it;
3. tensor arguments are replaced by their current values (after earlier in-place updates), and
   inside `torch.autocast` regions cast as autocast would (`fulmen.tracer.autocast`);
4. a torch callable with a fulmen decomposition records that torch-level symbol (a
   decomposition that raises `NotYetSupportedError` for some arguments falls through to 5);
5. anything else records the opaque symbol for the callable (PyTorch's meta kernel gives the
   output; when it cannot, as for `nonzero`, the op runs on the real values and its output
   shapes become a graph break's guard); a call whose result holds no tensor (a metadata query)
   returns that result as a constant and records nothing.

Afterwards, views are registered (so mutating a view updates its base, and the reverse), and
grad mode is honoured: under `torch.no_grad()` inside a differentiated function, results that
depend on tensors requiring grad are detached, as eager's results do not require grad.

Real tensors met along the way (captured globals, closure variables, module attributes that are
not parameters) become extra inputs of the trace, so later mutations of them are seen at run time.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from fulmen.core import (
    CallSiteTag,
    FulmenError,
    NotYetSupportedError,
    RunsEagerly,
    Tag,
    TraceCtx,
    get_tracectx,
)
from fulmen.core.proxy import iter_proxies
from fulmen.core.source import is_fulmens_own, user_source_location
from fulmen.ops.host_float import has_host_float
from fulmen.ops.opaque import draws_random, opaque_symbol
from fulmen.ops.torch import symbol_for
from fulmen.proxies import TensorProxy
from fulmen.tracer.autocast import autocast_call
from fulmen.tracer.autograd_function import (
    BACKWARD_CALLS,
    backward_refusal,
)
from fulmen.tracer.backward_in_trace import record_backward
from fulmen.tracer.call_kinds import (
    _IDENTITY,
    _VALUE_DEPENDENT,
    _func_name,
    _is_inplace,
    _name_the_call,
)
from fulmen.tracer.eager_reasons import (
    CapturedOffsetRead,
    GradInsideNoGrad,
    LazyBitQuery,
    LazyParameters,
    StorageIdentityRead,
    TensorHookInTrace,
)
from fulmen.tracer.fresh_leaves import mark_fresh, mark_no_grad_view
from fulmen.tracer.host_floats import item_at_run_time
from fulmen.tracer.layout_truth import LayoutTruth
from fulmen.tracer.mutation import Functionalizer
from fulmen.tracer.patching import TracingPatch
from fulmen.tracer.slice_bounds import INDEXING, bounds_read, tensor_bounded
from fulmen.tracer.view_calls import VIEW_FUNCTIONS

T = torch.Tensor



_DETACH = (T.detach, torch.detach, T.data.__get__)  # (`x.data`: detached, as in eager)
_REQUIRES_GRAD_ = T.requires_grad_
# (`retain_grad` is a hook too: it keeps the gradient autograd computes for that tensor)
_TENSOR_HOOKS = frozenset({T.register_hook, T.register_post_accumulate_grad_hook,
                           T.retain_grad})


_LAZY_BIT_QUERIES = frozenset({T.is_conj, T.is_neg, torch.is_conj})


class TorchScriptCall(RunsEagerly):
    """The traced code calls a `torch.jit.script`-ed function, or TorchScript (a scripted or
    traced module) that writes state (`self.n += 1`, an in-place op, a Python call): its body is opaque to fulmen
    and runs for real while tracing, so its writes would apply twice; the call runs eagerly.
    Scripted code that writes nothing runs for real as an op of unknown output shapes."""


_SCRIPT_FUNCTION_CALL = torch.jit.ScriptFunction.__dict__["__call__"]


def _script_function_call(function, *args, **kwargs):
    """`torch.jit.ScriptFunction.__call__` while a trace records: the TorchScript interpreter
    reaches no `__torch_function__`, so a call from traced code would hand it proxies (or bake
    in its result on closed-over tensors); the call runs eagerly. Elsewhere, TorchScript's."""
    ctx = get_tracectx()
    if isinstance(ctx, TracerCtx) and not ctx._internal:
        raise TorchScriptCall(
            f"the TorchScript function {function.name} is called, whose body fulmen does not "
            "trace", op="torch.jit.ScriptFunction", where=user_source_location(),
            hint="jit the Python function instead of scripting it, or call the scripted "
            "function outside the compiled function")
    return _SCRIPT_FUNCTION_CALL(function, *args, **kwargs)


_SCRIPT_FUNCTION_PATCH = TracingPatch(
    (torch.jit.ScriptFunction, "__call__", _script_function_call))


def script_functions_refused() -> contextlib.AbstractContextManager:
    """While active, a `torch.jit.script`-ed function called by traced code makes the call run
    eagerly (`TorchScriptCall`); other callers, and other threads, run it as TorchScript."""
    return _SCRIPT_FUNCTION_PATCH.held()


def _script_writes(method) -> bool:
    """Whether TorchScript `method`'s graph (submodule calls inlined) may write state: an
    attribute store, an op whose schema writes an argument (`Tensor(a!)`), a Python call."""
    pending = [method.inlined_graph.nodes()]
    while pending:
        for node in pending.pop():
            if node.kind() in ("prim::SetAttr", "prim::PythonOp") or "!" in node.schema():
                return True
            pending.extend(block.nodes() for block in node.blocks())
    return False


class TracerCtx(LayoutTruth, TraceCtx):
    """A `TraceCtx` that also routes torch calls and captures real tensors as inputs.

    `differentiable` (grad mode when tracing started) says whether the trace may be
    differentiated; `requires_grad_names` are the proxies that depend on an input requiring
    grad through ops run with grad enabled; `fresh_grad_names` those that require grad only
    because of a tensor given `requires_grad_()` inside the function (NOTE [fresh leaves]).
    `mutation` holds the functionalization state.
    """

    def __init__(self, name: str = "computation") -> None:
        super().__init__(name)
        self.captured: dict[int, tuple[torch.Tensor, TensorProxy]] = {}
        # id -> (tensor, array or buffer) of the tensors torch.from_numpy/frombuffer made
        self.foreign_sources: dict[int, tuple] = {}  # NOTE [tensors made during the call]
        self.torch_function = self.handle
        self.vmap_emulation = None  # `fulmen.tracer.vmap.Emulation` once a vmap is emulated
        self.mutation = Functionalizer(self)
        self.differentiable = torch.is_grad_enabled()
        self.requires_grad_names: set[str] = set()
        self.fresh_grad_names: set[str] = set()
        self.fresh_leaf_names: set[str] = set()  # the fresh leaves themselves
        self.no_grad_views: dict[str, bool] = {}  # NOTE [a view made under no_grad]
        self._internal = 0
        self._detaching = False  # recording the detach `_track_grad` adds under no_grad
        # set by the tracer when value-dependent Python may break the graph (BreakRecorder)
        self.breaks = None
        # id of each parameter/buffer of the traced module -> its input proxy
        self.state_proxies: dict[int, TensorProxy] = {}
        # id of each tensor inside an argument object (an optimizer's parameters and their
        # gradients) -> its input proxy: the same tensor reached otherwise (the closed-over
        # model's parameter) is that input, not a second one aliasing it
        self.object_proxies: dict[int, TensorProxy] = {}
        self.object_tensors: dict[int, torch.Tensor] = {}  # (the real tensors of those ids)
        # `loss.backward()` traced (`fulmen.tracer.backward_in_trace`): the argument-object
        # tensors whose `.grad` it made, for the tracer's epilogue stores
        self.backward_in_trace = False
        self.step_grads: list[TensorProxy] = []
        self.spent_names: set[str] = set()  # values computed before such a backward
        # (leaf name, dtype, grad mode) -> its cast in this autocast region (NOTE [autocast's
        # cast cache])
        self.autocast_casts: dict[tuple, TensorProxy] = {}

    def add_input(self, proxy: TensorProxy) -> None:
        """Declare `proxy` a trace input (argument, module state or captured tensor)."""
        self.mutation.add_input(proxy)
        if proxy.requires_grad:
            self.requires_grad_names.add(proxy.name)

    @contextlib.contextmanager
    def internal(self):
        """Torch calls made by the tracer itself (on current values, never in place)."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    def note_offset_read(self, tensor: torch.Tensor, caller) -> None:
        """`tensor.storage_offset()` of a real tensor, read by the frame `caller`. A parameter
        or buffer of the traced module is read as itself, not as its proxy: its offset is
        guarded like an input's (the tracer's `offset_reads`). Any other tensor the user's
        code reaches (a global, a closure's, a plain tensor attribute) has no offset in the key:
        the call runs eagerly (`CapturedOffsetRead`), never with a traced constant."""
        state = self.state_proxies.get(id(tensor))
        reads = getattr(self, "offset_reads", None)
        if state is not None:
            if reads is not None:
                reads.add(state.name)
        elif reads is not None and not is_fulmens_own(caller.f_code.co_filename):
            raise CapturedOffsetRead(
                "the traced code reads the storage offset of a tensor it reaches besides its "
                "arguments and the module's parameters and buffers", op="storage_offset",
                where=user_source_location())

    def capture(self, tensor: torch.Tensor) -> TensorProxy:
        """The input proxy standing for a real tensor the traced code closed over."""
        state = self.state_proxies.get(id(tensor))
        if state is not None:  # a parameter or buffer of the traced module
            return state
        entry = self.captured.get(id(tensor))
        if entry is None and id(tensor) in self.object_proxies:
            return self.object_proxies[id(tensor)]
        if entry is None:
            if torch.nn.parameter.is_lazy(tensor):  # a lazy module's first call sizes it
                raise LazyParameters(
                    "a lazy module (nn.LazyLinear, ...) materialises its parameters in this "
                    "call", op="materialize",
                    hint="call the lazy module once before compiling the function")
            name = self.names.named(f"captured{len(self.captured)}")
            proxy = TensorProxy(name, tensor.shape, tensor.dtype, tensor.device,
                                strides=tensor.stride(), requires_grad=tensor.requires_grad)
            entry = self.captured[id(tensor)] = (tensor, proxy)
            self.add_input(proxy)
        return entry[1]

    def _proxify(self, tree):
        def convert(leaf):
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, TensorProxy):
                return self.capture(leaf)
            return leaf

        return pytree.tree_map(convert, tree)

    def call_site_tags(self) -> frozenset[CallSiteTag]:
        """`CHECKPOINT` inside a `torch.utils.checkpoint` region (non-reentrant: its saved-
        tensor hooks are active), so rematerialization recomputes the region's values;
        `NO_GRAD` for a statement recorded under `torch.no_grad()` in a differentiated trace,
        `NO_GRAD_DETACH` for the detach `_track_grad` adds there (NOTE [a view of an input
        returned], which replays views made under no_grad as eager made them)."""
        tags = set()
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", ""):
            tags.add(CallSiteTag.CHECKPOINT)
        if self.differentiable and not torch.is_grad_enabled():
            tags.add(CallSiteTag.NO_GRAD)
        if self._detaching:
            tags.add(CallSiteTag.NO_GRAD_DETACH)
        return frozenset(tags)

    def handle(self, func, types, args, kwargs):
        """Record one torch call on proxies (see the module docstring for the route); inside
        a function `torch.vmap` maps, checked by the emulation (`fulmen.tracer.vmap`)."""
        if self.vmap_emulation is not None and self.vmap_emulation.checking():
            return self.vmap_emulation.call(self, self._handle, func, types, args, kwargs)
        return self._handle(func, types, args, kwargs)

    def _handle(self, func, types, args, kwargs):
        if func in BACKWARD_CALLS:
            if func is torch.autograd.grad:
                raise backward_refusal(func, "gradients as values: use fulmen.grad")
            return record_backward(self, func, args, kwargs)
        if func in _TENSOR_HOOKS:
            raise TensorHookInTrace(
                "a tensor hook registered (or retain_grad) inside a compiled function: the "
                "traced tensors are not the ones autograd sees at run time, so a compiled call "
                "would never fire it",
                op=_func_name(func), where=user_source_location(),
                hint="register it outside the compiled function, on an input or parameter "
                "(p.register_hook(...)) or on an output that no other output is computed from "
                "(on one that others are, the backward raises: NOTE [hooks on outputs other "
                "outputs read])")
        if func is T.item and getattr(self, "host_floats", False):  # NOTE [floats read at run time]
            out = item_at_run_time(self, func, *self.mutation.resolve_tree(
                self._proxify((args, kwargs))))
            if out is not None:
                return out
        if func in _VALUE_DEPENDENT:
            if self.breaks is not None and len(self.scopes) == 1 and func not in _IDENTITY:
                args, kwargs = self.mutation.resolve_tree(self._proxify((args, kwargs)))
                return self.breaks.take_value(func, args, kwargs)
            if func in _IDENTITY:
                raise StorageIdentityRead(
                    f"{_VALUE_DEPENDENT[func]} asks where a traced tensor's memory lies, which "
                    "a compiled call cannot answer", op=_func_name(func),
                    where=user_source_location(),
                    hint="compare tensors with `is`, or decide outside the compiled function")
            raise FulmenError(
                f"{_VALUE_DEPENDENT[func]} needs the tensor's value, which is unknown while tracing",
                op=_func_name(func),
                where=user_source_location(),
                hint="compute on tensors (torch.where instead of `if`), or pass Python numbers "
                "as arguments; they are specialised and guarded",
            )
        if func is T.__iter__:
            return iter(args[0].unbind(0))
        if func in INDEXING and len(args) >= 2 and tensor_bounded(args[1]):
            args = (args[0], bounds_read(args[1]), *args[2:])  # `x[:n]`, n a 0-d tensor
        user_args, user_kwargs = args, kwargs
        args, kwargs = self._proxify((args, kwargs))
        dtype = kwargs.get("dtype")
        if isinstance(dtype, type) and dtype in _PYTHON_DTYPES:  # `ones(n, dtype=int)`: BigBird
            kwargs = {**kwargs, "dtype": _PYTHON_DTYPES[dtype]}
        if self._internal:
            return self._dispatch(func, args, kwargs)
        if isinstance(func, torch._C.ScriptMethod) and _script_writes(func):
            raise TorchScriptCall(
                "a TorchScript module that writes state is called, whose body fulmen does not "
                "trace", op="torch.jit.ScriptModule", where=user_source_location(),
                hint="jit the module before scripting it, or call the scripted code outside "
                "the compiled function")
        if func in _LAZY_BIT_QUERIES:
            raise LazyBitQuery(
                "a tensor's conjugate or negative bit is read, which traced tensors do not carry",
                op=_func_name(func), where=user_source_location(),
                hint="resolve it outside the compiled function (z.resolve_conj())")
        if _is_inplace(func, args, kwargs):
            out = self.mutation.functionalize(func, args, kwargs)
            if self.state_proxies:  # `self.count += 1` returns (and stores) the module's tensor
                out = _restore_identities(out, (user_args, user_kwargs), (args, kwargs))
            return out
        r_args, r_kwargs = self.mutation.resolve_tree((args, kwargs))
        try:
            with self.internal():
                call = func
                if torch._C._is_any_autocast_enabled():  # NOTE [autocast inside an op]
                    call, r_args, r_kwargs = autocast_call(func, r_args, r_kwargs, self)
                elif self.autocast_casts:  # the region ended (NOTE [autocast's cast cache])
                    self.autocast_casts.clear()
                out = self._dispatch(call, r_args, r_kwargs)
        except (FulmenError, RuntimeError, ValueError, TypeError, IndexError) as error:
            _name_the_call(error, func)
            raise
        if kwargs.get("requires_grad") is True:  # `torch.zeros(n, requires_grad=True)`
            self.mutation.grad_leaves.update(p.name for p in iter_proxies(out))
            # a new autograd leaf, as one made by `requires_grad_()` (NOTE [fresh leaves]):
            # the torch executor's factory made results computed from it require grad, a
            # fused kernel's did not
            for proxy in _floating_proxies(out):
                mark_fresh(self, proxy)
                self.mutation.fresh_roots.add(proxy.name)
        if r_args is not args or r_kwargs is not kwargs:
            out = _restore_identities(out, (args, kwargs), (r_args, r_kwargs))
            self.mutation.refuse_grad_reads((args, kwargs), out)
        if func in VIEW_FUNCTIONS:
            self.mutation.record_view(func, args, kwargs, out)
            mark_no_grad_view(self, func, args, kwargs, out)  # NOTE [a view made under no_grad]
        if getattr(out, "_fulmen_layout_undecided", False) and isinstance(args[0], TensorProxy):
            # NOTE [contiguous of a batch of 1]: eager may return `args[0]` itself
            self.mutation.record_maybe_alias(args[0], out, "Tensor.contiguous")
            self.undecided_layouts.add(out.name)
        elif self.undecided_layouts and any(
                p.name in self.undecided_layouts for p in iter_proxies((args, kwargs))):
            self.undecided_layouts.update(p.name for p in iter_proxies(out))
        if self.state_proxies:  # `buffer.to(same dtype)` returns the module's own tensor
            out = _restore_identities(out, (user_args, user_kwargs), (args, kwargs))
        return out

    def _dispatch(self, func, args, kwargs):
        sym = symbol_for(func)
        if sym is not None and getattr(self, "host_floats", False) \
                and has_host_float((args, kwargs)):
            sym = None  # the exact torch op, with the float read at run time (NOTE [floats...])
        differentiable = sym is None or Tag.NOT_DIFFERENTIABLE not in sym.tags
        out = None
        if sym is not None:
            start = self.names.serial
            try:
                out = sym(*args, **kwargs)
            except NotYetSupportedError:
                sym = None  # the decomposition does not cover these arguments: run the op whole
            else:
                out = self._eager_layout(func, args, kwargs, out, start)
        if sym is None:
            random = draws_random(func, args, kwargs)
            sym, start = opaque_symbol(func, random=random), self.names.serial
            try:
                out = sym(*args, **kwargs)
                if not random:
                    out = self._eager_layout(func, args, kwargs, out, start, whole=True)
            except FulmenError as error:
                # PyTorch cannot describe the output without values (`nonzero`, `x[mask]`):
                # with graph breaks, run it on the real values and guard the shapes it gave
                if (self.breaks is None or len(self.scopes) != 1 or error.__cause__ is None
                        or isinstance(error.__cause__, FulmenError)):
                    raise
                try:
                    out = self.breaks.run_for_real(sym, func, args, kwargs)
                except FulmenError:
                    raise
                except Exception as real:
                    raise real from None  # eager's own error and type; the caller notes the line
        if (self.requires_grad_names or self.fresh_grad_names) and func not in _DETACH \
                and differentiable:
            out = self._track_grad(func, args, kwargs, out)
        return out

    def call(self, sym, *args, **kwargs):
        """Record fulmen symbol `sym` (not a torch callable) with grad bookkeeping."""
        out = sym(*args, **kwargs)
        if self.requires_grad_names or self.fresh_grad_names:
            out = self._track_grad(sym, args, kwargs, out)
        return out

    def _track_grad(self, func, args, kwargs, out):
        """Propagate requires-grad names; detach results computed under `no_grad` (see the
        module docstring)."""
        reads = [p for p in iter_proxies((args, kwargs)) if p.name in self.requires_grad_names]
        if not reads:
            if self.fresh_grad_names and torch.is_grad_enabled():
                self._track_fresh(args, kwargs, out)
            return out
        floating = _floating_proxies(out)
        if torch.is_grad_enabled():
            if not self.differentiable:
                raise GradInsideNoGrad(
                    "an op inside torch.enable_grad() reads a tensor that requires grad, but the "
                    "compiled function was called with grad disabled", op=_func_name(func),
                    where=user_source_location(),
                    hint="call the compiled function with grad enabled")
            _require_grad(self.requires_grad_names, floating)
            return out
        if not self.differentiable or not floating:
            return out
        self._detaching = True
        try:
            detached = {p.name: T.detach(p) for p in floating}
        finally:
            self._detaching = False
        return pytree.tree_map(
            lambda leaf: detached.get(leaf.name, leaf) if isinstance(leaf, TensorProxy) else leaf,
            out)

    def _track_fresh(self, args, kwargs, out) -> None:
        """Results of an op that reads a fresh leaf (and no input requiring grad) require grad
        too, as in eager, but nothing is differentiated for them (NOTE [fresh leaves])."""
        if any(p.name in self.fresh_grad_names for p in iter_proxies((args, kwargs))):
            _require_grad(self.fresh_grad_names, _floating_proxies(out))


def _floating_proxies(out) -> list[TensorProxy]:
    """The floating-point and complex tensor proxies among an op's outputs (those that can
    require grad)."""
    return [p for p in iter_proxies(out) if isinstance(p, TensorProxy)
            and (p.dtype.is_floating_point or p.dtype.is_complex)]


def _require_grad(names: set[str], proxies: list[TensorProxy]) -> None:
    """Add `proxies` to `names` and make each answer `requires_grad` as eager's result does."""
    names.update(p.name for p in proxies)
    with torch._C.DisableTorchFunctionSubclass():
        for p in proxies:
            if not p.requires_grad:
                _REQUIRES_GRAD_(p)


def _restore_identities(out, user, resolved):
    """An op that returned one of its (resolved) arguments returns the object the user passed,
    as eager returns the very same tensor (`x.float()` on a float tensor)."""
    originals = {}
    for before, after in zip(pytree.tree_leaves(user), pytree.tree_leaves(resolved)):
        if isinstance(after, TensorProxy) and after is not before:
            originals[id(after)] = before
    if not originals:
        return out
    return pytree.tree_map(lambda leaf: originals.get(id(leaf), leaf), out)


# a Python type given as a dtype means what PyTorch's argument parser makes of it
_PYTHON_DTYPES = {int: torch.int64, float: torch.float64, bool: torch.bool,
                  complex: torch.complex128}
