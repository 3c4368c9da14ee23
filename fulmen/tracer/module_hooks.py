"""What a jitted module needs to behave like the module it wraps.

- `HookWatch`: forward and backward hooks (and pre-hooks) of a module's submodules, and the
  global module hooks, run while the module is traced, so they are part of the trace. A hook
  added or removed after jitting must retrace; `changed()` tells, at O(1) per call in the
  common case: a registration anywhere bumps `RemovableHandle.next_id`, and a removal shrinks
  one of the dicts that held hooks at the last check (only those are looked at).
  Hooks that run in the backward (`register_full_backward_hook`) cannot be traced; the
  modules holding them are listed in `backward_hooked` so the caller can refuse.
- `StructureWatch`: the submodules, parameters and buffers a module holds. A submodule
  replaced (`resize_token_embeddings`, a new head), a parameter assigned or registered after
  jitting changes what the compiled program must read; `changed()` says so.
- `TieWatch`: the tensors a module holds in more than one place (tied weights), which the
  compiled program reads once; `broken()` says when the places hold different tensors now.
- `strip_wrapper_prefix` / `add_wrapper_prefix`: state-dict hooks that make a wrapper's state
  dict read like the wrapped module's (`linear.weight`, not `_orig_mod.linear.weight`), so
  checkpoints move freely between a module and its jitted wrapper; both spellings load.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.hooks import RemovableHandle

from fulmen.core.errors import RunsEagerly

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_modules_module = torch.nn.modules.module
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                      "_global_backward_pre_hooks", "_global_backward_hooks")


def _backward_hooked(named) -> list[str]:
    """The names among `named` (`(name, module)` pairs) of the modules whose hooks run in the
    backward (and a line for global backward hooks): their BackwardHookFunction sees traced
    tensors, so the hooks would silently never fire."""
    hooked = [name for name, sub in named
              if getattr(sub, "_backward_hooks", None) or getattr(sub, "_backward_pre_hooks", None)]
    if any(getattr(_modules_module, name, None) for name in _GLOBAL_HOOK_DICTS[2:]):
        hooked.append("every module (global backward hooks)")
    return hooked


class HookWatch:
    """Watches the hooks of `module` and its submodules (as they were when it was made)."""

    def __init__(self, module: torch.nn.Module) -> None:
        named = list(module.named_modules())
        self.modules = tuple(sub for _, sub in named)
        self.names = tuple(name or type(module).__name__ for name, _ in named)
        self._snapshot(self._keys())

    def _dicts(self) -> list[dict]:
        dicts = [getattr(_modules_module, name) for name in _GLOBAL_HOOK_DICTS
                 if hasattr(_modules_module, name)]
        for sub in self.modules:
            dicts.extend(getattr(sub, name) for name in _HOOK_DICTS if hasattr(sub, name))
        return dicts

    def _keys(self) -> tuple:
        return tuple([tuple(hooks) for hooks in self._dicts()])

    def _snapshot(self, keys: tuple) -> None:
        self.keys = keys
        self.next_id = RemovableHandle.next_id
        self.held = [(hooks, len(hooks)) for hooks in self._dicts() if hooks]
        self.backward_hooked = _backward_hooked(zip(self.names, self.modules))

    def changed(self) -> bool:
        """Whether a hook was added or removed since the last call (or since creation)."""
        if RemovableHandle.next_id == self.next_id and (
                not self.held or all([len(hooks) == count for hooks, count in self.held])):
            return False
        keys = self._keys()
        changed = keys != self.keys
        self._snapshot(keys)
        return changed


_registrations = [0]  # submodules, parameters and buffers assigned anywhere, counted


def _count_registration(module, name, value) -> None:
    # not while torch.compile traces: Dynamo would guard on the count, and code that assigns a
    # submodule in its forward (HF's output capturing) would recompile at every call
    if not torch.compiler.is_compiling():
        _registrations[0] += 1


def _count_registrations() -> None:
    """Install (once) global hooks counting every submodule/parameter/buffer assignment."""
    if _count_registration not in _modules_module._global_module_registration_hooks.values():
        _modules_module.register_module_module_registration_hook(_count_registration)
        _modules_module.register_module_parameter_registration_hook(_count_registration)
        _modules_module.register_module_buffer_registration_hook(_count_registration)


class StructureWatch:
    """Watches which submodules, parameters and buffers `module` and its submodules hold.

    `changed()` is O(1) while no assignment happened anywhere (global registration hooks count
    them); otherwise, and when a holder shrank (`del module.x`), it compares each holder dict
    with its snapshot by identity (C-level, no tensor comparison).
    """

    _HOLDERS = ("_modules", "_parameters", "_buffers")

    def __init__(self, module: torch.nn.Module, parameters_set_to_none: bool = False) -> None:
        _count_registrations()
        holders = [getattr(sub, kind) for sub in module.modules() for kind in self._HOLDERS]
        self._held = [(holder, tuple(holder.values())) for holder in holders if holder]
        self._held_dicts = tuple(holder for holder, _ in self._held)
        self._held_counts = tuple(len(values) for _, values in self._held)
        self._empty = [holder for holder in holders if not holder]
        self._seen = _registrations[0]
        # `m.bias = None` calls no registration hook and keeps the dict's length: with
        # `parameters_set_to_none`, parameter dicts are compared by the ids of what they hold on
        # every call (about 0.15 µs each; ids, not `==`, which would compare tensors elementwise;
        # `_held` keeps the objects alive). A jitted module leaves it off: its state key sees
        # the None.
        self._parameter_ids = [(sub._parameters, tuple(map(id, sub._parameters.values())))
                               for sub in module.modules()
                               if parameters_set_to_none and sub._parameters]

    def changed(self) -> bool:
        """Whether anything was added, removed or replaced since the watch was made."""
        if self._seen == _registrations[0] \
                and tuple(map(len, self._held_dicts)) == self._held_counts \
                and all([tuple(map(id, holder.values())) == ids
                         for holder, ids in self._parameter_ids]):
            return False
        self._seen = _registrations[0]
        if any(map(len, self._empty)):
            return True
        is_ = operator.is_
        for holder, values in self._held:
            if len(holder) != len(values) or not all(map(is_, holder.values(), values)):
                return True
        return False


class TiesBroken(RunsEagerly):
    """Places of a module that held one tensor when it was jitted (tied weights) hold
    different ones: `torch.func.functional_call(jmodel, {"embed.weight": w},
    tie_weights=False)` swaps `w` in for the first place only. The compiled program reads the
    tensor once (`state_slots`), so it would compute with `w` in both; the call runs eagerly."""

    remembered = False  # (the swap is undone after the call)


class TieWatch:
    """The parameters and buffers `module` holds in more than one place, which `state_slots`
    reads from their first place only (NOTE in `TiesBroken`). `broken()`: whether a later
    place holds another tensor than the first now; a check per tie (none in most models)."""

    def __init__(self, module: torch.nn.Module) -> None:
        first: dict[int, tuple[dict, str]] = {}
        self._ties: list[tuple[dict, str, dict, str]] = []
        for sub in module.modules():
            for kind in ("_parameters", "_buffers"):
                holder = getattr(sub, kind)
                for key, tensor in holder.items():
                    if tensor is None:
                        continue
                    if id(tensor) in first:
                        self._ties.append((holder, key, *first[id(tensor)]))
                    else:
                        first[id(tensor)] = (holder, key)

    def broken(self) -> str | None:
        """The name of a place that no longer holds its first place's tensor, or None."""
        for holder, key, owner, name in self._ties:
            if holder.get(key) is not owner.get(name):
                return key
        return None


