"""`FactoryMode`: the `TorchFunctionMode` active while tracing, which sees every torch call,
also those with no tensor argument (`torch.zeros(3)`, `torch.sym_max(s0, 1)`).

A call on a tensor or a factory with a fulmen decomposition goes to the tracer
(`fulmen.tracer.dispatch.TracerCtx.handle`); a metadata query answers at once, after the checks
that keep it from baking in what a later call changes (a `.grad` that is no input of the trace,
a graph read, a stale proxy, an undecided layout, a storage offset); a call of numbers alone
runs with its symbolic numbers specialised.
"""

from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fulmen.core import RunsEagerly
from fulmen.core.source import is_fulmens_own, is_internal, user_source_location
from fulmen.ops.torch import symbol_for
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import METADATA_FUNCTIONS
from fulmen.tracer.autograd_function import intercept_function_apply
from fulmen.tracer.call_constants import foreign_memory_recorded
from fulmen.tracer.call_kinds import _func_name
from fulmen.tracer.dispatch import TracerCtx, script_functions_refused
from fulmen.tracer.flag_reads import GRAD, REQUIRES_GRAD, note_flag_read
from fulmen.tracer.fresh_leaves import GRAPH_READS, graph_read
from fulmen.tracer.host_floats import refuse_host_floats
from fulmen.tracer.metadata_inplace import StaleTensorProxy, stale_use
from fulmen.tracer.objects import PLAIN_NUMBER

T = torch.Tensor
_GRAD_GET = torch.Tensor.grad.__get__


class UnreadGrad(RunsEagerly):
    """The traced code reads the `.grad` of a tensor whose gradient is no input of the trace:
    the call runs eagerly."""


_REQUIRES_GRAD_GET = torch.Tensor.requires_grad.__get__
# the autograd flags of real tensors whose reads by the user's code are keyed
_FLAG_GETS = {_GRAD_GET: GRAD, _REQUIRES_GRAD_GET: REQUIRES_GRAD}
_BASE_GET = torch.Tensor._base.__get__


class ViewBaseRead(RunsEagerly):
    """The traced code reads `._base` of a traced tensor (an argument, a value computed
    inside): a proxy keeps no view base, and `._base` answered None where eager's view
    (`x[1:]`) answers its base, so `v._base.sum()` crashed and `v._base is None` took the
    other branch, silently. An argument's base lies outside the trace, and whether the
    caller's tensor is a view is not keyed: the call runs eagerly. A real tensor the code
    reaches (a closed-over view `base[1:]`, a parameter) answers its own base, as in eager
    (it answered None too, through the trace's torch-function mode)."""


# the one frame of torch's whose reads of a parameter's grad are neither keyed nor refused:
# `nn.Module._apply` converts it along with its parameter. (`Module.zero_grad`, same file,
# reads it to zero it: keyed, `_keyed_read`; once its trace captured the grad of the first
# call, and later calls zeroed nothing)
_MODULE_APPLY = torch.nn.Module._apply.__code__


def _keyed_read(func, code) -> bool:
    """Whether a read of a real tensor's autograd flag by `code` is keyed (NOTE [flags of
    closed-over tensors]): the user's reads; torch's of `.grad` (`clip_grad_norm_`,
    `Module.zero_grad`), except `Module._apply`'s, which converts it along with its
    parameter. Not fulmen's own, nor torch's of `requires_grad` (they decide nothing the
    results show)."""
    if not is_internal(code.co_filename):
        return True
    return func == _GRAD_GET and code is not _MODULE_APPLY and not is_fulmens_own(
        code.co_filename)


def _unread_grad(tensor, caller) -> bool:
    """Whether reading `tensor.grad` while tracing would bake in a gradient that is no input: a
    tensor argument's (`unseen_grad`), a real leaf's that requires grad (a parameter of a
    module argument or a global: each backward, after `zero_grad()`, makes a new one), or any
    real tensor's that has one (a frozen parameter's: the caller may set another, and the trace
    took the one it met for a tensor the call made, so `p.grad.mul_(0.5)` updated a copy),
    unless `caller` (the reading frame) is `nn.Module._apply` converting it along with its
    parameter (HF Switch Transformers' router calls `self.classifier.to(dtype)` in its
    forward). (Reads of a real tensor's `.grad` by the user's code and torch's are keyed
    instead, NOTE [flags of closed-over tensors]: `_keyed_read`.)"""
    if isinstance(tensor, TensorProxy):
        return getattr(tensor, "unseen_grad", False)
    if not isinstance(tensor, torch.Tensor) or caller.f_code is _MODULE_APPLY:
        return False
    if tensor.is_leaf:
        return tensor.requires_grad or _GRAD_GET(tensor) is not None
    return tensor.retains_grad and _GRAD_GET(tensor) is not None  # (else a warning, and None)


# factories of tensors from Python data with no decomposition: on lists and numbers they are
# recorded (opaque), so each call makes a new tensor as eager does; run at trace time, the
# result would be one captured tensor that every call returns and updates in place. On a NumPy
# array they run at trace time: the captured tensor shares the array's memory, as eager's does
# (the array is in the cache key, `sources.array_key`)
_DATA_FACTORIES = frozenset([torch.as_tensor, torch.asarray])
_PYTHON_DATA = (list, tuple, bool, int, float, complex)


def _python_data(args: tuple, kwargs: dict) -> bool:
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    return isinstance(data, _PYTHON_DATA)


