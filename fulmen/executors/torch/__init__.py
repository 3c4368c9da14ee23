"""The torch executor: runs every torch-level op, opaque op and prim as the plain torch call.

It is the reference executor and always ends the priority list. Torch-level ops run whole as
the torch callable they stand for (`torch.add`, `torch.nn.functional.layer_norm`); prims run as
their torch equivalents (`fulmen.executors.torch.prims`).
"""

from __future__ import annotations

from fulmen.core import Symbol
from fulmen.core.symbol import Namespace
from fulmen.executors.base import TORCH_NAMESPACE, Implementation, OperatorExecutor
from fulmen.executors.registry import register_executor
from fulmen.executors.torch.prims import prim_implementations
from fulmen.ops.torch import torch_qualname
from fulmen.transforms.autodiff import (
    AUTOGRAD_BACKWARD,
    AUTOGRAD_FORWARD,
    AUTOGRAD_VJP,
    autograd_backward_impl,
    autograd_forward_impl,
    autograd_vjp_impl,
)


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


torch_ex = TorchExecutor()
for _prim, _fn in prim_implementations().items():
    _prim.impl = _fn
    torch_ex.register_implementation(_prim, torch_ex._operator_for(_prim, _fn))
torch_ex.register_implementation(AUTOGRAD_VJP, fn=autograd_vjp_impl)
torch_ex.register_implementation(AUTOGRAD_FORWARD, fn=autograd_forward_impl)
torch_ex.register_implementation(AUTOGRAD_BACKWARD, fn=autograd_backward_impl)
register_executor(torch_ex)

__all__ = ["TorchExecutor", "torch_ex"]
