"""The torch executor: runs every torch-level op, opaque op and prim as the plain torch call.

It is the reference executor and always ends the priority list. Torch-level ops run whole as
the torch callable they stand for (`torch.add`, `torch.nn.functional.layer_norm`); prims run as
their torch equivalents (`fulmen.executors.torch.prims`).
"""

from __future__ import annotations

import torch

from fulmen.core import Symbol
from fulmen.core.symbol import Namespace
from fulmen.executors.base import TORCH_NAMESPACE, Implementation, OperatorExecutor
from fulmen.executors.registry import register_executor
from fulmen.executors.torch.prims import prim_implementations
from fulmen.ops.functionalized import WRITE_BACK
from fulmen.ops.torch import symbol_for, torch_qualname
from fulmen.ops.torch_autograd import (
    AUTOGRAD_BACKWARD,
    AUTOGRAD_FORWARD,
    AUTOGRAD_VJP,
    autograd_backward_impl,
    autograd_forward_impl,
    autograd_vjp_impl,
)
from fulmen.proxies import TensorProxy


class TorchExecutor(OperatorExecutor):
    """Claims every symbol that stands for a torch callable, and every prim."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.namespace = Namespace(
            "torchex", self, "from fulmen.extend import get_executor\ntorchex = get_executor('torch')"
        )

    def _operator_for(self, sym: Symbol, fn) -> Symbol:
        name = sym.name
        while name in self.operators:
            name += "_"
        torch_name = torch_qualname(fn)
        if torch_name is not None:
            namespace, python_name = TORCH_NAMESPACE, torch_name
        else:
            namespace, python_name = self.namespace, f"torchex.{name}"
        op = Symbol(name, sym.fn, namespace=namespace, python_name=python_name, impl=fn,
                    tags=sym.tags, executor=self)
        self.operators[name] = op
        return op

    def implementation_for(self, sym: Symbol) -> Implementation | None:
        impl = super().implementation_for(sym)
        if impl is None and sym.torch_fn is not None:
            impl = Implementation(self._operator_for(sym, sym.torch_fn))
            self.implementations[sym] = impl
        return impl


def _as_layout(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """`tensor`, or a copy of it laid out with `strides` (dense, non-overlapping) when its own
    strides differ on a dimension of size > 1 (see NOTE [output layout] in
    `fulmen.executors.claim`)."""
    own = tensor.stride()
    if all(own[d] == stride for d, (size, stride) in enumerate(zip(tensor.shape, strides))
           if size > 1):
        return tensor
    out = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def _as_layout_meta(tensor: TensorProxy, strides: tuple[int, ...]) -> TensorProxy:
    out = TensorProxy(None, tensor.shape, tensor.dtype, tensor.device, strides=strides)
    out._fulmen_exact_strides = getattr(tensor, "_fulmen_exact_strides", False)
    return out


def _view(self: torch.Tensor, *shape, size=None) -> torch.Tensor:
    """`Tensor.view`, run as `reshape`.

    NOTE [views at run time]: tracing raised eager's error for a view that eager's strides
    cannot give, but an intermediate may be laid out differently when the program runs (a
    fusion writes contiguous outputs where eager kept channels_last), and `view` would then
    fail although eager's did not (HF Swin). Traces are functional, so `reshape`, a view
    where the strides allow one and a copy otherwise, gives the same values.
    """
    if size is None:
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return self.reshape(size)


def _view_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`Tensor.view_as`, run as `reshape` (NOTE [views at run time])."""
    return self.reshape(other.shape)


def _write_back(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """A mutated input's write-back (`fulmen.ops.functionalized.WRITE_BACK`), outside autograd
    where the input requires grad: the tracer lets such an input change only under `no_grad`
    (an optimizer or EMA step; NOTE [no_grad updates of tensors requiring grad]), and a segment
    of a trace tree runs in the caller's grad mode, where copying into a leaf would raise.
    Such an input is written through `dst.detach()` (its storage, and its version counter, so
    autograd still sees the update), not under `torch.no_grad()`: entering and leaving that
    context cost 5 µs per parameter, a third of a jitted SGD step's write-backs."""
    if dst.requires_grad:
        dst.detach().copy_(src)
        return dst
    return dst.copy_(src)


torch_ex = TorchExecutor()
AS_LAYOUT = torch_ex.register_operator("as_layout", fn=_as_layout, meta=_as_layout_meta)
torch_ex.register_implementation(symbol_for(torch.Tensor.view), fn=_view)
torch_ex.register_implementation(symbol_for(torch.Tensor.view_as), fn=_view_as)
for _prim, _fn in prim_implementations().items():
    _prim.impl = _fn
    torch_ex.register_implementation(_prim, torch_ex._operator_for(_prim, _fn))
torch_ex.register_implementation(WRITE_BACK, torch_ex._operator_for(WRITE_BACK, _write_back))
torch_ex.register_implementation(AUTOGRAD_VJP, fn=autograd_vjp_impl)
torch_ex.register_implementation(AUTOGRAD_FORWARD, fn=autograd_forward_impl)
torch_ex.register_implementation(AUTOGRAD_BACKWARD, fn=autograd_backward_impl)
register_executor(torch_ex)

__all__ = ["AS_LAYOUT", "TorchExecutor", "torch_ex"]
