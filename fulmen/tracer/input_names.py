"""Where a traced call's inputs come from and what they are called: a module's parameters and
buffers (`state_slots`, one `StateSlot` per distinct tensor), and the names of argument leaves
(`_path_name`: `batch_0`, `kwargs_mask`, after the parameter names `_positional_names`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSlot:
    """Where a module keeps one parameter or buffer: `owner[key]`, first reached as `qualname`."""

    owner: dict
    key: str
    qualname: str

    def get(self) -> torch.Tensor:
        return self.owner[self.key]


def state_slots(module: torch.nn.Module) -> list[StateSlot]:
    """One slot per distinct parameter/buffer tensor of `module` (tied tensors once), parameters
    first, in `named_parameters()` order then `named_buffers()` order."""
    slots: list[StateSlot] = []
    seen: set[int] = set()
    modules = list(module.named_modules())
    for kind in ("_parameters", "_buffers"):
        for prefix, sub in modules:
            owner = getattr(sub, kind)
            for key, tensor in owner.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                slots.append(StateSlot(owner, key, f"{prefix}.{key}" if prefix else key))
    return slots


def _path_name(path, param_names: list[str]) -> str:
    """`(SequenceKey(0), SequenceKey(1), MappingKey('a'))` -> `w_a` for parameter `w`."""
    top, rest = path[0], path[1:]
    parts = []
    if top.idx == 0:  # positional argument
        index = rest[0].idx
        parts.append(param_names[index] if index < len(param_names) else f"arg{index}")
    else:  # keyword argument
        parts.append(str(rest[0].key))
    for key in rest[1:]:
        for attr in ("idx", "key", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "_".join(parts)


def _positional_names(fn: Callable) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    names = []
    for param in params:
        if param.kind == param.VAR_POSITIONAL:
            break
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
    return names


__all__ = ["StateSlot", "state_slots"]
