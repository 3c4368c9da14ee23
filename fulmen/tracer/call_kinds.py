"""What kind of torch call the dispatcher (`fulmen.tracer.dispatch`) has in hand: one that needs
a tensor's value (`_VALUE_DEPENDENT`: a graph break), one that mutates an argument
(`_is_inplace`: functionalized); and how an error names the call (`_name_the_call`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core import FulmenError
from fulmen.core.source import user_source_location
from fulmen.ops.torch import torch_qualname
from fulmen.tracer.inplace_calls import signature_of

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
    T.__contains__: "`element in tensor`",
    T.__format__: "formatting a tensor (f\"{t}\", format(t))",
    T.__repr__: "a tensor's text (str(t), repr(t))",
}
# Questions about a tensor's storage rather than its values: no graph break can answer them.
_IDENTITY = frozenset({T.data_ptr, T.untyped_storage})


def _name_the_call(error: Exception, func) -> None:
    """Say in `error` which op of the user's program raised it and on which line: a fulmen
    error without a location gets it; PyTorch's own errors (a meta kernel's shape check) keep
    their type and get a note."""
    where = user_source_location()
    if where is None:
        return
    if isinstance(error, FulmenError):
        error.locate(where)
    elif not any("fulmen: in " in note for note in getattr(error, "__notes__", ())):
        error.add_note(f"fulmen: in {_func_name(func)} at {where}")


def _func_name(func) -> str:
    return torch_qualname(func) or getattr(func, "__qualname__", None) or repr(func)


_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__idiv__",
}  # fmt: skip


def _bound_flag(func, args, kwargs, name: str):
    """The value passed for parameter `name` (by keyword or position), or None."""
    if name in kwargs:
        return kwargs[name]
    signature = signature_of(func)
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
    schema = getattr(func, "_schema", None)  # an OpOverload: `torch.ops.aten.add_.Tensor`
    if schema is not None:
        return any(argument.alias_info is not None and argument.alias_info.is_write
                   for argument in schema.arguments)
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return False
    if name in ("__setitem__", "__set__", "__delitem__"):
        return True
    if name in _INPLACE_DUNDERS:
        return True
    if name.endswith("_") and not name.startswith("__"):  # also `torch._foreach_add_`
        return True
    if _bound_flag(func, args, kwargs, "inplace") is True:
        return True
    if func is F.batch_norm and _bound_flag(func, args, kwargs, "training") is True:
        return any(_bound_flag(func, args, kwargs, stat) is not None
                   for stat in ("running_mean", "running_var"))
    return func is F.embedding and _bound_flag(func, args, kwargs, "max_norm") is not None
