"""What a jitted call's arguments hold, by position: the shapes of its tensors and its
integers and floats, at an argument's index or at `(index, path)` inside an object argument
(`fulmen.tracer.objects.walk`), and at negative roots for the jitted function's own objects
(`fulmen.tracer.sources.function_roots`). Read by the dynamic-shape policy
(`fulmen.tracer.shape_policy`) to tell which sizes and numbers changed between calls.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.tracer.objects import float_in_tuple, follow, is_plain_object, walk


def tensor_shapes(leaves: list) -> list[tuple[Any, tuple[int, ...]]]:
    """`(position, shape)` of each tensor of a call: flattened arguments, and the tensors
    inside object arguments (an HF `DynamicCache`) at `(index, path)` (see `tensor_at`)."""
    shapes = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            shapes.append((i, tuple(leaf.shape)))
        elif is_plain_object(leaf):
            shapes.extend(((i, path), tuple(value.shape)) for path, value in walk(leaf)
                          if isinstance(value, torch.Tensor))
    return shapes


def int_values(leaves: list, kind: type = int) -> list[tuple[Any, int]]:
    """`(position, value)` of each integer (not a bool; with `kind=float`, each float) among
    the call's arguments (at its index) and inside its object arguments (at `(index, path)`)."""
    found = []
    for i, leaf in enumerate(leaves):
        if type(leaf) is kind:
            found.append((i, leaf))
        elif is_plain_object(leaf):
            found.extend(((i, path), value) for path, value in walk(leaf) if type(value) is kind)
    return found


def number_in_tuple(leaves: list, roots, position) -> bool:
    """Whether the number at `(root, path)` is an item of a tuple that tracing cannot give a
    proxy (`ObjectInputs.swap_in` rebuilds only a plain tuple held by a list, dict or object:
    `objects.float_in_tuple`)."""
    if not isinstance(position, tuple):
        return False
    root, path = position
    root_object = roots[-1 - root] if root < 0 else leaves[root]
    return isinstance(follow(root_object, path[:-1]), tuple) \
        and not float_in_tuple(root_object, path)


def is_learning_rate(leaves: list, roots, position) -> bool:
    """Whether the float at `position` is a learning rate in a torch optimizer's
    `param_groups` (`optimizer.param_groups[i]["lr"]`): read at run time from the first call,
    since LR schedulers change it at every step (NOTE [floats read at run time])."""
    if not isinstance(position, tuple) or len(position[1]) != 3:
        return False
    root, path = position
    owner = roots[-1 - root] if root < 0 else leaves[root]
    return path[0] == ("attr", "param_groups") and path[2] == ("key", "lr") \
        and isinstance(owner, torch.optim.Optimizer)


def root_floats(roots: list, kind: type = float) -> list[tuple[Any, float]]:
    """`((root, path), value)` of each float (with `kind=int`, each integer, not a bool) inside
    the jitted function's own objects (a bound method's `self`, an LR scheduler's optimizer:
    `fulmen.tracer.sources.function_roots`; a custom optimizer's step count in
    `self.state[p]["step"]`), at negative roots (`symbolic.number_at`)."""
    return [((-1 - i, path), value) for i, root in enumerate(roots) if is_plain_object(root)
            for path, value in walk(root) if type(value) is kind]
