"""Torch-level ops (`ltorch`): the torch API users call, each decomposed into prims.

`ltorch.add`, `ltorch.softmax`, ... are symbols; printed pre-execution traces call them by these
names. One file per op family; type promotion and broadcasting live in `utils`.
"""

from fulmen.ops.torch import (  # noqa: F401  (importing registers the ops)
    activations,
    attention,
    conversions,
    creation,
    elementwise,
    indexing,
    joins,
    linalg,
    logical,
    losses,
    nn,
    permutations,
    reductions,
    shape,
    unary,
)
from fulmen.ops.torch.base import (
    LTORCH_NAMESPACE,
    all_torch_ops,
    registered_torch_callables,
    symbol_for,
    torch_op,
    torch_qualname,
)

__all__ = [
    "LTORCH_NAMESPACE",
    "all_torch_ops",
    "registered_torch_callables",
    "symbol_for",
    "torch_op",
    "torch_qualname",
]


def __getattr__(name: str):
    ops = all_torch_ops()
    if name in ops:
        return ops[name]
    raise AttributeError(f"module 'fulmen.ops.torch' has no op {name!r}")
