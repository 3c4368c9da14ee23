"""Routing of torch calls made while tracing.

Every torch call whose arguments include a proxy arrives here, through
`TensorProxy.__torch_function__` or through `FactoryMode` (a `TorchFunctionMode` that also sees
calls with no tensor argument, such as `torch.zeros`). The route, in order:

1. a value-dependent call (`.item()`, `bool(t)`, `.tolist()`, ...) raises a `FulmenError` naming
   the construct and the user's line;
2. an in-place or `out=` call raises `NotYetSupportedError` (never a dropped mutation);
3. a torch callable with a fulmen decomposition records that torch-level symbol (a
   decomposition that raises `NotYetSupportedError` for some arguments falls through to 4);
4. anything else records the opaque symbol for the callable (PyTorch's meta kernel gives the
   output); a call whose result holds no tensor (a metadata query) returns that result as a
   constant and records nothing.

Real tensors met along the way (captured globals, closure variables, module attributes that are
not parameters) become extra inputs of the trace, so later mutations of them are seen at run time.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fulmen.core import FulmenError, NotYetSupportedError, TraceCtx
from fulmen.core.source import user_source_location
from fulmen.ops.opaque import opaque_symbol
from fulmen.ops.torch import symbol_for, torch_qualname
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import METADATA_FUNCTIONS

T = torch.Tensor

_VALUE_DEPENDENT = {
    T.item: "Tensor.item()",
    T.tolist: "Tensor.tolist()",
    T.numpy: "Tensor.numpy()",
    T.__bool__: "bool(tensor) (e.g. `if tensor:` or `while tensor:`)",
    T.__int__: "int(tensor)",
    T.__float__: "float(tensor)",
    T.__index__: "using a tensor as an index or size",
    T.__complex__: "complex(tensor)",
    T.__array__: "converting a tensor to a numpy array",
    T.data_ptr: "Tensor.data_ptr()",
    T.untyped_storage: "Tensor.untyped_storage()",
    T.equal: "Tensor.equal()",
    torch.equal: "torch.equal()",
    torch.allclose: "torch.allclose()",
    T.allclose: "Tensor.allclose()",
    torch.is_nonzero: "torch.is_nonzero()",
}


def _func_name(func) -> str:
    return torch_qualname(func) or getattr(func, "__qualname__", None) or repr(func)


_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__idiv__",
}  # fmt: skip


@functools.cache
def _signature(func) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _bound_flag(func, args, kwargs, name: str):
    """The value passed for parameter `name` (by keyword or position), or None."""
    if name in kwargs:
        return kwargs[name]
    signature = _signature(func)
    if signature is None or name not in signature.parameters:
        return None
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get(name)
    except TypeError:
        return None


def _is_inplace(func, args, kwargs) -> bool:
    """Whether the call mutates an argument: an `_`-suffixed method, an in-place dunder,
    `out=`, `inplace=True`, or `F.embedding(..., max_norm=...)` (renormalises the weight)."""
    if kwargs.get("out") is not None:
        return True
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return False
    if name in ("__setitem__", "__set__", "__delitem__"):
        return True
    if name in _INPLACE_DUNDERS:
        return True
    if name.endswith("_") and not name.startswith("_"):
        return True
    if _bound_flag(func, args, kwargs, "inplace") is True:
        return True
    return func is F.embedding and _bound_flag(func, args, kwargs, "max_norm") is not None


class TracerCtx(TraceCtx):
    """A `TraceCtx` that also routes torch calls and captures real tensors as inputs."""

    def __init__(self, name: str = "computation") -> None:
        super().__init__(name)
        self.captured: dict[int, tuple[torch.Tensor, TensorProxy]] = {}
        self.torch_function = self.handle

    def capture(self, tensor: torch.Tensor) -> TensorProxy:
        """The input proxy standing for a real tensor the traced code closed over."""
        entry = self.captured.get(id(tensor))
        if entry is None:
            name = self.names.named(f"captured{len(self.captured)}")
            proxy = TensorProxy(name, tensor.shape, tensor.dtype, tensor.device,
                                strides=tensor.stride(), requires_grad=tensor.requires_grad)
            entry = self.captured[id(tensor)] = (tensor, proxy)
        return entry[1]

    def _proxify(self, tree):
        def convert(leaf):
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, TensorProxy):
                return self.capture(leaf)
            return leaf

        return pytree.tree_map(convert, tree)

    def handle(self, func, types, args, kwargs):
        """Record one torch call on proxies (see the module docstring for the route)."""
        if func in _VALUE_DEPENDENT:
            raise FulmenError(
                f"{_VALUE_DEPENDENT[func]} needs the tensor's value, which is unknown while tracing",
                op=_func_name(func),
                where=user_source_location(),
                hint="compute on tensors (torch.where instead of `if`), or pass Python numbers "
                "as arguments; they are specialised and guarded",
            )
        if func is T.__iter__:
            return iter(args[0].unbind(0))
        if _is_inplace(func, args, kwargs):
            raise NotYetSupportedError(
                "in-place operations and out= are not supported yet while tracing",
                op=_func_name(func),
                where=user_source_location(),
                hint="use the out-of-place form (x = x.add(y) instead of x.add_(y))",
            )
        args, kwargs = self._proxify((args, kwargs))
        sym = symbol_for(func)
        if sym is not None:
            try:
                return sym(*args, **kwargs)
            except NotYetSupportedError:
                pass  # the decomposition does not cover these arguments: run the op whole
        return opaque_symbol(func)(*args, **kwargs)


class FactoryMode(TorchFunctionMode):
    """Active while tracing, it sees every torch call. Calls on tensors (proxies, or real tensors
    the function closes over, which become inputs) and factories with a fulmen decomposition go
    to the tracer, so nothing computed from a tensor is baked into the trace as a constant."""

    def __init__(self, ctx: TracerCtx) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA_FUNCTIONS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, kwargs))):
            return self.ctx.handle(func, types, args, kwargs)
        sym = symbol_for(func)
        if sym is not None and "factory" in sym.tags:
            return self.ctx.handle(func, types, args, kwargs)
        return func(*args, **kwargs)
