"""Why a call missed the cache, in words: `describe_call` names what a call was specialised
on (`x.shape`, `model.training`, a module attribute's value, ...), `explain_change` compares two
descriptions (`['x.shape changed from (4, 4) to (8, 4)']`) for `fulmen.compile_stats` and the
`fulmen.recompiles` log. Only misses pay for it; the key itself is `fulmen.tracer.guards`'.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.tracer.input_names import _path_name
from fulmen.tracer.leaf_keys import _float_key
from fulmen.tracer.objects import is_plain_object, path_text, walk
from fulmen.tracer.process_state import describe_process_state
from fulmen.tracer.source_keys import object_source_key, source_key
from fulmen.tracer.source_reads import training_of
from fulmen.tracer.sources import CONTAINERS, NUMPY_ARRAYS, array_key, global_names
from fulmen.tracer.symbolic import _row_major

Tensor = torch.Tensor


def describe_call(param_names: list[str], args: tuple, kwargs: dict, modules=(),
                  module_names=(), sources=()) -> dict[str, object]:
    """What a call was specialised on, by name (`x.shape`, `scale`, `grad mode`, ...), for
    explaining retraces in words. Names follow the trace's input names."""
    described: dict[str, object] = describe_process_state()
    for name, module in zip(module_names, modules):
        described[f"{name or 'model'}.training"] = training_of(module)
    for name, read in sources:
        value = read()
        if isinstance(value, Tensor):  # compared by identity, as keyed
            value = f"<tensor {tuple(value.shape)} at {id(value):#x}>"
        elif type(value) in CONTAINERS:
            value = source_key(value)
        elif isinstance(value, NUMPY_ARRAYS):  # compared by identity and value, as keyed
            value = array_key(value)
        elif is_plain_object(value):
            value = object_source_key(value)
        described[name] = value
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        name = _path_name(path, param_names)
        if is_plain_object(leaf):  # an HF cache: the shapes of the tensors it holds, and
            for steps, value in walk(leaf):  # the numbers it keys by value (`cumulative_length`)
                if isinstance(value, Tensor):
                    described[f"{name}{path_text(steps)}.shape"] = tuple(value.shape)
                elif type(value) in (int, float, bool):
                    described[f"{name}{path_text(steps)}"] = value
            continue
        if isinstance(leaf, Tensor):
            described[f"{name}.shape"] = tuple(leaf.shape)
            described[f"{name}.dtype"] = leaf.dtype
            described[f"{name}.device"] = leaf.device
            described[f"{name}.requires_grad"] = leaf.requires_grad
            # (the key has the exact strides: a size-1 dim's too, which `is_contiguous` ignores)
            described[f"{name}.stride()"] = "contiguous" if _row_major(leaf) else leaf.stride()
        elif isinstance(leaf, NUMPY_ARRAYS):
            described[name] = array_key(leaf)
        else:
            described[name] = leaf
    return described


def tensor_names(fn, module=None) -> dict[int, str]:
    """A name per tensor id for the tensors a call may reach besides its arguments, for naming
    the flags it read (`FlagReads.describe`): the parameters and buffers of `module` (by their
    names in it) and of the modules `fn` reads as globals or closure cells (`a.weight`), and the
    tensors it reads so (`w`). One named twice keeps its first name."""
    roots: list[tuple[str, object]] = [("", module)] if module is not None else []
    inner = getattr(fn, "__func__", fn)
    code = getattr(inner, "__code__", None)
    if code is not None:
        namespace = getattr(inner, "__globals__", {})
        roots += [(name, namespace[name]) for name in sorted(global_names(code))
                  if name in namespace]
        for name, cell in zip(code.co_freevars, inner.__closure__ or ()):
            try:
                roots.append((name, cell.cell_contents))
            except ValueError:  # an empty cell
                continue
    names: dict[int, str] = {}
    for root, value in roots:
        if isinstance(value, Tensor):
            names.setdefault(id(value), root)
        elif isinstance(value, torch.nn.Module):
            for name, tensor in [*value.named_parameters(remove_duplicate=False),
                                 *value.named_buffers(remove_duplicate=False)]:
                names.setdefault(id(tensor), f"{root}.{name}" if root else name)
    return names


def _differs(old: object, new: object) -> bool:
    if isinstance(old, float) and isinstance(new, float):
        return _float_key(old) != _float_key(new)
    return old != new and not (old != old and new != new)


def explain_change(old: dict[str, object], new: dict[str, object]) -> list[str]:
    """`['x.shape changed from (4, 4) to (8, 4)', ...]`: why `new` missed the cache."""
    reasons = []
    for key in dict.fromkeys([*old, *new]):
        if key not in old:
            reasons.append(f"{key} is new ({new[key]!r})")
        elif key not in new:
            reasons.append(f"{key} is gone (was {old[key]!r})")
        elif _differs(old[key], new[key]):
            reasons.append(f"{key} changed from {old[key]!r} to {new[key]!r}")
    return reasons or ["the input structure changed"]
