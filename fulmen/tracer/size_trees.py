"""`torch.Size` kept through pytree: PyTorch's pytree rebuilds a `torch.Size` node as a plain
tuple, so a size passed to the traced function (`f(x, x.shape)`) or returned by it would reach
the user's code as a tuple (`isinstance(s, torch.Size)` false, no `.numel()`). The tracer
rewrites its input and output tree specs with `keep_sizes`: each `torch.Size` node becomes a
`SizeNode`, a node type registered here whose unflattening makes a `torch.Size`; nothing else
changes, and a compiled call rebuilds its outputs with the same `pytree.tree_unflatten`.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


class SizeNode(tuple):
    """The pytree node type standing for a `torch.Size` in a rewritten spec."""


def _flatten(node):
    return list(node), None


def _unflatten(values, _context) -> torch.Size:
    return torch.Size(values)


pytree.register_pytree_node(SizeNode, _flatten, _unflatten,
                            serialized_type_name="fulmen.tracer.size_trees.SizeNode")


def keep_sizes(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """`spec` with every `torch.Size` node made a `SizeNode` (the same object if it has none).

    >>> _, spec = pytree.tree_flatten((1, torch.Size([2, 3])))
    >>> pytree.tree_unflatten([1, 2, 3], keep_sizes(spec))
    (1, torch.Size([2, 3]))
    """
    if spec.is_leaf():
        return spec
    children = spec.children()
    kept = [keep_sizes(child) for child in children]
    if spec.type is not torch.Size and all(k is c for k, c in zip(kept, children)):
        return spec
    kind = SizeNode if spec.type is torch.Size else spec.type
    return pytree.TreeSpec(kind, spec.context, kept)


__all__ = ["SizeNode", "keep_sizes"]