class FactoryMode(TorchFunctionMode):
    """Active while tracing, it sees every torch call. Calls on tensors (proxies, or real tensors
    the function closes over, which become inputs) and factories with a fulmen decomposition go
    to the tracer, so nothing computed from a tensor is baked into the trace as a constant."""

    def __init__(self, ctx: TracerCtx) -> None:
        super().__init__()
        self.ctx = ctx
        self._apply_hook = intercept_function_apply(ctx)  # autograd.Function.apply: no torch fn
        self._foreign_hook = foreign_memory_recorded()  # torch.from_numpy/frombuffer: neither
        self._script_hook = script_functions_refused()  # a ScriptFunction: neither

    def __enter__(self):
        self._apply_hook.__enter__()
        self._foreign_hook.__enter__()
        self._script_hook.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        super().__exit__(*exc_info)
        self._script_hook.__exit__(*exc_info)
        self._foreign_hook.__exit__(*exc_info)
        self._apply_hook.__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _BASE_GET and not isinstance(args[0], TensorProxy):
            return func(*args)  # a real tensor (closed over, a parameter): its own base
        if func == _BASE_GET and not is_fulmens_own(sys._getframe(1).f_code.co_filename):
            raise ViewBaseRead(
                f"reading ._base of {args[0].name}, a traced tensor: the trace keeps no view "
                "bases (eager answers the tensor a view was taken from)", op="Tensor._base",
                where=user_source_location(),
                hint="read the base tensor itself (pass it, or close over it)")
        if func in METADATA_FUNCTIONS:
            if self.ctx.vmap_emulation is not None and self.ctx.vmap_emulation.checking():
                self.ctx.vmap_emulation.metadata(func, args, sys._getframe(1))
            if func in _FLAG_GETS and not isinstance(args[0], TensorProxy) \
                    and isinstance(args[0], torch.Tensor) \
                    and (func == _GRAD_GET or id(args[0]) not in self.ctx.state_proxies) \
                    and _keyed_read(func, sys._getframe(1).f_code):
                # keyed from now on (NOTE [flags of closed-over tensors])
                note_flag_read(self.ctx, args[0], _FLAG_GETS[func])
                if func == _GRAD_GET and self.ctx.backward_in_trace \
                        and id(args[0]) in self.ctx.object_proxies:
                    # a leaf of `loss.backward()` in the trace: the gradient it made
                    with torch._C.DisableTorchFunctionSubclass():
                        return self.ctx.object_proxies[id(args[0])].grad
            elif func == _GRAD_GET and _unread_grad(args[0], sys._getframe(1)):
                what = f"the tensor argument {args[0].name}" if isinstance(
                    args[0], TensorProxy) else "a tensor the function reaches (a module's parameter)"
                raise UnreadGrad(
                    f"reading the .grad of {what}: such gradients are not inputs of the trace "
                    "(the next backward replaces them)", op="Tensor.grad",
                    where=user_source_location(),
                    hint="pass the optimizer (fulmen reads p.grad of the parameters inside it "
                    "on every call), or compute with the gradients outside the compiled function")
            if func in GRAPH_READS and isinstance(args[0], TensorProxy) \
                    and args[0].requires_grad \
                    and not is_fulmens_own(sys._getframe(1).f_code.co_filename):
                return graph_read(self.ctx, func, args[0])  # NOTE [graph reads]
            if type(args[0]) is StaleTensorProxy and not is_internal(
                    sys._getframe(1).f_code.co_filename):  # NOTE [in-place metadata changes]
                raise stale_use(args[0], _func_name(func))
            if func is T.stride and self.ctx.undecided_layouts and isinstance(
                    args[0], TensorProxy):
                self.ctx.check_layout_read(args[0], "stride()", sys._getframe(1))
            if func is T.storage_offset and not isinstance(args[0], TensorProxy):
                self.ctx.note_offset_read(args[0], sys._getframe(1))
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs))):
            return self.ctx.handle(func, types, args, kwargs)
        sym = symbol_for(func)
        if (sym is not None and "factory" in sym.tags) or (
                func in _DATA_FACTORIES and _python_data(args, kwargs)):
            return self.ctx.handle(func, types, args, kwargs)
        return _call_with_numbers(func, args, kwargs)


# torch's functions of symbolic numbers that return numbers (`torch.sym_max(s0, 1)`), by name
_NUMBER_FUNCTIONS = frozenset(
    getattr(torch, name) for name in dir(torch) if name.startswith(("sym_", "_sym_")))


def _call_with_numbers(func, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` for a torch call with no tensor argument. A symbolic size given
    where the op reads a Scalar is read by PyTorch as garbage (`torch.div(s0, 4,
    rounding_mode="trunc")` gave `tensor(1944444)` for s0 = 8, Longformer's and LED's chunk
    count): except for torch's functions of numbers (`torch.sym_max`: `_NUMBER_FUNCTIONS`), the
    call's symbolic numbers are specialised first (`int(s0)`, a guard), as `torch.tensor(s0)`
    is."""
    if func in _NUMBER_FUNCTIONS:
        return func(*args, **kwargs)
    refuse_host_floats(func, args, kwargs)
    args, kwargs = pytree.tree_map(_specialised, (args, kwargs))
    return func(*args, **kwargs)


def _specialised(value):
    """A symbolic number's value in this call, guarded (`int(s0)` records `Eq(s0, 8)`)."""
    kind = PLAIN_NUMBER.get(type(value))
    return value if kind is None else kind(value)