class HeldModulesWatch:
    """The hooks and structure of the modules a jitted function reached besides a jitted module
    (`fulmen.tracer.module_stores.held_modules`: `step(model, batch)`'s `model`, a global):
    a hook added or removed, a submodule or parameter replaced there changes what the compiled
    programs computed, as for a jitted module (`HookWatch`, `StructureWatch`)."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[torch.nn.Module, HookWatch, StructureWatch]] = {}

    def add(self, modules) -> None:
        """Watch `modules` (those not watched yet)."""
        for module in modules:
            if id(module) not in self._watched:
                self._watched[id(module)] = (module, HookWatch(module),
                                             StructureWatch(module, parameters_set_to_none=True))

    def changed(self) -> bool:
        """Whether a watched module's hooks or structure changed (then nothing is watched
        anymore: the next traces add what they reach)."""
        if not self._watched:
            return False
        changed = False
        for _, hooks, structure in self._watched.values():
            changed |= structure.changed() | hooks.changed()
        if changed:
            self._watched.clear()
        return changed


def backward_hooked(modules) -> list[str]:
    """Names of the modules among `modules` (and their submodules) holding backward hooks,
    which a trace cannot run (they would never fire)."""
    return _backward_hooked((name or type(module).__name__, sub) for module in modules
                            for name, sub in module.named_modules())


WRAPPED = "_orig_mod."


def strip_wrapper_prefix(module, state_dict, prefix: str, local_metadata) -> None:
    """State-dict post hook: `<prefix>_orig_mod.<key>` -> `<prefix><key>` (and metadata)."""
    inner = prefix + WRAPPED
    for key in [key for key in state_dict if key.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [key for key in metadata if key.startswith(inner) or key == inner[:-1]]:
            value = metadata.pop(key)
            metadata[prefix + key[len(inner):] if key != inner[:-1] else prefix[:-1]] = value


def add_wrapper_prefix(module, state_dict, prefix: str, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre hook: accept the wrapped module's keys (`<prefix><key>`) as well as
    the wrapper's (`<prefix>_orig_mod.<key>`)."""
    inner = prefix + WRAPPED
    for key in [key for key in state_dict if key.startswith(prefix)
                and not key.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # the caller's own dict: add entries, never remove any
        for key in [key for key in metadata if (key.startswith(prefix) or key == prefix[:-1])
                    and not key.startswith(inner)]:
            inner_key = inner[:-1] if key == prefix[:-1] else inner + key[len(prefix):]
            metadata.setdefault(inner_key, metadata[key])


__all__ = ["HookWatch", "TieWatch", "TiesBroken", "add_wrapper_prefix", "strip_wrapper_prefix"]
